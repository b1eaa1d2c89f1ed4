"""Quantised deltas through the real paths: the trainer's store, a worker's catch-up and a
validator's snapshots hold bit-identical adapters at every version; a malformed delta is
rejected, counted and replaced by a snapshot."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from swarmrl.node.swarm.catchup import CatchUp
from swarmrl.node.trainer.adapter_store import AdapterStore
from swarmrl.protocol import adapter as ad
from swarmrl.protocol import delta_codec as dc
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import AdapterReplica, chunks
from swarmrl.validator.adapters import SnapshotCache, TrainerAdapters

JOB = "ef" * 16
TRAINER = Identity.from_seed(b"q" * 32)


def _fetch(store: AdapterStore, head: int) -> SimpleNamespace:
    """The trainer's FetchAdapter over the store (an `AdapterFetcher`), without gRPC."""
    def fetch(req: pb.AdapterRequest) -> Iterator[pb.AdapterChunk]:
        for update in store.updates(req, head):
            yield from chunks(update.header, update.payload)
    return SimpleNamespace(fetch_adapter=fetch)


def _train(store: AdapterStore, versions: int) -> list[ad.State]:
    """A trainer's loop: step from the adopted state, publish, adopt what replicas rebuild."""
    gen = torch.Generator().manual_seed(0)
    states = [{"a.lora_A.weight": torch.randn(8, 40, generator=gen) * 0.1, "a.lora_B.weight": torch.zeros(40, 8)}]
    store.put_snapshot(0, states[0])
    for v in range(1, versions + 1):
        new = {k: t + 1e-3 * torch.randn(t.shape, generator=gen) ** 3 for k, t in states[-1].items()}
        exact, _ = store.publish(v, states[-1], new)
        states.append(exact)
    return states


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_trainer_worker_and_validator_hold_identical_adapters(codec, tmp_path: Path):
    versions = 7
    store = AdapterStore(tmp_path / "a", JOB, TRAINER, snapshot_every=3, codec=codec)
    states = _train(store, versions)
    worker = CatchUp(AdapterReplica(JOB, TRAINER.public_key), trainer=_fetch(store, versions),
                     signers=lambda: {TRAINER.peer_id}, max_gap=100)
    validator = TrainerAdapters(JOB, TRAINER.public_key, _fetch(store, versions), SnapshotCache(capacity=1))
    for v in range(versions + 1):
        worker.run(v)
        header = pb.AdapterUpdate.FromString(store.delta(v).header.body) if v else None
        want = ad.adapter_hash(states[v])
        assert worker.replica.hash == want and validator.state(v)[1] == want
        if header is not None:
            assert bytes(header.to_hash) == want and header.codec == dc.header_codec(codec)
    assert worker.stats.snapshots == 1 and worker.stats.trainer_updates == versions + 1
    assert ad.adapter_hash(states[-1]) != ad.adapter_hash(states[0])


def test_a_malformed_delta_is_rejected_counted_and_replaced_by_a_snapshot(tmp_path: Path):
    store = AdapterStore(tmp_path / "a", JOB, TRAINER)
    states = _train(store, 2)
    genuine = pb.AdapterUpdate.FromString(store.delta(2).header.body)
    tensors, meta = ad.load_tensors(store.delta(2).payload)
    tensors = {k: torch.full_like(t, float("nan")) if k.endswith(".scale") else t for k, t in tensors.items()}
    bad = ad.encode_tensors(tensors, meta)
    header = pb.AdapterUpdate()
    header.CopyFrom(genuine)
    header.payload_sha256, header.payload_size = ad.payload_sha256(bad), len(bad)
    signed = signing.sign(TRAINER, signing.ADAPTER_UPDATE, header)   # signed: only a trainer's bug or lie

    def fetch(req: pb.AdapterRequest) -> Iterator[pb.AdapterChunk]:
        if not req.snapshot and req.have_version == 1:
            return chunks(signed, bad)
        return _fetch(store, 2).fetch_adapter(req)

    worker = CatchUp(AdapterReplica(JOB, TRAINER.public_key), trainer=SimpleNamespace(fetch_adapter=fetch),
                     signers=lambda: {TRAINER.peer_id}, max_gap=100)
    worker.run(1)
    worker.run(2)
    assert worker.stats.rejected == 1 and worker.stats.report()["rejected"] == 1
    assert worker.replica.version == 2 and worker.replica.hash == ad.adapter_hash(states[2])
    assert worker.stats.snapshots == 2   # v0 to start, then v2 instead of the malformed delta


def test_a_restarted_trainer_rolls_its_checkpoint_forward_through_int4_deltas(tmp_path: Path, model_cache):
    """Versions published after the last checkpoint (a crash before it) are replayed from the
    stored int4 deltas to the same head hash."""
    from swarmrl.node.models.base_model import prepare_base_model
    from swarmrl.node.tasks.builtin_jobs import builtin_job
    from swarmrl.node.trainer.job import JobRuntime
    from swarmrl.node.trainer.ledger import Ledger

    spec = builtin_job("tiny", model_cache, steps=8)
    assert spec.delta_codec == "int4"
    ledger = Ledger(tmp_path / "ledger.sqlite")
    kw = {"identity": TRAINER, "model_path": prepare_base_model("tiny", model_cache), "state_dir": tmp_path,
          "ledger": ledger}
    job = JobRuntime("job-int4", spec, **kw)
    gen = torch.Generator().manual_seed(1)
    for v in range(1, 4):
        job.publish({k: t + 1e-3 * torch.randn(t.shape, generator=gen) for k, t in job.head_state.items()})
        if v == 1:
            job.checkpoint()
    again = JobRuntime("job-int4", spec, **kw)
    assert (again.version, again.head_hash) == (3, job.head_hash) == (3, ad.adapter_hash(job.head_state))
    assert ad.adapter_hash(again.learner.state()) == job.head_hash
    ledger.close()
