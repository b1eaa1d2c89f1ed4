"""The trainer's gRPC service: thin glue from the wire to `Trainer` / `JobRuntime`.

Each handler verifies the envelope it receives, answers with a reason on bad input and never
lets one peer's malformed message stop the server.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures
from typing import TYPE_CHECKING

import grpc

from swarmrl.node.grpc_options import server_options
from swarmrl.node.grpc_standard import add_standard_services
from swarmrl.node.runtime import StartupError
from swarmrl.protocol import signing
from swarmrl.protocol.blobs import blob_chunks
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc
from swarmrl.protocol.updates import VersionNotKept, chunks

if TYPE_CHECKING:
    from swarmrl.node.trainer.main import Trainer

log = logging.getLogger(__name__)


class TrainerService(pb_grpc.TrainerServicer):
    """Implements swarmrl.v1.Trainer on top of a `Trainer` (node.trainer.main)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def SubmitJob(self, request: pb.Signed, context: grpc.ServicerContext) -> pb.JobAck:
        """Host a signed job (`Trainer.submit_job`); a refusal is an ack with a reason."""
        return self.trainer.submit_job(request)

    def RequestLease(self, request: pb.Signed, context: grpc.ServicerContext) -> pb.LeaseReply:
        """Lease prompts of a job to the worker that signed the request; a bad signature or an
        unknown job is a reply with a reason and no lease."""
        try:
            req, peer = signing.open_signed(request, signing.LEASE_REQUEST, pb.LeaseRequest)
        except signing.SignatureError as exc:
            return pb.LeaseReply(reason=exc.reason)
        job = self.trainer.jobs.get(req.job_id)
        if job is None:
            return pb.LeaseReply(reason="unknown_job")
        return job.admission.request_lease(peer, req)

    def SubmitRollouts(self, request_iterator: Iterator[pb.Signed], context: grpc.ServicerContext) -> pb.Receipt:
        """Admit each signed rollout batch of the stream; one receipt entry (accepted or the
        reason) per batch, in order."""
        receipt = pb.Receipt()
        for envelope in request_iterator:
            receipt.batches.append(self.trainer.admit(envelope))
        return receipt

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
        return job.status(request.history, request.verdicts, request.holders)

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


def serve(trainer: Trainer, host: str, port: int, max_message_mb: int, workers: int = 8) -> tuple[grpc.Server, int]:
    """Start the gRPC server on host:port (0 = any free port); returns (server, bound port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=server_options(max_message_mb))
    pb_grpc.add_TrainerServicer_to_server(TrainerService(trainer), server)
    add_standard_services(server, ["swarmrl.v1.Trainer"])   # grpc.health.v1 + server reflection
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises "Failed to bind" where older versions returned 0
        bound = 0
    if bound == 0:
        raise StartupError(f"could not serve gRPC on {host}:{port}: the port is taken or the address is not ours (grpc_port=0 picks a free port)")
    server.start()
    return server, bound
