"""The pure snapshot-source rule (protocol/snapshot_sources.py): nearest peer snapshot within
max_gap, then the trainer; which peers serve; the stream bound; and the peer-made snapshot's
verification (protocol/updates.open_snapshot) with each refusal reason."""

from __future__ import annotations

import pytest
import torch

from swarmrl.protocol import adapter as ad
from swarmrl.protocol import signing
from swarmrl.protocol import snapshot_sources as ss
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import (
    AdapterReplica,
    ReceivedUpdate,
    SnapshotRefused,
    chunks,
    open_snapshot,
    rebuilt_snapshot,
)

JOB = "ef" * 16


def test_the_nearest_peer_snapshot_within_the_gap_comes_first_then_the_trainer():
    plan = ss.snapshot_plan([3, 9, 12, 11, 20], have=-1, want=12, max_gap=4)
    assert [(s.source, s.version) for s in plan] == [("peer", 12), ("peer", 11), ("peer", 9), ("trainer", 12)]
    assert list(plan[2].chain(12)) == [10, 11, 12]


def test_no_peer_snapshot_leaves_the_trainer_and_no_snapshot_needed_leaves_nothing():
    assert [(s.source, s.version) for s in ss.snapshot_plan([1, 2], have=-1, want=12, max_gap=4)] == [("trainer", 12)]
    assert ss.snapshot_plan([12], have=10, want=12, max_gap=4) == []          # deltas reach it
    assert ss.peer_snapshot_versions([5, 6, 7], have=5, want=20, max_gap=14) == [7, 6]   # newer than held only


def test_which_peers_serve_under_each_rule():
    assert ss.serves_snapshot("rebuilt", version=7, newest_held=[5, 6, 7], received=False)
    assert ss.serves_snapshot("rebuilt", version=6, newest_held=[5, 6, 7], received=False)
    assert not ss.serves_snapshot("rebuilt", version=5, newest_held=[5, 6, 7], received=False)   # keep 2
    assert not ss.serves_snapshot("received", version=7, newest_held=[7], received=False)
    assert ss.serves_snapshot("received", version=7, newest_held=[7], received=True)
    with pytest.raises(ValueError, match="snapshot_rule"):
        ss.serves_snapshot("all", version=1, newest_held=[1], received=True)


def test_the_stream_bound_and_the_trainers_share():
    assert ss.admits_stream(1, 2) and not ss.admits_stream(2, 2) and not ss.admits_stream(0, 0)
    with pytest.raises(ValueError):
        ss.admits_stream(-1, 2)
    assert ss.trainer_share(80, 20) == pytest.approx(0.2) and ss.trainer_share(0, 0) == 0.0


def _delta_of_v1(trainer: Identity) -> tuple[ReceivedUpdate, ad.State]:
    gen = torch.Generator().manual_seed(1)
    old = {"a": torch.randn(4, 8, generator=gen), "b": torch.zeros(8, 4)}
    new = {k: v + 0.01 for k, v in old.items()}
    delta, exact = ad.make_delta(old, new)
    payload = ad.encode_state(delta)
    header = pb.AdapterUpdate(job_id=JOB, from_version=0, to_version=1, from_hash=ad.adapter_hash(old),
                              to_hash=ad.adapter_hash(exact), payload_sha256=ad.payload_sha256(payload),
                              payload_size=len(payload), codec=ad.CODEC)
    envelope = signing.sign(trainer, signing.ADAPTER_UPDATE, header)
    return ReceivedUpdate(header, envelope, payload), exact


def test_a_rebuilt_snapshot_verifies_as_the_trainers_and_each_tamper_is_refused_with_its_reason():
    trainer = Identity.from_seed(b"s" * 32)
    delta, state = _delta_of_v1(trainer)
    snap = rebuilt_snapshot(delta, state)
    assert snap.rebuilt and snap.header.snapshot and snap.envelope is delta.envelope
    sha = snap.header.payload_sha256
    got = open_snapshot(chunks(snap.envelope, snap.payload), {trainer.peer_id}, job_id=JOB, version=1,
                        payload_sha256=sha)
    replica = AdapterReplica(JOB, trainer.public_key)
    replica.apply(got)
    assert replica.version == 1 and replica.hash == ad.adapter_hash(state)

    def reason(envelope: pb.Signed, payload: bytes, *, signers=(trainer.peer_id,), version=1, want=None) -> str:
        with pytest.raises(SnapshotRefused) as err:
            open_snapshot(chunks(envelope, payload), set(signers), job_id=JOB, version=version,
                          payload_sha256=want if want is not None else ad.payload_sha256(payload))
        return err.value.reason

    other = {k: v + 1.0 for k, v in state.items()}   # a made-up state under the genuine header
    assert reason(snap.envelope, ad.encode_state(other)) == "adapter_hash"
    assert reason(snap.envelope, snap.payload, want=b"\0" * 32) == "payload_sha256"
    assert reason(snap.envelope, b"not zstd") == "undecodable"
    assert reason(snap.envelope, snap.payload, version=2) == "version"
    assert reason(snap.envelope, snap.payload, signers=("someone",)) == "untrusted"
    forged = pb.Signed()
    forged.CopyFrom(snap.envelope)
    forged.signature = bytes(64)
    assert reason(forged, snap.payload) == "signature"
    with pytest.raises(ad.AdapterError):
        rebuilt_snapshot(delta, other)
