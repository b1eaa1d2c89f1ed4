"""Delta gossip between real hivemind nodes on loopback: signed holder records, catch-up from a
peer with the trainer as fallback, exact reconstruction, a lying peer dropped, the bootstrap
error naming unreachable peers."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from swarmrl.node.swarm.catchup import CatchUp
from swarmrl.node.swarm.dht import SwarmError, start_dht, visible_maddrs
from swarmrl.node.swarm.gossip import GossipNode
from swarmrl.node.swarm.holders import find_holders, holders_key
from swarmrl.node.trainer.adapter_store import AdapterStore
from swarmrl.protocol import adapter as ad
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import AdapterReplica, ReceivedUpdate, chunks

JOB = "ab" * 16
VERSIONS = 4


class TrainerFetch:
    """The trainer's FetchAdapter over a real AdapterStore, without gRPC; counts payload bytes."""

    def __init__(self, store: AdapterStore, head: int) -> None:
        self.store, self.head, self.bytes = store, head, 0

    def fetch_adapter(self, req: pb.AdapterRequest) -> Iterator[pb.AdapterChunk]:
        for update in self.store.updates(req, self.head):
            self.bytes += len(update.payload)
            yield from chunks(update.header, update.payload)


def _publish(root: Path, job_id: str) -> tuple[Identity, AdapterStore, list[ad.State]]:
    trainer = Identity.from_seed(b"t" * 32)
    store = AdapterStore(root / "adapters", job_id, trainer)
    gen = torch.Generator().manual_seed(0)
    states = [{"l.lora_A.weight": torch.randn(8, 64, generator=gen), "l.lora_B.weight": torch.zeros(64, 8)}]
    store.put_snapshot(0, states[0])
    for v in range(1, VERSIONS + 1):
        target = {k: t + 1e-3 * torch.randn(t.shape, generator=gen) for k, t in states[-1].items()}
        exact, _ = store.publish(v, states[-1], target)
        states.append(exact)
    return trainer, store, states


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Identity, AdapterStore, list[ad.State]]:
    return _publish(tmp_path_factory.mktemp("store"), JOB)


@pytest.fixture(scope="module")
def nodes():
    first = start_dht()
    others = [start_dht(visible_maddrs(first)) for _ in range(2)]
    dhts = [first, *others]
    gossips = [GossipNode(d, Identity.generate()) for d in dhts]
    yield dhts, gossips
    for g in gossips:
        g.shutdown()
    for d in dhts:
        d.shutdown()


def _received(update) -> ReceivedUpdate:
    header, _ = signing.open_signed(update.header, signing.ADAPTER_UPDATE, pb.AdapterUpdate)
    return ReceivedUpdate(header, update.header, update.payload)


def _catchup(gossip: GossipNode, dht, fetch: TrainerFetch, trainer: Identity, job_id: str = JOB,
             **kw) -> CatchUp:
    replica = AdapterReplica(job_id, trainer.public_key)
    return CatchUp(replica, trainer=fetch, signers=lambda: {trainer.peer_id}, gossip=gossip, dht=dht,
                   **{"peer_wait_s": 0.0, **kw})


def test_unreachable_bootstrap_names_its_peers():
    bogus = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRwhU8ahZP1Et8jqbrF57eU67BrM9GHYufXouhtaZ9U7x"
    with pytest.raises(SwarmError, match="tcp/9/p2p/12D3KooWRwhU8ahZP1Et8"):
        start_dht([bogus])


def test_peer_serves_deltas_and_the_trainer_is_only_the_fallback(published, nodes):
    trainer, store, states = published
    (dht_a, dht_b, _), (seed, leecher, _) = nodes
    # peer A caught up from the trainer: it holds v0 (snapshot) and the deltas 1..VERSIONS.
    first = _catchup(seed, dht_a, TrainerFetch(store, VERSIONS), trainer)
    first.run(0)
    first.run(VERSIONS)
    assert first.stats.bytes_from_trainer > 0 and first.replica.hash == ad.adapter_hash(states[-1])
    held = find_holders(dht_b, JOB)
    assert {(v, False) for v in range(1, VERSIONS + 1)} <= set(held) and (0, True) in held

    # peer B joins late: everything from A (the nearest snapshot: the head A rebuilt, issue 24
    # item 5), nothing from the trainer, bit-identical result.
    fetch = TrainerFetch(store, VERSIONS)
    late = _catchup(leecher, dht_b, fetch, trainer)
    late.run(VERSIONS)
    assert fetch.bytes == 0 and late.stats.bytes_from_trainer == 0
    assert late.stats.peer_updates == 1 and late.replica.applied == [VERSIONS]
    assert late.replica.hash == ad.adapter_hash(states[-1])
    assert seed.served_bytes(JOB) == late.stats.bytes_from_peers > 0


def test_past_the_gap_a_snapshot_replaces_the_chain(published, nodes):
    trainer, store, states = published
    (_, _, dht_c), (_, _, node_c) = nodes
    fetch = TrainerFetch(store, VERSIONS)
    cu = _catchup(node_c, dht_c, fetch, trainer, max_gap=2)
    cu.replica.apply(_received(store.snapshot(0)))
    cu.run(VERSIONS)                      # 4 versions behind > gap 2: one snapshot of v4
    assert cu.replica.applied == [0, VERSIONS] and cu.stats.snapshots == 1
    assert cu.replica.hash == ad.adapter_hash(states[-1])


def test_a_lying_peer_wastes_bytes_and_is_dropped(nodes, tmp_path: Path):
    job = "cd" * 16
    trainer, store, states = _publish(tmp_path, job)
    (_, _, dht_c), (liar, _, _) = nodes
    # the liar holds delta 1 with one flipped payload byte but announces the genuine sha256.
    genuine = _received(store.delta(1))
    tampered = bytearray(genuine.payload)
    tampered[len(tampered) // 2] ^= 0xFF
    liar.hold(ReceivedUpdate(genuine.header, genuine.envelope, bytes(tampered)))
    liar.announce(job)
    victim_dht = start_dht(visible_maddrs(dht_c))
    victim_node = GossipNode(victim_dht, Identity.generate())
    try:
        fetch = TrainerFetch(store, VERSIONS)
        cu = _catchup(victim_node, victim_dht, fetch, trainer, job_id=job)
        cu.replica.apply(_received(store.snapshot(0)))
        cu.run(1)
        assert liar.identity.peer_id in cu.stats.dropped_peers and cu.stats.wasted_bytes > 0
        assert cu.replica.version == 1 and cu.replica.hash == ad.adapter_hash(states[1])
        assert fetch.bytes == len(genuine.payload)      # the trainer filled in
    finally:
        victim_node.shutdown()
        victim_dht.shutdown()


def test_forged_holder_records_are_dropped(nodes):
    (dht_a, dht_b, _), _ = nodes
    someone, forger = Identity.generate(), Identity.generate()
    record = pb.DeltaHolder(job_id=JOB, holder_id=someone.peer_id, libp2p_peer_id=b"x", maddrs=["/ip4/127.0.0.1/tcp/1"],
                            updates=[pb.HeldUpdate(version=99, payload_sha256=b"\0" * 32)])
    envelope = signing.sign(forger, signing.DELTA_HOLDER, record)   # claims to be `someone`
    from hivemind.utils import get_dht_time

    assert dht_a.store(holders_key(JOB), envelope.SerializeToString(), expiration_time=get_dht_time() + 30,
                       subkey=someone.peer_id)
    assert (99, False) not in find_holders(dht_b, JOB)


def test_data_set_travels_peer_to_peer_and_a_lying_holder_is_refused(nodes, tmp_path):
    """A data-set file by content address: a peer that holds it serves it over libp2p (the trainer
    is not asked); a holder serving other bytes is refused chunk by chunk and counted."""
    import hashlib
    import json

    from swarmrl.node.swarm.datasets import DatasetFetchStats, DatasetStore, fetch_dataset
    from swarmrl.protocol.envs.dataset import DatasetTask, chunk_hashes

    dhts, gossips = nodes
    data = "".join(json.dumps({"q": f"{i}+1", "a": str(i + 1)}) + "\n" for i in range(2000)).encode() * 30
    task = DatasetTask(dataset="t.jsonl", dataset_sha256=hashlib.sha256(data).hexdigest(), dataset_size=len(data),
                       dataset_chunks=chunk_hashes(data), prompt_field="q", answer_field="a",
                       rewards=[{"name": "exact_match"}])
    assert len(task.dataset_chunks) >= 2
    liar = gossips[2]
    liar.datasets[task.dataset_sha256] = data[::-1]            # serves other bytes under the address
    liar._announce_dataset(task.dataset_sha256)
    gossips[0].hold_dataset(task.dataset_sha256, data)
    asked = []
    stats = DatasetFetchStats()
    got = None
    for _ in range(5):   # the holder order is random: fetch until the honest holder has answered
        got = fetch_dataset(task, DatasetStore(tmp_path / f"c{len(asked)}"), trainer=SimpleNamespace(fetch_dataset=lambda r: asked.append(r) or iter(())),
                            gossip=gossips[1], dht=dhts[1], stats=stats)
        if stats.refused:
            break
    assert got == data and not asked and stats.sources["peer"] >= 1
    assert sum(stats.refused.values()) in (0, 1)
    assert gossips[1].datasets[task.dataset_sha256] == data    # now served by the fetcher too


# ---- at most max_peer_attempts peers per update, then the trainer (issue 13: slow-region)
class _TimingOutGossip:
    """A gossip node whose every peer fetch times out (as GossipNode.fetch does after 30 s); counts them."""

    def __init__(self) -> None:
        self.identity, self.asked, self.held = Identity.generate(), [], []

    def fetch(self, libp2p_peer_id: bytes, req: pb.UpdateRequest, maddrs: tuple[str, ...] = ()) -> list[pb.AdapterChunk]:
        self.asked.append((libp2p_peer_id, req.version, req.snapshot))
        raise TimeoutError("peer fetch timed out")

    def hold(self, update: ReceivedUpdate) -> None:
        self.held.append(update)

    def announce(self, job_id: str) -> None:
        pass


def _many_holders(monkeypatch, signer: str, keys: list[tuple[int, bool]], n: int = 10) -> None:
    from swarmrl.node.swarm import catchup
    from swarmrl.node.swarm.holders import Holder

    held = {k: [Holder(f"peer{i}", f"lp{i}".encode(), b"\0" * 32, 1, signer) for i in range(n)] for k in keys}
    monkeypatch.setattr(catchup, "find_holders", lambda dht, job_id: held)


def _no_wait(monkeypatch) -> None:
    """Once its peer attempts are spent a catch-up goes to the trainer without waiting for holders."""
    def refuse(*args, **kwargs):
        raise AssertionError("waited for a holder after the peer attempts were spent")
    monkeypatch.setattr(CatchUp, "_wait_for_holder", refuse)


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_after_max_peer_attempts_timeouts_the_trainer_serves_the_delta(published, monkeypatch, limit):
    trainer, store, states = published
    _many_holders(monkeypatch, trainer.peer_id, [(1, False)])
    _no_wait(monkeypatch)
    gossip, fetch = _TimingOutGossip(), TrainerFetch(store, 1)
    cu = _catchup(gossip, object(), fetch, trainer, max_peer_attempts=limit)   # type: ignore[arg-type]
    cu.replica.apply(_received(store.snapshot(0)))
    cu.run(1)
    assert len(gossip.asked) == limit and len(set(gossip.asked)) == limit     # 10 holders, `limit` asked
    assert cu.replica.version == 1 and cu.stats.trainer_updates == 1
    assert cu.replica.hash == ad.adapter_hash(states[1])


def test_without_a_bound_every_holder_is_asked_first(published, monkeypatch):
    trainer, store, _ = published
    _many_holders(monkeypatch, trainer.peer_id, [(1, False)])
    gossip = _TimingOutGossip()
    cu = _catchup(gossip, object(), TrainerFetch(store, 1), trainer, max_peer_attempts=0)  # type: ignore[arg-type]
    cu.replica.apply(_received(store.snapshot(0)))
    cu.run(1)
    assert len(gossip.asked) == 10 and cu.stats.trainer_updates == 1


def test_the_snapshot_shares_one_budget_over_its_versions(published, monkeypatch):
    """Joining (holding nothing): peers announce snapshots of v2..v4; two attempts in all, then
    the trainer's snapshot."""
    trainer, store, states = published
    _many_holders(monkeypatch, trainer.peer_id, [(v, True) for v in range(2, VERSIONS + 1)])
    _no_wait(monkeypatch)
    gossip, fetch = _TimingOutGossip(), TrainerFetch(store, VERSIONS)
    cu = _catchup(gossip, object(), fetch, trainer, max_peer_attempts=2, peer_wait_s=5.0)  # type: ignore[arg-type]
    cu.run(VERSIONS)
    assert len(gossip.asked) == 2 and all(snap for _, _, snap in gossip.asked)
    assert cu.stats.snapshots == 1 and cu.stats.trainer_updates >= 1
    assert cu.replica.hash == ad.adapter_hash(states[-1])


@pytest.mark.parametrize(("rule", "holders", "ceiling"), [("fixed", 300, 2.0), ("scaled", 300, 2.0 * math.log2(300 / 128)),
                                                          ("scaled", 100, 0.0)])
def test_the_wait_for_a_holder_scales_with_the_previous_versions_holders(published, monkeypatch, rule, holders,
                                                                         ceiling):
    """wait_rule "scaled": the ceiling of the wait for a holder of v1 is peer_wait_s per doubling of
    v0's holders above 128 (none below); "fixed": peer_wait_s."""
    trainer, store, _ = published
    _many_holders(monkeypatch, trainer.peer_id, [(0, False)], n=holders)
    asked: list[float] = []
    monkeypatch.setattr(CatchUp, "_wait_for_holder",
                        lambda self, found, ceiling_s, whole: asked.append(ceiling_s) or {})
    cu = _catchup(_TimingOutGossip(), object(), TrainerFetch(store, 1), trainer, peer_wait_s=2.0,  # type: ignore[arg-type]
                  wait_rule=rule)
    cu.replica.apply(_received(store.snapshot(0)))
    cu.run(1)
    assert asked == [pytest.approx(ceiling)] and cu.replica.version == 1 and cu.stats.trainer_updates == 1
    with pytest.raises(ValueError, match="wait_rule"):
        _catchup(_TimingOutGossip(), object(), TrainerFetch(store, 1), trainer, wait_rule="longer")  # type: ignore[arg-type]


def _appearing_holders(monkeypatch, signer: str, prev: int) -> list[int]:
    """Holder records that appear while a worker waits: `prev` holders of v0; of v1 none at the
    first read, peer0 from then on, peer0..peer9 from 0.3 s after the first read. Returns the
    reads (a counter)."""
    from swarmrl.node.swarm import catchup
    from swarmrl.node.swarm.holders import Holder

    reads: list[float] = []

    def holders(n: int) -> list[Holder]:
        return [Holder(f"peer{i}", f"lp{i}".encode(), b"\0" * 32, 1, signer) for i in range(n)]

    def find(dht, job_id):
        now = time.monotonic()
        reads.append(now)
        n = 0 if len(reads) == 1 else 1 if now - reads[0] < 0.3 else 10
        return {(0, False): holders(prev), (1, False): holders(n)}
    monkeypatch.setattr(catchup, "find_holders", find)
    return reads


@pytest.mark.parametrize(("rule", "prev", "asked_peers", "reads"),
                         [("fixed", 0, 1, None), ("fixed-whole", 0, 10, 2), ("scaled-whole", 300, 10, 2),
                          ("scaled-whole", 100, 0, 1)])
def test_a_whole_wait_reads_the_records_once_at_its_end_and_asks_among_all_holders(
        published, monkeypatch, rule, prev, asked_peers, reads):
    """v1's holders appear, one at once and ten after 0.3 s, while the worker waits (peer_wait_s 1,
    a draw of 0.84 of the ceiling; every peer fetch times out). "fixed" polls and asks the first
    holder it sees, then the trainer; the "*-whole" rules sleep their draw, read the records once
    and ask all ten in random order; "scaled-whole" with 100 holders of v0 (under 128) waits
    nothing and asks the trainer at once."""
    trainer, store, states = published
    seen = _appearing_holders(monkeypatch, trainer.peer_id, prev)
    gossip = _TimingOutGossip()
    cu = _catchup(gossip, object(), TrainerFetch(store, 1), trainer, peer_wait_s=1.0, wait_rule=rule,  # type: ignore[arg-type]
                  rng=random.Random(0))
    cu.replica.apply(_received(store.snapshot(0)))
    cu.run(1)
    assert len(gossip.asked) == asked_peers and len(set(gossip.asked)) == asked_peers
    if asked_peers == 1:
        assert gossip.asked[0][0] == b"lp0"
    if reads is not None:
        assert len(seen) == reads
    assert cu.replica.version == 1 and cu.stats.trainer_updates == 1
    assert cu.replica.hash == ad.adapter_hash(states[1])
