"""The submitter's client: sign and submit a job, follow it, download its adapter.

torch, transformers and peft are imported only by the calls that need them (fetching and
exporting an adapter), so `swarmrl status` and a failed `submit` answer quickly.

Every call is retried with backoff when the trainer refuses it as overloaded or can't be reached
(`node.net.grpc_retry`; after the last attempt it fails with `grpc_retry.GaveUp`); a submission names
the job's signer as its peer (`swarmrl-peer` metadata). Status and downloads carry no identity
(`swarmrl status` and `fetch` take no key), so they are anonymous.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from swarmrl.node.models.card import write_model_card
from swarmrl.node.net import tls
from swarmrl.node.net.grpc_guard import peer_metadata
from swarmrl.node.net.grpc_options import channel_options
from swarmrl.node.net.grpc_retry import call_with_backoff, stream_with_backoff
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from swarmrl.protocol import adapter as ad
    from swarmrl.protocol.jobspec import JobSpec
    from swarmrl.protocol.updates import AdapterReplica


class SubmitterError(RuntimeError):
    """A trainer answered, but not with what the submitter asked for; the message says why."""


class JobRefused(SubmitterError):
    """The trainer refused the job; the message says why."""


class UnknownJob(SubmitterError):
    """The trainer does not host the job."""


def stub(endpoint: str, max_message_mb: int = 64, tls_sha256: bytes = b"") -> pb_grpc.TrainerStub:
    """A client of the trainer at `endpoint` (HOST:PORT) whose messages may be up to
    `max_message_mb` MiB: plaintext, or TLS pinned to the certificate sha256 `tls_sha256`
    (the trainer's job record or ready file gives it; node/net/tls.py).

    Raises:
        tls.PinError: TLS was asked for and the pinned certificate could not be confirmed.
    """
    return pb_grpc.TrainerStub(tls.channel(endpoint, tls_sha256, channel_options(max_message_mb)))


def sign_job(identity: Identity, spec: JobSpec, dataset: bytes | None = None) -> pb.Signed:
    """The signed `Job` envelope of `spec` (its body fixes the job id); a data-set job carries
    its file's bytes (checked against the spec's sha256 here and by the trainer)."""
    task = spec.dataset
    if task is not None and (dataset is None or hashlib.sha256(dataset).hexdigest() != task.dataset_sha256):
        raise ValueError(f"data-set job {spec.name}: the bytes given are not {task.dataset} ({task.dataset_sha256[:12]})")
    payload = dataset if task is not None and dataset is not None else b""   # checked above: a data-set job has it
    return signing.sign(identity, signing.JOB, pb.Job(spec_json=spec.canonical_json(),
                                                      created_ms=int(time.time() * 1000), dataset=payload))


def submit_job(endpoint: str, identity: Identity, spec: JobSpec, timeout_s: float = 600,
               dataset: bytes | None = None, tls_sha256: bytes = b"") -> str:
    """Sign `spec` (with its data-set bytes, if any) and submit it; returns the job id.

    Raises:
        JobRefused: the trainer answered with a refusal.
    """
    return submit_signed(endpoint, sign_job(identity, spec, dataset), timeout_s, tls_sha256)


def submit_signed(endpoint: str, envelope: pb.Signed, timeout_s: float = 600, tls_sha256: bytes = b"") -> str:
    """Submit an already signed job (the same envelope to every trainer of a job gives them the
    same job id); returns the job id.

    Raises:
        JobRefused: the trainer answered with a refusal.
    """
    from swarmrl.protocol.jobspec import job_id_from_body

    trainer = stub(endpoint, tls_sha256=tls_sha256)
    meta = peer_metadata(signing.signer_id(envelope))
    ack: pb.JobAck = call_with_backoff(lambda: trainer.SubmitJob(envelope, timeout=timeout_s, metadata=meta))
    if not ack.accepted:
        raise JobRefused(ack.reason)
    assert ack.job_id == job_id_from_body(envelope.body)
    return ack.job_id


def job_status(endpoint: str, job_id: str, history: int = 0, timeout_s: float = 10,
               tls_sha256: bytes = b"") -> pb.JobStatus:
    """The trainer's view of a job (state, version, counters, recent steps)."""
    trainer = stub(endpoint, tls_sha256=tls_sha256)
    status: pb.JobStatus = call_with_backoff(lambda: trainer.GetJobStatus(
        pb.JobStatusRequest(job_id=job_id, history=history), timeout=timeout_s))
    return status


def fetch_snapshot(endpoint: str, job_id: str, trainer_public_key: bytes, version: int | None = None,
                   tls_sha256: bytes = b"") -> AdapterReplica:
    """Download and verify the adapter at `version` (None = the head) as a signed snapshot."""
    from swarmrl.protocol.updates import AdapterReplica, assemble

    replica = AdapterReplica(job_id, trainer_public_key)
    req = pb.AdapterRequest(job_id=job_id, want_version=version, snapshot=True)
    trainer = stub(endpoint, tls_sha256=tls_sha256)
    for update in assemble(stream_with_backoff(lambda: trainer.FetchAdapter(req, timeout=300)), replica.trainer_id):
        replica.apply(update)
    if replica.state is None:
        raise RuntimeError(f"trainer at {endpoint} served no adapter for job {job_id}")
    return replica


def export_peft(state: ad.State, spec: JobSpec, out: Path) -> Path:
    """Write `state` in PEFT format (adapter_config.json + adapter_model.safetensors) to `out`,
    as `PeftModel.save_pretrained` would, without loading the base model: `state` already has
    PEFT's saved key names (`get_peft_model_state_dict`), and `target_modules` lists the modules
    its keys name ("all-linear" resolved). The model card is `model_card.write_model_card`'s job."""
    from safetensors.torch import save_file

    from swarmrl.node.models.causal_lm import lora_config

    config = lora_config(spec.lora.rank, spec.lora.alpha, spec.lora.dropout,
                         sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state}))
    config.base_model_name_or_path = spec.base_model
    config.inference_mode = True
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return out


def fetch_job_adapter(endpoint: str, job_id: str, out: Path, cache_dir: Path | None = None,
                      trainer_public_key: bytes | None = None, tls_sha256: bytes = b"") -> tuple[int, bytes]:
    """Fetch the head adapter of `job_id` into `out` (PEFT format); returns (version, hash).

    The snapshot's signature is checked against `trainer_public_key` (from the job's signed DHT
    record) when given, else against the key of the trainer the status names.

    Raises:
        UnknownJob: the trainer does not host `job_id`.
    """
    status = job_status(endpoint, job_id, history=1, tls_sha256=tls_sha256)
    if status.state == "unknown":
        raise UnknownJob(f"the trainer at {endpoint} does not host job {job_id!r} "
                         "(use the id `swarmrl submit` printed)")
    key = trainer_public_key or _trainer_key(endpoint, job_id, status, tls_sha256)
    replica = fetch_snapshot(endpoint, job_id, key, tls_sha256=tls_sha256)
    from swarmrl.protocol.jobspec import JobSpec

    spec = JobSpec.from_json(_spec_json(endpoint, job_id, tls_sha256))
    assert replica.state is not None
    export_peft(replica.state, spec, out)
    history = [{"policy_version": h.policy_version, "reward_mean": h.reward_mean} for h in status.history]
    write_model_card(out, spec, job_id, replica.version, history, adapter_hash=replica.hash)
    return replica.version, replica.hash


def _trainer_key(endpoint: str, job_id: str, status: pb.JobStatus, tls_sha256: bytes = b"") -> bytes:
    header = _first_header(endpoint, job_id, tls_sha256)
    if signing.signer_id(header) != status.trainer_id:
        raise RuntimeError("adapter header is not signed by the trainer that serves the job")
    return bytes(header.public_key)


def _first_header(endpoint: str, job_id: str, tls_sha256: bytes = b"") -> pb.Signed:
    req = pb.AdapterRequest(job_id=job_id, snapshot=True)  # the head: always kept (retention.py)
    trainer = stub(endpoint, tls_sha256=tls_sha256)
    chunks: Iterator[pb.AdapterChunk] = stream_with_backoff(lambda: trainer.FetchAdapter(req, timeout=300))
    for chunk in chunks:
        if chunk.HasField("header"):
            return chunk.header
    raise RuntimeError("no adapter header served")


def _spec_json(endpoint: str, job_id: str, tls_sha256: bytes = b"") -> str:
    trainer = stub(endpoint, tls_sha256=tls_sha256)
    status: pb.JobStatus = call_with_backoff(lambda: trainer.GetJobStatus(pb.JobStatusRequest(job_id=job_id), timeout=10))
    if not status.spec_json:
        raise RuntimeError("trainer did not return the job spec")
    return status.spec_json
