"""The swarm layer with real processes on loopback: three trainers serve one tiny job (two
honest, one whose gradients are NaN) and two workers gossip its adapter deltas. The trainers
average their gradients and agree on every version, the NaN peer's gradient is left out of the
average; a late worker catches up (deltas from peers); a worker past the gap limit takes a
snapshot; a trainer killed with SIGKILL leaves the job running and the others in agreement; it
restarts from its checkpoint, adopts the cotrainers' state and rejoins.

The tests share one swarm (module fixture) and run in order.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from swarmrl.node.local.processes import LocalSwarm
from swarmrl.node.net.grpc_wire import GrpcWire
from swarmrl.node.net.trainer_client import TrainerClient
from swarmrl.node.submitter.client import job_status, sign_job, stub, submit_signed
from swarmrl.node.swarm.catchup import CatchUp
from swarmrl.node.swarm.dht import start_dht
from swarmrl.node.swarm.gossip import GossipNode
from swarmrl.node.swarm.holders import find_holders
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import AdapterReplica, assemble

pytestmark = pytest.mark.integration
TRAINERS = ("trainer0", "trainer1", "trainer2")   # trainer2 is the NaN peer


@dataclass
class Swarm:
    procs: LocalSwarm
    work: Path
    keys: dict[str, Identity]
    peers: list[str]
    cache: Path
    dht: object = None             # this test process's own DHT node (hivemind.DHT)
    job_id: str = ""
    envelope: pb.Signed | None = None
    endpoints: dict[str, str] = field(default_factory=dict)

    def status(self, name: str) -> pb.JobStatus:
        return job_status(self.endpoints[name], self.job_id, timeout_s=10)

    def start_trainer(self, name: str, rank: int, extra: list[str] = (), wait: bool = True) -> str:
        ready = self.work / f"{name}.ready"
        ready.unlink(missing_ok=True)
        ids = [self.keys[t].peer_id for t in TRAINERS]
        self.procs.start(name, "trainer", [
            f"net.initial_peers={json.dumps(self.peers)}", f"cache_dir={json.dumps(str(self.cache))}",
            f"key={json.dumps(str(self.work / 'keys' / (name + '.key')))}",
            f"state_dir={json.dumps(str(self.work / name))}", f"ready_file={json.dumps(str(ready))}",
            f"prompt_shard={json.dumps([rank, len(TRAINERS)])}", f"cotrainers={json.dumps(ids)}",
            "averaging_matchmaking_s=1.0", "averaging_timeout_s=10", *extra])
        return self.wait_trainer(name) if wait else ""

    def wait_trainer(self, name: str) -> str:
        self.endpoints[name] = self.procs.wait_ready(name, self.work / f"{name}.ready", timeout_s=180)["endpoint"]
        return self.endpoints[name]

    def kill(self, name: str) -> None:
        """SIGKILL the trainer and everything it started (its DHT and averager processes, p2pd)."""
        p = self.procs.procs[name]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str, log: Path | None = None) -> None:
    """Poll `cond` until it holds. `timeout_s` is a ceiling against a hang, not a speed bound: it
    returns as soon as the event happens. Agreement ceilings are 180 s: at 60-90 s they timed out
    in a make test at load 13 on 2 cores (beside other work). `log`: a node's log whose tail the
    failure shows."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= deadline:
            tail = f"\n--- {log.name}\n{log.read_text()[-4000:]}" if log is not None and log.exists() else ""
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}{tail}")
        time.sleep(0.5)


def same_state(sw: Swarm, names: list[str]) -> bool:
    try:
        got = {(s.policy_version, bytes(s.adapter_hash)) for s in (sw.status(n) for n in names)}
    except grpc.RpcError:
        return False
    return len(got) == 1


@pytest.fixture(scope="module")
def sw(tmp_path_factory, model_cache) -> Swarm:
    work = tmp_path_factory.mktemp("swarm_layer")
    procs = LocalSwarm(work)
    keys = {}
    for name in (*TRAINERS, "worker0", "worker1", "submitter"):
        keys[name] = Identity.generate()
        keys[name].save(work / "keys" / f"{name}.key")
    try:
        procs.start("bootstrap", "bootstrap", [f"ready_file={json.dumps(str(work / 'bootstrap.ready'))}"])
        peers = procs.wait_ready("bootstrap", work / "bootstrap.ready")["maddrs"]
        s = Swarm(procs, work, keys, peers, model_cache, start_dht(peers))
        s.start_trainer("trainer0", 0, wait=False)
        s.start_trainer("trainer1", 1, wait=False)
        s.start_trainer("trainer2", 2, ["fault=\"nan_gradients\""], wait=False)
        for i, w in enumerate(("worker0", "worker1")):
            procs.start(w, "worker", [
                f"net.initial_peers={json.dumps(peers)}", f"cache_dir={json.dumps(str(model_cache))}",
                f"key={json.dumps(str(work / 'keys' / (w + '.key')))}", "base_model=\"tiny\"",
                f"ready_file={json.dumps(str(work / (w + '.ready')))}", "sync_poll_s=0.3", "peer_wait_s=0.5",
                f"prefer_trainer={json.dumps(keys[TRAINERS[i]].peer_id)}"])
        spec = builtin_job("tiny", model_cache, steps=500, batch_groups=2, prompts_per_lease=2, max_async_level=2)
        s.envelope = sign_job(keys["submitter"], spec)
        s.job_id = submit_signed(s.wait_trainer("trainer0"), s.envelope)
        for t in TRAINERS[1:]:
            assert submit_signed(s.wait_trainer(t), s.envelope) == s.job_id
        yield s
    finally:
        procs.stop_all()
        if "s" in locals() and s.dht is not None:
            s.dht.shutdown()


def test_trainers_average_and_agree_on_every_version(sw: Swarm):
    """The trainers average and publish the same adapter at each version. A round hivemind can't
    finish (e.g. "received 91.2% results") makes each trainer step on its own gradient, so that
    version differs until the split resolves towards the smaller trainer id (`node/swarm/
    cotrainers.py`): allowed only as a rare, resolved split, i.e. a later version they agree on."""
    wait_for(lambda: min(sw.status(t).policy_version for t in TRAINERS[:2]) >= 3, 150, "three versions")
    seen: dict[str, dict[int, bytes]] = {t: {} for t in TRAINERS[:2]}
    start = time.monotonic()
    while True:
        for t in TRAINERS[:2]:
            st = sw.status(t)
            seen[t][int(st.policy_version)] = bytes(st.adapter_hash)
        common = set(seen["trainer0"]) & set(seen["trainer1"])
        agree = sorted(v for v in common if seen["trainer0"][v] == seen["trainer1"][v])
        differ = sorted(v for v in common if seen["trainer0"][v] != seen["trainer1"][v])
        if time.monotonic() - start >= 6 and len(agree) >= 2 and (not differ or agree[-1] > differ[-1]):
            break
        assert time.monotonic() - start < 90, f"the trainers did not (re)converge: agree {agree}, differ {differ}"
        time.sleep(0.2)
    assert len(differ) <= 1, f"trainers disagree at versions {differ} (agree at {agree})"
    for t, other in (("trainer0", "trainer1"), ("trainer1", "trainer0")):
        st = sw.status(t)
        assert st.averaging_rounds >= 2 and sw.keys[other].peer_id in st.cotrainers


@pytest.fixture(scope="module")
def late(sw: Swarm):
    """An in-process worker that joins late: a gossip node on this process's DHT node, a replica."""
    gossip = GossipNode(sw.dht, Identity.generate())
    trainer = TrainerClient(GrpcWire(sw.endpoints["trainer0"], b"", max_message_mb=64))
    replica = AdapterReplica(sw.job_id, sw.keys["trainer0"].public_key)
    signers = {sw.keys[t].peer_id for t in TRAINERS}
    cu = CatchUp(replica, trainer=trainer, signers=lambda: signers, gossip=gossip, dht=sw.dht, max_gap=8,
                 peer_wait_s=0.5)
    yield cu
    trainer.close()
    gossip.shutdown()


def _trainer_hash(sw: Swarm, version: int, trainer: str = "trainer0") -> bytes:
    """The adapter hash `trainer` published at `version`, once it has: the workers' gossip can
    carry a cotrainer's version before this trainer publishes its own (it lagged under load in CI,
    and a trainer answers no update for a version it has not published)."""
    wait_for(lambda: sw.status(trainer).policy_version >= version, 180, f"{trainer} publishing version {version}")
    req = pb.AdapterRequest(job_id=sw.job_id, want_version=version, snapshot=True)
    updates = list(assemble(stub(sw.endpoints[trainer]).FetchAdapter(req, timeout=60), sw.keys[trainer].peer_id))
    assert updates, f"{trainer} at version >= {version} sent no snapshot of version {version}"
    return bytes(updates[0].header.to_hash)


def _published_hashes(sw: Swarm, version: int) -> set[bytes]:
    """The hashes the honest trainers published at `version`: one, or two at a rare split round
    (see test_trainers_average_and_agree_on_every_version); a replica built from the workers'
    gossip holds one of them."""
    return {_trainer_hash(sw, version, t) for t in TRAINERS[:2]}


def _peer_chain(sw: Swarm, head: int, want: int = 2, max_gap: int = 6) -> int | None:
    """The newest version v in (head + want - 1, head + max_gap] such that peers announce every delta
    head+1..v, or None. A worker that fell behind under load may jump a stretch by a snapshot and
    never hold those deltas (CI: both workers were to hold versions 8 and 9, one never did), so
    the test takes whatever consecutive stretch the peers hold rather than two fixed versions."""
    held = find_holders(sw.dht, sw.job_id)
    v = head
    while v < head + max_gap and held.get((v + 1, False)):
        v += 1
    return v if v >= head + want else None


def _adopted_at(sw: Swarm, version: int) -> bool:
    """Whether an honest trainer adopted a cotrainer's state at `version` (a split round: the hash
    it had published there first is superseded, though the workers' gossip may still carry it)."""
    return any(f"adopted version {version} (" in (sw.work / "logs" / f"{t}.log").read_text(errors="replace")
               for t in TRAINERS[:2])


def test_late_worker_catches_up_and_then_gets_deltas_from_peers(sw: Swarm, late: CatchUp):
    for _ in range(3):   # a split round's superseded version is a fine place to be, but not to go on from
        head = int(sw.status("trainer0").policy_version)
        late.run(head)
        assert late.replica.version == head
        if late.replica.hash in _published_hashes(sw, head):
            break
        assert _adopted_at(sw, head), f"the replica's version {head} is no trainer's, and no split happened there"
    else:
        pytest.fail("three catch-ups in a row ended on split rounds")
    # the next versions: wait until peers hold a run of at least two deltas past head, then catch
    # up from peers only.
    wait_for(lambda: _peer_chain(sw, late.replica.version) is not None, 180,
             f"peers holding two consecutive deltas after version {head}", sw.work / "logs" / "worker0.log")
    target = _peer_chain(sw, late.replica.version)
    assert target is not None
    from_trainer = late.stats.bytes_from_trainer
    late.run(target)
    assert late.replica.version == target and late.replica.hash in _published_hashes(sw, target)
    assert late.stats.bytes_from_trainer == from_trainer and late.stats.peer_updates >= 2


def test_worker_past_the_gap_takes_a_snapshot(sw: Swarm, late: CatchUp):
    late.max_gap = 2
    have = late.replica.version
    wait_for(lambda: sw.status("trainer0").policy_version >= have + 3, 120, "three more versions")
    head = int(sw.status("trainer0").policy_version)
    snapshots = late.stats.snapshots
    late.run(head)
    # one snapshot at some version in (have, head] (the newest stored within reach: the trainers
    # publish while it catches up), then consecutive deltas to head
    applied = late.replica.applied
    after = applied[len(applied) - applied[::-1].index(have):]   # what it applied after `have`
    assert late.stats.snapshots == snapshots + 1, applied
    assert after and have < after[0] <= head and after == list(range(after[0], head + 1)), (have, head, after)
    # the snapshot may be a trainer's first hash at a split round, superseded when it adopted its
    # cotrainer's state (CI: a snapshot of version 15 that neither trainer held any more)
    assert late.replica.hash in _published_hashes(sw, head) or _adopted_at(sw, head), \
        f"the replica's version {head} is no trainer's, and no split happened there"


def test_a_peer_with_nan_gradients_is_excluded(sw: Swarm):
    wait_for(lambda: sum(sw.status(t).averaging_excluded for t in TRAINERS[:2]) > 0, 90, "a NaN gradient excluded")
    v = sw.status("trainer0").policy_version
    wait_for(lambda: sw.status("trainer0").policy_version >= v + 2, 90, "two more versions with the NaN peer")
    wait_for(lambda: same_state(sw, list(TRAINERS)), 180, "all three trainers holding the same adapter")
    assert sw.status("trainer2").averaging_rounds >= 1


def test_sigkill_of_a_trainer_leaves_the_job_running_and_the_others_agreeing(sw: Swarm):
    before = sw.status("trainer0").policy_version
    sw.kill("trainer1")
    wait_for(lambda: sw.status("trainer0").policy_version >= before + 3, 150, "three versions after the kill")
    wait_for(lambda: same_state(sw, ["trainer0", "trainer2"]), 180, "the survivors agreeing")
    assert sw.keys["trainer1"].peer_id not in sw.status("trainer0").cotrainers


def test_restarted_trainer_resumes_from_its_checkpoint_and_rejoins(sw: Swarm):
    sw.start_trainer("trainer1", 1)     # same key and state dir: resumes, re-hosts the job from its ledger
    log = sw.work / "logs" / "trainer1.log"
    assert "resumed at version" in log.read_text()
    wait_for(lambda: sw.status("trainer1").state_syncs >= 1, 180, "trainer1 adopting the cotrainers' state", log)
    wait_for(lambda: sw.status("trainer1").averaging_rounds >= 1, 180, "trainer1 averaging again", log)
    wait_for(lambda: same_state(sw, list(TRAINERS)), 180, "all trainers agreeing after the restart", log)
