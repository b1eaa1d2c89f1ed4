"""Several trainers per job, the pieces: exact NaN-proof gradient averaging over real hivemind
averagers, the shareable trainer state, the cotrainer rules and disjoint prompt shards."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from swarmrl.node.swarm.averaging import AveragerStartFailed, GradientAveraging
from swarmrl.node.swarm.cotrainers import Cotrainers
from swarmrl.node.swarm.dht import VerifiedRecord, start_dht, visible_maddrs
from swarmrl.node.swarm.trainer_state import SharedState, pack, priority, unpack
from swarmrl.node.trainer.leases import LeaseBook
from swarmrl.protocol import adapter as ad
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

SHAPES = [(300, 7), (5000,)]


@pytest.fixture(scope="module")
def averagers():
    first = start_dht()
    dhts = [first] + [start_dht(visible_maddrs(first)) for _ in range(2)]
    avgs = [GradientAveraging(d, "job1", [torch.zeros(s) for s in SHAPES], identity=Identity.generate(),
                              matchmaking_s=1.0, chunk_timeout_s=5,
                              allreduce_timeout_s=10) for d in dhts]
    yield avgs
    for a in avgs:
        a.shutdown()
    for d in dhts:
        d.shutdown()


def _round(avgs, grads, weights, version):
    outs = [None] * len(avgs)

    def run(i: int) -> None:
        pending = avgs[i].begin(version, {"i": i})
        outs[i] = avgs[i].finish(pending, grads[i], weights[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(avgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def test_members_get_bit_identical_weighted_averages_without_the_nan_peer(averagers):
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(3)]
    grads[2][1][17] = float("nan")      # peer 2 is broken in its second tensor
    weights = [3.0, 5.0, 7.0]
    outs = _round(averagers, grads, weights, version=4)
    assert all(o.agreed and o.contributed and o.group_size == 3 for o in outs)
    for o in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0].averaged, o.averaged))   # bit-identical
    all_three = (grads[0][0] * 3 + grads[1][0] * 5 + grads[2][0] * 7) / 15
    without_nan = (grads[0][1] * 3 + grads[1][1] * 5) / 8
    assert torch.allclose(outs[0].averaged[0], all_three, atol=1e-6)
    assert torch.allclose(outs[0].averaged[1], without_nan, atol=1e-6)
    assert sum(len(o.excluded) for o in outs) >= 1


def test_starting_an_averager_keeps_this_process_s_ctrl_c_handler():
    """hivemind's `run_in_background` sets SIGINT to SIG_IGN in the calling process; a trainer with
    cotrainers would then ignore Ctrl-C. GradientAveraging puts the handler back."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: seen.append(signum))
    dht = start_dht()
    try:
        avg = GradientAveraging(dht, "job-sigint", [torch.zeros(3)], identity=Identity.generate(), matchmaking_s=1.0)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)   # the handler runs between bytecodes of the main thread
            assert seen == [signal.SIGINT]
        finally:
            avg.shutdown()
    finally:
        dht.shutdown()
        signal.signal(signal.SIGINT, previous)


def test_an_averager_that_is_not_ready_in_time_is_ended_and_says_so():
    """hivemind's own start waits for the averager's process with no limit (a restarted trainer
    hung there under load); ours gives up after `start_timeout_s`, ends the process and raises."""
    dht = start_dht()
    before = {p.pid for p in multiprocessing.active_children()}
    try:
        with pytest.raises(AveragerStartFailed, match="not ready after"):
            GradientAveraging(dht, "job-slow", [torch.zeros(3)], identity=Identity.generate(), matchmaking_s=1.0,
                              start_timeout_s=1e-6)
        left = [p for p in multiprocessing.active_children() if p.pid not in before]
        assert not left, left
    finally:
        dht.shutdown()


def test_a_round_without_weight_agrees_on_zeros(averagers):
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(2)] + [[torch.full(s, float("nan")) for s in SHAPES]]
    outs = _round(averagers, grads, [0.0, 0.0, 0.0], version=9)
    assert all(o.agreed and not o.contributed for o in outs)
    assert all(bool((t == 0).all()) for o in outs for t in o.averaged)


def test_a_lone_round_fails_over_to_the_local_gradient(averagers):
    pending = averagers[0].begin(5, {})
    out = averagers[0].finish(pending, [torch.ones(s) for s in SHAPES], 1.0)
    assert not out.agreed and out.reason == "no_group" and out.averaged is None


def test_shared_state_round_trip_and_hash_check():
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    params[0].grad = torch.randn(4, 3)
    opt.step()                              # state for param 0 only
    adapter = {"b": torch.randn(2, 2), "a": torch.randn(3)}
    shared = SharedState("j", "t" * 40, 7, ad.adapter_hash(adapter), adapter, opt.state_dict())
    meta, tensors = pack(shared, params)
    back = unpack(meta, tensors, params, opt.state_dict()["param_groups"])
    assert back.version == 7 and ad.adapter_hash(back.adapter) == shared.adapter_hash
    assert torch.equal(back.optimizer["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert 1 not in back.optimizer["state"]
    fresh = torch.optim.AdamW(params, lr=1e-3)
    fresh.load_state_dict(back.optimizer)
    meta["hash"] = "00" * 32
    with pytest.raises(ValueError, match="hash"):
        unpack(meta, tensors, params, opt.state_dict()["param_groups"])
    assert priority(3, "0" * 40) > priority(3, "f" * 40) > priority(2, "0" * 40)


def _record(trainer: str, version: int, head: bytes) -> VerifiedRecord:
    return VerifiedRecord(pb.JobRecord(job_id="J", trainer_id=trainer, endpoint="x", head_version=version,
                                       head_hash=head), trainer, b"k" * 32)


def test_cotrainer_rules_ahead_then_split_towards_the_smaller_id():
    me = "5" * 40
    view = Cotrainers("J", me, allowed={"1" * 40, "9" * 40})
    view.update([_record("1" * 40, 3, b"a"), _record("9" * 40, 4, b"b"), _record("7" * 40, 9, b"c"),
                 _record(me, 3, b"m")])
    assert [c.trainer_id for c in view.live()] == ["1" * 40, "9" * 40]        # "7..." is not allowed
    assert view.sync_target(3, b"m").trainer_id == "9" * 40                    # ahead wins
    assert view.sync_target(4, b"m") is None                                   # "9..." split, but its id is larger
    view.update([_record("1" * 40, 4, b"a"), _record("9" * 40, 4, b"b")])
    assert view.sync_target(4, b"m").trainer_id == "1" * 40                    # split: smaller id wins
    assert Cotrainers("J", "0" * 40).sync_target(4, b"m") is None
    view.mark_unreachable("1" * 40)
    assert view.sync_target(4, b"m") is None                                   # "9..." > me: it adopts ours


def test_prompt_shards_are_disjoint_and_survive_a_restart():
    sampling = pb.SamplingParams()
    a, b = LeaseBook("J", ttl_ms=10, shard=(0, 2)), LeaseBook("J", ttl_ms=10, shard=(1, 2))
    got_a = [i for _ in range(3) for i in a.issue("p", 2, 0, sampling, 0).prompt_indices]
    got_b = [i for _ in range(3) for i in b.issue("p", 2, 0, sampling, 0).prompt_indices]
    assert got_a == [0, 2, 4, 6, 8, 10] and got_b == [1, 3, 5, 7, 9, 11]
    restored = LeaseBook("J", ttl_ms=10, shard=(1, 2))
    restored.restore([], admitted={1, 5, 7, 9, 11, 0, 2})
    assert list(restored.issue("p", 2, 0, sampling, 0).prompt_indices) == [3, 13]
    with pytest.raises(ValueError):
        LeaseBook("J", ttl_ms=10, shard=(2, 2))


def test_diloco_cotrainer_rules_count_outer_versions_only():
    """With DiLoCo (H = 4) a cotrainer that finished a round we missed is ahead whatever inner
    version it is at now (a restarted trainer caught only that at a moment its head was an outer
    version, and a real swarm rejoined only at the job's end); inner versions never split."""
    me, other = "5" * 40, "1" * 40
    view = Cotrainers("J", me, allowed={other}, inner_steps=4)
    view.update([_record(other, 13, b"a")])         # its last outer version is 12
    assert view.sync_target(7, b"m").trainer_id == other          # ours is 4: it finished 8 and 12
    assert view.sync_target(9, b"m").trainer_id == other          # ours is 8: it took the round at 12 without us
    assert view.sync_target(13, b"m") is None                     # same round, inner versions: each its own
    assert view.sync_target(12, b"m") is None                     # our round is its round
    view.update([_record(other, 12, b"a")])
    assert view.sync_target(12, b"m").trainer_id == other         # the same outer version, another adapter
    assert view.sync_target(12, b"a") is None
    assert view.sync_target(11, b"m").trainer_id == other         # it took the round at 12 without us
