"""No snapshot herd (issue 24 item 5), on real hivemind DHT nodes and libp2p streams on loopback:
a peer that rebuilt the head from deltas serves it as a snapshot; a late joiner whose trainer
refuses snapshots catches up from it; a tampered peer snapshot is refused (counted by reason)
and the joiner falls back to the trainer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmrl.node.net.call_status import CallRefused
from swarmrl.node.swarm.catchup import CatchUp
from swarmrl.node.swarm.dht import start_dht, visible_maddrs
from swarmrl.node.swarm.gossip import GossipNode
from swarmrl.node.swarm.holders import find_holders
from swarmrl.node.trainer.adapter_store import AdapterStore
from swarmrl.node.trainer.retention import Retention
from swarmrl.protocol import adapter as ad
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import AdapterReplica, ReceivedUpdate, chunks

JOB = "5a" * 16
HEAD = 12   # > max_gap 8: a joiner needs a snapshot


class Trainer:
    """FetchAdapter over a real AdapterStore; `refuse_snapshots` answers a snapshot request as a
    trainer at its stream bound does (RESOURCE_EXHAUSTED). Counts the payload bytes it served."""

    def __init__(self, store: AdapterStore, refuse_snapshots: bool) -> None:
        self.store, self.refuse, self.bytes, self.snapshot_asks = store, refuse_snapshots, 0, 0

    def fetch_adapter(self, req: pb.AdapterRequest) -> Iterator[pb.AdapterChunk]:
        if req.snapshot:
            self.snapshot_asks += 1
            if self.refuse:
                raise CallRefused(__import__("grpc").StatusCode.RESOURCE_EXHAUSTED, "snapshot_busy", 500)
        for update in self.store.updates(req, HEAD):
            self.bytes += len(update.payload)
            yield from chunks(update.header, update.payload)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    trainer = Identity.from_seed(b"p" * 32)
    store = AdapterStore(Path(tmp_path_factory.mktemp("snap")) / "adapters", JOB, trainer, snapshot_every=100,
                         retention=Retention(keep_versions=HEAD + 2))
    gen = torch.Generator().manual_seed(0)
    state = {"l.lora_A.weight": torch.randn(8, 64, generator=gen), "l.lora_B.weight": torch.zeros(64, 8)}
    store.put_snapshot(0, state)
    for v in range(1, HEAD + 1):
        state, _ = store.publish(v, state, {k: t + 1e-3 * torch.randn(t.shape, generator=gen) for k, t in state.items()})
    first = start_dht()
    dhts = [first, *(start_dht(visible_maddrs(first)) for _ in range(2))]
    nodes = [GossipNode(d, Identity.generate()) for d in dhts]
    yield trainer, store, ad.adapter_hash(state), dhts, nodes
    for n in nodes:
        n.shutdown()
    for d in dhts:
        d.shutdown()


def _catchup(node: GossipNode, dht, fetch: Trainer, trainer: Identity) -> CatchUp:
    return CatchUp(AdapterReplica(JOB, trainer.public_key), trainer=fetch, signers=lambda: {trainer.peer_id},
                   gossip=node, dht=dht, peer_wait_s=0.0)


def test_a_joiner_catches_up_from_a_peers_rebuilt_snapshot_when_the_trainer_refuses(swarm):
    trainer, store, head_hash, dhts, (seed, joiner, _) = swarm
    # the seed peer holds v0 and rebuilds the head from the 12 deltas (no trainer snapshot of v12 exists)
    first = _catchup(seed, dhts[0], Trainer(store, refuse_snapshots=False), trainer)
    first.run(0)
    first.max_gap = HEAD   # take the deltas, not a snapshot
    first.run(HEAD)
    assert first.replica.hash == head_hash and first.stats.snapshot_bytes["trainer"] > 0   # v0 only
    held = find_holders(dhts[1], JOB)
    assert (HEAD, True) in held   # its rebuilt head, announced as a snapshot

    fetch = Trainer(store, refuse_snapshots=True)
    late = _catchup(joiner, dhts[1], fetch, trainer)
    late.run(HEAD)
    assert late.replica.version == HEAD and late.replica.hash == head_hash
    assert late.stats.snapshot_bytes == {"peer": seed.snapshot_served_bytes(JOB), "trainer": 0}
    assert late.stats.snapshot_bytes["peer"] > 0 and fetch.bytes == 0 and fetch.snapshot_asks == 0
    print(f"\nsnapshot bytes: peer {late.stats.snapshot_bytes['peer']}, trainer 0 "
          f"(trainers' share {late.stats.snapshot_bytes['trainer'] / late.stats.snapshot_bytes['peer']:.2f})")


def test_a_tampered_peer_snapshot_is_refused_and_the_joiner_falls_back(swarm):
    trainer, store, head_hash, dhts, (seed, joiner, liar) = swarm
    genuine = seed.cache.get(JOB, HEAD, True)
    assert genuine is not None and genuine.rebuilt
    # the liar serves a made-up state under the genuine trainer-signed header (content address of its bytes)
    made_up = ad.encode_state({k: t + 1.0 for k, t in ad.decode_state(genuine.payload).items()})
    header = pb.AdapterUpdate()
    header.CopyFrom(genuine.header)
    header.payload_sha256, header.payload_size = ad.payload_sha256(made_up), len(made_up)
    liar.hold(ReceivedUpdate(header, genuine.envelope, made_up, rebuilt=True))
    liar.announce(JOB)
    victim_dht = start_dht(visible_maddrs(dhts[2]))
    victim = GossipNode(victim_dht, Identity.generate())
    try:
        for honest in (seed, joiner):   # the honest peers hold nothing now (their records say they do: an empty answer)
            honest.cache._items.pop(JOB)
        fetch = Trainer(store, refuse_snapshots=False)
        cu = _catchup(victim, victim_dht, fetch, trainer)
        cu.run(HEAD)
        assert cu.stats.snapshot_refused == {"adapter_hash": 1} and liar.identity.peer_id in cu.stats.dropped_peers
        assert cu.replica.version == HEAD and cu.replica.hash == head_hash
        assert cu.stats.snapshot_bytes["trainer"] > 0 and fetch.snapshot_asks == 1
    finally:
        victim.shutdown()
        victim_dht.shutdown()
