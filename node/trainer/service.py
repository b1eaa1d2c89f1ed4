"""The trainer's gRPC service: thin glue from the wire to `Trainer` / `JobRuntime`.

Each handler verifies the envelope it receives, answers with a reason on bad input and never
lets one peer's malformed message stop the server. Lease requests and submissions are rate limited
per source address (before the signature is checked) and per verified peer id
(`node.net.rate_limits`); a refused lease is a reply with reason and retry hint, a refused submission
ends its stream with RESOURCE_EXHAUSTED and the hint, so the worker backs off and resends the same
signed batch. Refusals are counted per job (`JobStatus.refused`). Streams are bounded by the
server's guard (`node.net.grpc_guard`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from swarmrl.node.net.grpc_guard import RETRY_AFTER_KEY, source_address
from swarmrl.node.net.grpc_server import GuardedServer, build_server
from swarmrl.node.net.rate_limits import Kind, RateLimiter, retry_ms
from swarmrl.node.runtime.limits import GrpcLimits, RateLimits
from swarmrl.node.trainer.status import job_status
from swarmrl.protocol import signing
from swarmrl.protocol.admission import claimed_job_id
from swarmrl.protocol.blobs import blob_chunks
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc
from swarmrl.protocol.updates import VersionNotKept, chunks

if TYPE_CHECKING:
    from swarmrl.node.trainer.hosting import Trainer

log = logging.getLogger(__name__)


class TrainerService(pb_grpc.TrainerServicer):
    """Implements swarmrl.v1.Trainer on top of a `Trainer` (node.trainer.hosting)."""

    def __init__(self, trainer: Trainer, rate_limits: RateLimits | None = None) -> None:
        self.trainer = trainer
        self.limiter = RateLimiter(rate_limits or RateLimits())

    def _throttled(self, kind: Kind, job_id: str, address: str, peer_id: str = "") -> tuple[str, int]:
        """(reason, retry hint ms) if the address (or, given, the verified peer) is over its
        rate for `kind` calls, counted against the job; ("", 0) if the call may go on."""
        reason, wait = (self.limiter.check_peer(kind, peer_id) if peer_id
                        else self.limiter.check_address(kind, address))
        if reason:
            job = self.trainer.jobs.get(job_id)
            if job is not None:
                job.admission.count_refusal(reason)
        return reason, retry_ms(wait) if reason else 0

    def SubmitJob(self, request: pb.Signed, context: grpc.ServicerContext) -> pb.JobAck:
        """Host a signed job (`Trainer.submit_job`); a refusal is an ack with a reason."""
        return self.trainer.submit_job(request)

    def RequestLease(self, request: pb.Signed, context: grpc.ServicerContext) -> pb.LeaseReply:
        """Lease prompts of a job to the worker that signed the request; a bad signature or an
        unknown job is a reply with a reason and no lease."""
        address = source_address(context.peer())
        reason, wait_ms = self._throttled("lease", _claimed_job(request, pb.LeaseRequest), address)
        if reason:
            return pb.LeaseReply(reason=reason, retry_after_ms=wait_ms)
        try:
            req, peer = signing.open_signed(request, signing.LEASE_REQUEST, pb.LeaseRequest)
        except signing.SignatureError as exc:
            return pb.LeaseReply(reason=exc.reason)
        job = self.trainer.jobs.get(req.job_id)
        if job is None:
            return pb.LeaseReply(reason="unknown_job")
        reason, wait_ms = self._throttled("lease", req.job_id, address, peer)
        if reason:
            return pb.LeaseReply(reason=reason, retry_after_ms=wait_ms)
        return job.admission.request_lease(peer, req)

    def SubmitRollouts(self, request_iterator: Iterator[pb.Signed], context: grpc.ServicerContext) -> pb.Receipt:
        """Admit each signed rollout batch of the stream; one receipt entry (accepted or the
        reason) per batch, in order. Over a rate limit the stream ends RESOURCE_EXHAUSTED with a
        retry hint (batches before it in the stream were admitted, and a resend is a replay)."""
        address = source_address(context.peer())
        receipt = pb.Receipt()
        for envelope in request_iterator:
            job_id = _claimed_job(envelope, pb.RolloutBatch)
            self._refuse_if_throttled(context, self._throttled("submit", job_id, address))

            def verified(peer_id: str, job_id: str = job_id) -> None:
                self._refuse_if_throttled(context, self._throttled("submit", job_id, address, peer_id))
            receipt.batches.append(self.trainer.admit(envelope, on_verified=verified))
        return receipt

    @staticmethod
    def _refuse_if_throttled(context: grpc.ServicerContext, throttled: tuple[str, int]) -> None:
        reason, wait_ms = throttled
        if reason:
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(wait_ms)),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)   # raises

    def FetchAdapter(self, request: pb.AdapterRequest, context: grpc.ServicerContext) -> Iterator[pb.AdapterChunk]:
        """Stream the signed updates (deltas or a snapshot) that bring the requester to the version
        it wants, as chunks. Aborts NOT_FOUND for an unknown job, OUT_OF_RANGE for a version no
        longer kept."""
        job = self.trainer.jobs.get(request.job_id)
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown job {request.job_id}")   # raises
            return
        try:
            for update in job.updates(request):
                self.trainer.count_upload(len(update.payload))
                job.count_upload(request.requester, len(update.payload))
                yield from chunks(update.header, update.payload)
        except VersionNotKept as exc:  # pruned (retention.py): say so, unlike a never-published version
            context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))

    def FetchDataset(self, request: pb.UpdateRequest, context: grpc.ServicerContext) -> Iterator[pb.AdapterChunk]:
        """Stream a hosted job's data-set file by its sha256 (`payload_sha256`), as chunks. Aborts
        NOT_FOUND when no hosted job has it."""
        data = self.trainer.dataset_bytes(bytes(request.payload_sha256).hex())
        if data is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no hosted job has this data set")   # raises
            return
        self.trainer.count_upload(len(data))
        yield from blob_chunks(data)

    def GetJobStatus(self, request: pb.JobStatusRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        """A job's status with its last `history` steps (state "unknown" for a job not hosted here)."""
        job = self.trainer.jobs.get(request.job_id)
        if job is None:
            return pb.JobStatus(job_id=request.job_id, state="unknown")
        return job_status(job, request.history, request.verdicts, request.holders)

    def SampleAdmitted(self, request: pb.SampleRequest, context: grpc.ServicerContext) -> Iterator[pb.AdmittedBatch]:
        """Stream admitted batches of a job after ledger sequence `after_seq` (at most
        `max_batches`, default 16, capped at 256), each with its lease, for validators. Nothing
        for an unknown job."""
        job = self.trainer.jobs.get(request.job_id)
        if job is None:
            return
        limit = max(1, min(request.max_batches or 16, 256))
        for seq, lease_id, envelope in self.trainer.ledger.batches_after(request.job_id, request.after_seq, limit):
            lease = self.trainer.ledger.lease(lease_id)
            yield pb.AdmittedBatch(seq=seq, batch=envelope, lease=lease,
                                   admitted_prompt_indices=self.trainer.ledger.batch_group_indices(seq))

    def ReportVerdicts(self, request: pb.Signed, context: grpc.ServicerContext) -> pb.VerdictAck:
        """Act on a trusted validator's signed verdicts (`Trainer.report_verdicts`)."""
        return self.trainer.report_verdicts(request)


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


def _claimed_job(envelope: pb.Signed, kind: type[pb.LeaseRequest | pb.RolloutBatch]) -> str:
    """The job id a signed request claims, read BEFORE verification: only to count a refusal
    against that job ("" for garbage). Both kinds carry it as field 1 (`claimed_job_id`)."""
    return claimed_job_id(envelope.body)
