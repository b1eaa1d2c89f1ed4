"""Verdict signing round trip, and adapter snapshots fetched from a trainer's real adapter store
(versions, version 0 after the head moved on, unknown versions, forged updates, the LRU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarmrl.node.trainer.adapter_store import AdapterStore
from swarmrl.protocol import adapter as ad
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import chunks
from swarmrl.validator.adapters import SnapshotCache, TrainerAdapters, VersionUnavailable
from swarmrl.validator.service import sign_report

JOB = "job-1"
Published = tuple[Identity, AdapterStore, list[ad.State]]


def test_verdict_report_round_trip() -> None:
    validator = Identity.from_seed(b"v" * 32)
    verdicts = [pb.Verdict(job_id=JOB, peer_id="w" * 40, batch_id="b" * 64, prompt_index=3, passed=False,
                           check="logprob", detail="completion 0 token 2")]
    envelope = sign_report(validator, JOB, verdicts, 123)
    report, signer = signing.open_signed(envelope, signing.VERDICTS, pb.VerdictReport)
    assert signer == validator.peer_id and report.job_id == JOB and list(report.verdicts) == verdicts
    with pytest.raises(signing.SignatureError):
        signing.open_signed(envelope, signing.ROLLOUT_BATCH, pb.VerdictReport)  # another domain
    tampered = pb.Signed(body=envelope.body.replace(b"logprob", b"all\x00\x00\x00\x00"), public_key=envelope.public_key,
                         signature=envelope.signature)
    with pytest.raises(signing.SignatureError):
        signing.open_signed(tampered, signing.VERDICTS, pb.VerdictReport)


def _states(n: int) -> list[ad.State]:
    gen = torch.Generator().manual_seed(0)
    v0 = {"a.lora_A.weight": 0.1 * torch.randn(4, 16, generator=gen), "a.lora_B.weight": torch.zeros(16, 4)}
    out = [v0]
    for _ in range(n):
        out.append({k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in out[-1].items()})
    return out


class FakeTrainerFetch:
    """The trainer's FetchAdapter (AdapterStore.updates, as JobRuntime serves it) without gRPC."""

    def __init__(self, store: AdapterStore, head: int) -> None:
        self.store, self.head, self.calls = store, head, 0

    def fetch_adapter(self, req: pb.AdapterRequest) -> Iterator[pb.AdapterChunk]:
        self.calls += 1
        for update in self.store.updates(req, self.head):
            yield from chunks(update.header, update.payload)


@pytest.fixture()
def published(tmp_path: Path) -> Published:
    trainer = Identity.from_seed(b"t" * 32)
    store = AdapterStore(tmp_path / "adapters", JOB, trainer)
    states = _states(5)
    store.put_snapshot(0, states[0])
    exact = [ad.clone_state(states[0])]
    for v in range(1, 6):
        new, _ = store.publish(v, exact[-1], states[v])
        exact.append(new)
    return trainer, store, exact


def test_snapshots_by_version_and_unknown_versions(published: Published) -> None:
    trainer, store, exact = published
    src = TrainerAdapters(JOB, trainer.public_key, FakeTrainerFetch(store, head=5), SnapshotCache(4))
    for v in (0, 3, 5):
        state, digest = src.state(v)
        assert digest == ad.adapter_hash(exact[v]) and all(torch.equal(state[k], exact[v][k]) for k in state)
    with pytest.raises(VersionUnavailable):
        src.state(6)


def test_version_0_is_served_after_the_head_moved_on(published: Published) -> None:
    trainer, store, exact = published
    src = TrainerAdapters(JOB, trainer.public_key, FakeTrainerFetch(store, head=2), SnapshotCache(4))
    state, digest = src.state(0)
    assert digest == ad.adapter_hash(exact[0])
    assert all(torch.equal(state[k], exact[0][k]) for k in state)


def test_forged_updates_are_refused(published: Published) -> None:
    _, store, _ = published
    impostor = Identity.from_seed(b"i" * 32)
    src = TrainerAdapters(JOB, impostor.public_key, FakeTrainerFetch(store, head=5), SnapshotCache(4))
    with pytest.raises(ad.AdapterError):
        src.state(2)


def test_snapshot_cache_is_an_lru(published: Published) -> None:
    trainer, store, _ = published
    fetch = FakeTrainerFetch(store, head=5)
    src = TrainerAdapters(JOB, trainer.public_key, fetch, SnapshotCache(2))
    src.state(1), src.state(2), src.state(1)
    assert fetch.calls == 2
    src.state(3)                      # evicts 2, the least recently used
    job_at_trainer = f"{JOB}@{src.trainer_id}"   # keyed by trainer too (a DiLoCo job's inner versions)
    assert (job_at_trainer, 1) in src.cache and (job_at_trainer, 2) not in src.cache
    src.state(2)
    assert fetch.calls == 4
