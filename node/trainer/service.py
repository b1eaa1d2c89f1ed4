"""The trainer's gRPC service: thin glue from the wire to `TrainerCalls` (`calls.py`).

Each handler reads the caller's source address from the call (`grpc_guard.source_address`),
hands the request to `TrainerCalls` (which verifies it, rate limits it and routes it to the
`Trainer` / `JobRuntime`) and turns a `CallRefused` into `context.abort` with its code, details
and retry hint (`retry-after-ms` trailing metadata). The in-process trainer
(`node.local.inprocess`) calls the same `TrainerCalls`. Streams are bounded by the server's
guard (`node.net.grpc_guard`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from swarmrl.node.net.call_status import CallRefused
from swarmrl.node.net.grpc_guard import source_address
from swarmrl.node.net.grpc_server import GuardedServer, build_server
from swarmrl.node.runtime.limits import GrpcLimits, RateLimits
from swarmrl.node.trainer.calls import TrainerCalls
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from swarmrl.node.trainer.hosting import Trainer

log = logging.getLogger(__name__)


class TrainerService(pb_grpc.TrainerServicer):
    """Implements swarmrl.v1.Trainer on top of a `Trainer` (node.trainer.hosting), through `TrainerCalls`."""

    def __init__(self, trainer: Trainer, rate_limits: RateLimits | None = None) -> None:
        self.trainer = trainer
        self.calls = TrainerCalls(trainer, rate_limits)

    def SubmitJob(self, request: pb.Signed, context: grpc.ServicerContext) -> pb.JobAck:
        """Host a signed job (`Trainer.submit_job`); a refusal is an ack with a reason."""
        return self.calls.submit_job(request)

    def RequestLease(self, request: pb.Signed, context: grpc.ServicerContext) -> pb.LeaseReply:
        """Lease prompts of a job to the worker that signed the request (`TrainerCalls.request_lease`)."""
        return self.calls.request_lease(request, source_address(context.peer()))

    def SubmitRollouts(self, request_iterator: Iterator[pb.Signed], context: grpc.ServicerContext) -> pb.Receipt:
        """Admit each signed rollout batch of the stream; one receipt entry (accepted or the
        reason) per batch, in order. Over a rate limit the stream ends RESOURCE_EXHAUSTED with a
        retry hint (batches before it in the stream were admitted, and a resend is a replay)."""
        address = source_address(context.peer())
        receipt = pb.Receipt()
        try:
            for envelope in request_iterator:
                receipt.batches.append(self.calls.submit_rollouts(envelope, address))
        except CallRefused as refused:
            refused.abort(context)   # raises
        return receipt

    def FetchAdapter(self, request: pb.AdapterRequest, context: grpc.ServicerContext) -> Iterator[pb.AdapterChunk]:
        """Stream the signed updates that bring the requester to the version it wants, as chunks.
        Aborts NOT_FOUND for an unknown job, OUT_OF_RANGE for a version no longer kept."""
        try:
            yield from self.calls.fetch_adapter(request)
        except CallRefused as refused:
            refused.abort(context)

    def FetchDataset(self, request: pb.UpdateRequest, context: grpc.ServicerContext) -> Iterator[pb.AdapterChunk]:
        """Stream a hosted job's data-set file by its sha256 (`payload_sha256`), as chunks. Aborts
        NOT_FOUND when no hosted job has it."""
        try:
            yield from self.calls.fetch_dataset(request)
        except CallRefused as refused:
            refused.abort(context)

    def GetJobStatus(self, request: pb.JobStatusRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        """A job's status with its last `history` steps (state "unknown" for a job not hosted here)."""
        return self.calls.job_status(request)

    def SampleAdmitted(self, request: pb.SampleRequest, context: grpc.ServicerContext) -> Iterator[pb.AdmittedBatch]:
        """Stream admitted batches of a job after ledger sequence `after_seq`, each with its lease,
        for validators (`TrainerCalls.sample_admitted`). Nothing for an unknown job."""
        yield from self.calls.sample_admitted(request)

    def FetchStatements(self, request: pb.StatementRequest, context: grpc.ServicerContext) -> pb.StatementList:
        """The job's signed contribution statements (`TrainerCalls.fetch_statements`); aborts
        NOT_FOUND for an unknown job."""
        try:
            return self.calls.fetch_statements(request)
        except CallRefused as refused:
            refused.abort(context)
            raise   # abort raises; for the type checker

    def ReportVerdicts(self, request: pb.Signed, context: grpc.ServicerContext) -> pb.VerdictAck:
        """Act on a trusted validator's signed verdicts (`Trainer.report_verdicts`)."""
        return self.calls.report_verdicts(request)


def serve(trainer: Trainer, host: str, port: int, max_message_mb: int, *, limits: GrpcLimits | None = None,
          rate_limits: RateLimits | None = None,
          credentials: grpc.ServerCredentials | None = None) -> tuple[GuardedServer, int]:
    """Start the trainer's gRPC server on host:port (0 = any free port), with health and
    reflection, stream bounds `limits` and rate limits `rate_limits` (defaults when None), over
    TLS with `credentials` (node/net/tls.py), else plaintext; returns (server, bound port).
    `server.stop(grace)` is bounded (node.net.grpc_server)."""
    service = TrainerService(trainer, rate_limits)
    return build_server(host, port, max_message_mb=max_message_mb, limits=limits or GrpcLimits(),
                        services=["swarmrl.v1.Trainer"],
                        add_servicers=lambda server: pb_grpc.add_TrainerServicer_to_server(service, server),
                        credentials=credentials)

