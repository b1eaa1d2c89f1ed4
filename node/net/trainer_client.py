"""What a worker and a validator ask of a trainer: one small interface per role, and the client
that implements both over any carrier of the calls.

- `WorkerTrainer`: lease, submit a signed batch and read its receipt, fetch adapter updates or
  snapshots, fetch a data set.
- `ValidatorTrainer`: sample admitted batches, read the job's status (its head version), report
  signed verdicts, fetch adapter snapshots, fetch a data set.

Both take and return the wire's messages (`swarmrl.v1`), signed envelopes as they travel, and
fail as a call on the wire fails: `grpc.RpcError` (a `grpc_retry.GaveUp` once the retries are
spent), so a caller handles one kind of failure whatever carries its calls.

`TrainerClient` implements both over a `TrainerWire`, one call per rpc with no retries: the gRPC
wire (`grpc_wire.GrpcWire`: TLS pinning, the peer-id header, message limits, deadlines) or the
in-process one (`node.local.inprocess`: a `Trainer` in this process, no socket). What both need
is here, once: each call's deadline, and retries with backoff of refused or unreachable calls
(`grpc_retry`: unary calls, and the opening of streams, which are cancelled when left unfinished).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

from swarmrl.node.net.grpc_retry import call_with_backoff, stream_with_backoff
from swarmrl.protocol.pb import swarm_pb2 as pb

LEASE_TIMEOUT_S = 30.0    # a lease request's deadline
SUBMIT_TIMEOUT_S = 60.0   # a rollout submission's (admission syncs the ledger before the receipt)
CALL_TIMEOUT_S = 30.0     # a validator's calls: sampling admitted batches, the status, verdict reports
FETCH_TIMEOUT_S = 120.0   # an adapter or data-set download


class AdapterFetcher(Protocol):
    """The trainer as a source of adapter updates (the catch-up's and the validator's last resort)."""

    def fetch_adapter(self, request: pb.AdapterRequest) -> Iterable[pb.AdapterChunk]:
        """The chunks of the signed updates (deltas, or a snapshot) that answer `request`; empty
        for a version never published. Lazy: the call starts when the first chunk is asked for.

        Raises:
            grpc.RpcError: NOT_FOUND (unknown job), OUT_OF_RANGE (a version no longer kept), or
                the trainer could not be reached.
        """
        ...


class DatasetFetcher(Protocol):
    """The trainer as a source of data-set files (the data-set fetch's last resort)."""

    def fetch_dataset(self, request: pb.UpdateRequest) -> Iterable[pb.AdapterChunk]:
        """The chunks of a hosted job's data-set file, by sha256 (`payload_sha256`). Lazy.

        Raises:
            grpc.RpcError: NOT_FOUND (no hosted job has it), or the trainer could not be reached.
        """
        ...


class WorkerTrainer(AdapterFetcher, DatasetFetcher, Protocol):
    """What a worker's job session asks of the trainer it follows."""

    def request_lease(self, signed: pb.Signed) -> pb.LeaseReply:
        """Answer a signed `LeaseRequest`: a lease, or a reason (and a retry hint) for none.

        Raises:
            grpc.RpcError: the trainer could not be reached (after retries: `GaveUp`).
        """
        ...

    def submit_rollouts(self, envelope: pb.Signed) -> pb.BatchReceipt:
        """Admit a signed `RolloutBatch`; its receipt (accepted, per-group reasons).

        Raises:
            grpc.RpcError: refused over a rate limit or unreachable after retries (`GaveUp`);
                nothing was admitted then (a resend of an admitted batch is a `replay`).
        """
        ...

    def close(self) -> None:
        """Release the connection (a no-op where there is none)."""
        ...


@runtime_checkable
class ValidatorTrainer(AdapterFetcher, DatasetFetcher, Protocol):
    """What a validator asks of a job's trainer."""

    def sample_admitted(self, request: pb.SampleRequest) -> list[pb.AdmittedBatch]:
        """Admitted batches after `request.after_seq`, oldest first, each with its lease.

        Raises:
            grpc.RpcError: the trainer could not be reached (after retries: `GaveUp`).
        """
        ...

    def job_status(self, request: pb.JobStatusRequest) -> pb.JobStatus:
        """The job's status (state "unknown" for a job the trainer does not host).

        Raises:
            grpc.RpcError: the trainer could not be reached (after retries: `GaveUp`).
        """
        ...

    def report_verdicts(self, envelope: pb.Signed) -> pb.VerdictAck:
        """Hand the trainer a signed `VerdictReport`; its acknowledgement (bans it caused).

        Raises:
            grpc.RpcError: the trainer could not be reached (after retries: `GaveUp`).
        """
        ...

    def close(self) -> None:
        """Release the connection (a no-op where there is none)."""
        ...


class TrainerWire(Protocol):
    """One attempt at each rpc a worker or validator makes, within `timeout_s` where the carrier
    has deadlines. Raises grpc.RpcError as the call failed; retries are the caller's."""

    def request_lease(self, signed: pb.Signed, timeout_s: float) -> pb.LeaseReply:
        """RequestLease."""
        ...

    def submit_rollouts(self, envelopes: Iterator[pb.Signed], timeout_s: float) -> pb.Receipt:
        """SubmitRollouts: the batches of one stream."""
        ...

    def fetch_adapter(self, request: pb.AdapterRequest, timeout_s: float) -> Iterable[pb.AdapterChunk]:
        """FetchAdapter (a stream)."""
        ...

    def fetch_dataset(self, request: pb.UpdateRequest, timeout_s: float) -> Iterable[pb.AdapterChunk]:
        """FetchDataset (a stream)."""
        ...

    def sample_admitted(self, request: pb.SampleRequest, timeout_s: float) -> Iterable[pb.AdmittedBatch]:
        """SampleAdmitted (a stream)."""
        ...

    def job_status(self, request: pb.JobStatusRequest, timeout_s: float) -> pb.JobStatus:
        """GetJobStatus."""
        ...

    def report_verdicts(self, envelope: pb.Signed, timeout_s: float) -> pb.VerdictAck:
        """ReportVerdicts."""
        ...

    def close(self) -> None:
        """Release what the wire holds."""
        ...


class TrainerClient:
    """`WorkerTrainer` and `ValidatorTrainer` over a `TrainerWire`: each call with its deadline,
    refused (RESOURCE_EXHAUSTED) or unreachable (UNAVAILABLE) calls retried with backoff, the
    opening of streams likewise, and a stream left unfinished cancelled (`grpc_retry`)."""

    def __init__(self, wire: TrainerWire) -> None:
        self.wire = wire

    def request_lease(self, signed: pb.Signed) -> pb.LeaseReply:
        """See `WorkerTrainer.request_lease` (deadline LEASE_TIMEOUT_S)."""
        return call_with_backoff(lambda: self.wire.request_lease(signed, LEASE_TIMEOUT_S))

    def submit_rollouts(self, envelope: pb.Signed) -> pb.BatchReceipt:
        """See `WorkerTrainer.submit_rollouts` (deadline SUBMIT_TIMEOUT_S); the same signed
        batch is resent on a retry."""
        receipt = call_with_backoff(lambda: self.wire.submit_rollouts(iter([envelope]), SUBMIT_TIMEOUT_S))
        return receipt.batches[0]

    def fetch_adapter(self, request: pb.AdapterRequest) -> Iterator[pb.AdapterChunk]:
        """See `AdapterFetcher.fetch_adapter` (deadline FETCH_TIMEOUT_S)."""
        return stream_with_backoff(lambda: self.wire.fetch_adapter(request, FETCH_TIMEOUT_S))

    def fetch_dataset(self, request: pb.UpdateRequest) -> Iterator[pb.AdapterChunk]:
        """See `DatasetFetcher.fetch_dataset` (deadline FETCH_TIMEOUT_S)."""
        return stream_with_backoff(lambda: self.wire.fetch_dataset(request, FETCH_TIMEOUT_S))

    def sample_admitted(self, request: pb.SampleRequest) -> list[pb.AdmittedBatch]:
        """See `ValidatorTrainer.sample_admitted` (deadline CALL_TIMEOUT_S)."""
        return list(stream_with_backoff(lambda: self.wire.sample_admitted(request, CALL_TIMEOUT_S)))

    def job_status(self, request: pb.JobStatusRequest) -> pb.JobStatus:
        """See `ValidatorTrainer.job_status` (deadline CALL_TIMEOUT_S)."""
        return call_with_backoff(lambda: self.wire.job_status(request, CALL_TIMEOUT_S))

    def report_verdicts(self, envelope: pb.Signed) -> pb.VerdictAck:
        """See `ValidatorTrainer.report_verdicts` (deadline CALL_TIMEOUT_S)."""
        return call_with_backoff(lambda: self.wire.report_verdicts(envelope, CALL_TIMEOUT_S))

    def close(self) -> None:
        """Close the wire."""
        self.wire.close()
