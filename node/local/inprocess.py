"""A trainer in this process, and clients of it that open no socket.

`InProcessTrainer` hosts jobs on a real `Trainer` (`node.trainer.hosting`: its ledger, leases,
admission, replay protection, bans, adapter store and steps) with no gRPC server and no DHT. Its
`client()` is the `TrainerClient` a worker's `JobSession` and a validator's `ValidatorService`
take as their trainer (`node.net.trainer_client`), over an `InProcessWire`: every call goes to the
same `TrainerCalls` the gRPC service uses (`node.trainer.calls`), and every message crosses as
bytes, serialized, checked against the message limit (`grpc_options.check_message_size`, the
limit the gRPC channels are given) and parsed again on the other side, as gRPC does. So the
worker and validator run unchanged, several jobs' sessions can share one trainer, and a test
needs no port. Calls run in the caller's thread: there are no deadlines; the trainer's steps run
when `step()` is called (the trainer process's main loop does this in `node.trainer.main`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from google.protobuf.message import Message

from swarmrl.node.net.grpc_options import check_message_size, message_limit_bytes
from swarmrl.node.net.trainer_client import TrainerClient
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.node.trainer.calls import TrainerCalls
from swarmrl.node.trainer.hosting import Trainer
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

M = TypeVar("M", bound=Message)
ADDRESS = "in-process"   # the source address every in-process call is rate limited under (one host)


class InProcessWire:
    """A `TrainerWire` that calls `TrainerCalls` directly (see the module docstring).
    `limit_bytes`: the largest message either side sends."""

    def __init__(self, calls: TrainerCalls, limit_bytes: int) -> None:
        self.calls, self.limit_bytes = calls, limit_bytes

    def _across(self, message: M) -> M:
        """`message` as the other side receives it: its bytes, size-checked, parsed anew.

        Raises:
            CallRefused: RESOURCE_EXHAUSTED, a message over the limit.
        """
        data = message.SerializeToString()
        check_message_size(len(data), self.limit_bytes)
        return type(message).FromString(data)

    def _stream(self, messages: Iterator[M]) -> Iterator[M]:
        try:
            for m in messages:
                yield self._across(m)
        finally:
            if hasattr(messages, "close"):
                messages.close()   # a reader that stopped ends the trainer's generator

    def request_lease(self, signed: pb.Signed, timeout_s: float) -> pb.LeaseReply:
        """RequestLease."""
        return self._across(self.calls.request_lease(self._across(signed), ADDRESS))

    def submit_rollouts(self, envelopes: Iterator[pb.Signed], timeout_s: float) -> pb.Receipt:
        """SubmitRollouts: each batch admitted in turn; a refusal ends the call (as the stream ends)."""
        receipt = pb.Receipt()
        for envelope in envelopes:
            receipt.batches.append(self.calls.submit_rollouts(self._across(envelope), ADDRESS))
        return self._across(receipt)

    def fetch_adapter(self, request: pb.AdapterRequest, timeout_s: float) -> Iterable[pb.AdapterChunk]:
        """FetchAdapter (a generator: the trainer's work starts at the first chunk asked for)."""
        return self._stream(self.calls.fetch_adapter(self._across(request)))

    def fetch_dataset(self, request: pb.UpdateRequest, timeout_s: float) -> Iterable[pb.AdapterChunk]:
        """FetchDataset."""
        return self._stream(self.calls.fetch_dataset(self._across(request)))

    def sample_admitted(self, request: pb.SampleRequest, timeout_s: float) -> Iterable[pb.AdmittedBatch]:
        """SampleAdmitted."""
        return self._stream(self.calls.sample_admitted(self._across(request)))

    def job_status(self, request: pb.JobStatusRequest, timeout_s: float) -> pb.JobStatus:
        """GetJobStatus."""
        return self._across(self.calls.job_status(self._across(request)))

    def report_verdicts(self, envelope: pb.Signed, timeout_s: float) -> pb.VerdictAck:
        """ReportVerdicts."""
        return self._across(self.calls.report_verdicts(self._across(envelope)))

    def close(self) -> None:
        """Nothing to release."""


class InProcessTrainer:
    """A real `Trainer` (no gRPC server, no DHT) with its clients; it can host several jobs.

    cfg: the trainer's config (state_dir, base models, trusted validators, rate limits, message
    limit). `endpoint` ("in-process:" + the trainer's peer id) names it in its job records.
    """

    def __init__(self, cfg: TrainerConfig, identity: Identity) -> None:
        self.cfg, self.identity = cfg, identity
        self.trainer = Trainer(cfg, identity)
        self.calls = TrainerCalls(self.trainer, cfg.rate_limits)
        self.endpoint = f"in-process:{identity.peer_id}"

    def client(self, max_message_mb: int | None = None) -> TrainerClient:
        """A client with the limit of the smaller of `max_message_mb` (the caller's; default the
        trainer's) and the trainer's, as a gRPC call is bounded by both ends."""
        mb = min(max_message_mb or self.cfg.max_message_mb, self.cfg.max_message_mb)
        return TrainerClient(InProcessWire(self.calls, message_limit_bytes(mb)))

    def connect(self, record: pb.JobRecord) -> TrainerClient:
        """A client for a record of one of this trainer's jobs (what a worker or validator is
        handed to connect with).

        Raises:
            ValueError: the record names another endpoint.
        """
        if record.endpoint != self.endpoint:
            raise ValueError(f"record of job {record.job_id[:12]} names {record.endpoint}, not {self.endpoint}")
        return self.client()

    def submit_job(self, envelope: pb.Signed) -> pb.JobAck:
        """Host a signed job, as `swarmrl submit` asks a trainer to (the envelope crosses as bytes)."""
        return self.calls.submit_job(pb.Signed.FromString(envelope.SerializeToString()))

    def record(self, job_id: str) -> pb.JobRecord:
        """The job's record as the trainer announces it (its head version now), naming `endpoint`.

        Raises:
            KeyError: the trainer does not host `job_id`.
        """
        return self.trainer.jobs[job_id].record(self.endpoint)

    def verified_record(self, job_id: str) -> VerifiedRecord:
        """`record(job_id)` as a validator reads it from the DHT (checked against the trainer's key)."""
        return VerifiedRecord(self.record(job_id), self.identity.peer_id, self.identity.public_key)

    def step(self) -> int:
        """One pass of the trainer's main loop over its jobs without a swarm: expire leases, and
        take a step for each job with a full batch. Returns the steps taken."""
        steps = 0
        for job in list(self.trainer.jobs.values()):
            job.admission.expire_leases()
            if job.ready() and job.train_step() is not None:
                steps += 1
        return steps

    def close(self) -> None:
        """Close the trainer's ledger."""
        self.trainer.ledger.close()
