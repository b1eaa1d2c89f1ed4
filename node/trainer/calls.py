"""What a trainer answers to each call of swarmrl.v1.Trainer, whatever carried the call.

`TrainerCalls` is the one place where a call meets the `Trainer` (`node.trainer.hosting`): the
rate limits (`node.net.rate_limits`: per source address before the signature is checked, per
verified peer after), routing to the job, and refusals. The gRPC service (`service.py`) hands it
each call with the caller's source address and turns a `CallRefused` into `context.abort`; the
in-process trainer (`node.local.inprocess`) hands it the same signed envelopes, parsed from bytes,
under one address of its own. So admission, replay protection, leases, rate limits and bans are
the same code on both paths.

Each handler verifies the envelope it receives and answers with a reason on bad input; one peer's
malformed message never stops the trainer. A refused lease is a reply with reason and retry
hint; a refused submission raises `CallRefused(RESOURCE_EXHAUSTED)` with the hint, so the worker
backs off and resends the same signed batch. Refusals are counted per job (`JobStatus.refused`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from swarmrl.node.net.call_status import CallRefused
from swarmrl.node.net.rate_limits import Kind, RateLimiter, retry_ms
from swarmrl.node.runtime.limits import RateLimits
from swarmrl.node.trainer.status import job_status
from swarmrl.protocol import signing, snapshot_sources
from swarmrl.protocol.admission import claimed_job_id
from swarmrl.protocol.blobs import blob_chunks
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import VersionNotKept, chunks

if TYPE_CHECKING:
    from swarmrl.node.trainer.hosting import Trainer
    from swarmrl.node.trainer.job import JobRuntime

log = logging.getLogger(__name__)
DEFAULT_SAMPLE = 16   # admitted batches a SampleAdmitted call gets when it asks for none
MAX_SAMPLE = 256      # the most it may ask for
SNAPSHOT_BUSY = "snapshot_busy"   # a worker's snapshot request refused at max_snapshot_streams
SNAPSHOT_RETRY_MS = 500           # its retry hint: the worker's next look at the peers


class TrainerCalls:
    """The trainer's answer to every call (see the module docstring); thread-safe as the
    `Trainer` is. `address`: the caller's source address (`grpc_guard.source_address`)."""

    def __init__(self, trainer: Trainer, rate_limits: RateLimits | None = None) -> None:
        self.trainer = trainer
        self.limiter = RateLimiter(rate_limits or RateLimits())
        self._snapshot_streams = 0   # snapshot streams to workers being served (under _lock)
        self._lock = threading.Lock()

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

    def submit_job(self, request: pb.Signed) -> pb.JobAck:
        """Host a signed job (`Trainer.submit_job`); a refusal is an ack with a reason."""
        return self.trainer.submit_job(request)

    def request_lease(self, request: pb.Signed, address: str) -> pb.LeaseReply:
        """Lease prompts of a job to the worker that signed the request; a bad signature, an
        unknown job or a rate limit is a reply with a reason and no lease."""
        reason, wait_ms = self._throttled("lease", claimed_job_id(request.body), address)
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

    def submit_rollouts(self, envelope: pb.Signed, address: str) -> pb.BatchReceipt:
        """Admit one signed rollout batch (`Trainer.admit`): its receipt, accepted or with the reason.

        Raises:
            CallRefused: RESOURCE_EXHAUSTED with a retry hint, over a rate limit (per address,
                or per peer once the signature verified); nothing was admitted.
        """
        job_id = claimed_job_id(envelope.body)   # read BEFORE verification: only to count a refusal
        self._refuse_if_throttled(self._throttled("submit", job_id, address))

        def verified(peer_id: str) -> None:
            self._refuse_if_throttled(self._throttled("submit", job_id, address, peer_id))
        return self.trainer.admit(envelope, on_verified=verified)

    @staticmethod
    def _refuse_if_throttled(throttled: tuple[str, int]) -> None:
        reason, wait_ms = throttled
        if reason:
            raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, reason, wait_ms)

    def fetch_adapter(self, request: pb.AdapterRequest) -> Iterator[pb.AdapterChunk]:
        """The signed updates (deltas or a snapshot) that bring the requester to the version it
        wants, as chunks; with `header_only`, each update's signed header alone (one chunk).

        Raises:
            CallRefused: NOT_FOUND for an unknown job; OUT_OF_RANGE for a version no longer kept
                (pruned, `retention.py`: unlike a never-published version, which yields nothing);
                RESOURCE_EXHAUSTED "snapshot_busy" for a worker's snapshot request past the
                trainer's `max_snapshot_streams` (`_start_snapshot`).
        """
        job = self.trainer.jobs.get(request.job_id)
        if job is None:
            raise CallRefused(grpc.StatusCode.NOT_FOUND, f"unknown job {request.job_id}")
        bounded = request.snapshot and request.requester == "worker"
        if bounded:
            self._start_snapshot(job)
        try:
            for update in job.updates(request):
                if request.header_only:   # what the update published, without its bytes (audits)
                    yield pb.AdapterChunk(header=update.header, last=True)
                    continue
                self.trainer.count_upload(len(update.payload))
                job.count_upload(request.requester, len(update.payload))
                yield from chunks(update.header, update.payload)
        except VersionNotKept as exc:
            raise CallRefused(grpc.StatusCode.OUT_OF_RANGE, str(exc)) from exc
        finally:
            if bounded:
                with self._lock:
                    self._snapshot_streams -= 1

    def _start_snapshot(self, job: JobRuntime) -> None:
        """Count one more snapshot stream to a worker, or refuse it at the trainer's bound
        (`max_snapshot_streams`, `snapshot_sources.admits_stream`; 0: no bound), counted against the job.

        Raises:
            CallRefused: RESOURCE_EXHAUSTED "snapshot_busy" with a retry hint (ask peers meanwhile)."""
        bound = self.trainer.cfg.max_snapshot_streams
        with self._lock:
            if bound and not snapshot_sources.admits_stream(self._snapshot_streams, bound):
                job.admission.count_refusal(SNAPSHOT_BUSY)
                raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"{SNAPSHOT_BUSY}: {bound} snapshot streams open; fetch one from a peer",
                                  SNAPSHOT_RETRY_MS)
            self._snapshot_streams += 1

    def fetch_dataset(self, request: pb.UpdateRequest) -> Iterator[pb.AdapterChunk]:
        """A hosted job's data-set file by its sha256 (`payload_sha256`), as chunks.

        Raises:
            CallRefused: NOT_FOUND when no hosted job has it.
        """
        data = self.trainer.dataset_bytes(bytes(request.payload_sha256).hex())
        if data is None:
            raise CallRefused(grpc.StatusCode.NOT_FOUND, "no hosted job has this data set")
        self.trainer.count_upload(len(data))
        yield from blob_chunks(data)

    def job_status(self, request: pb.JobStatusRequest) -> pb.JobStatus:
        """A job's status with its last `history` steps (state "unknown" for a job not hosted here)."""
        job = self.trainer.jobs.get(request.job_id)
        if job is None:
            return pb.JobStatus(job_id=request.job_id, state="unknown")
        return job_status(job, request.history, request.verdicts, request.holders)

    def sample_admitted(self, request: pb.SampleRequest) -> Iterator[pb.AdmittedBatch]:
        """Admitted batches of a job after ledger sequence `after_seq`, or (audits) those named
        by `batch_ids` that are still whole (at most `max_batches`, default DEFAULT_SAMPLE, capped
        at MAX_SAMPLE), each with its lease, for validators. Nothing for an unknown job."""
        if request.job_id not in self.trainer.jobs:
            return
        ledger = self.trainer.ledger
        limit = max(1, min(request.max_batches or DEFAULT_SAMPLE, MAX_SAMPLE))
        found = (ledger.batches_by_id(request.job_id, list(request.batch_ids)[:limit]) if request.batch_ids
                 else ledger.batches_after(request.job_id, request.after_seq, limit))
        for seq, lease_id, envelope in found:
            yield pb.AdmittedBatch(seq=seq, batch=envelope, lease=ledger.lease(lease_id),
                                   admitted_prompt_indices=ledger.batch_group_indices(seq))

    def fetch_statements(self, request: pb.StatementRequest) -> pb.StatementList:
        """The job's signed contribution statements above `after_version`, ascending, at most
        `max_statements` (`statements.StatementBook.fetch` bounds it).

        Raises:
            CallRefused: NOT_FOUND for an unknown job.
        """
        job = self.trainer.jobs.get(request.job_id)
        if job is None:
            raise CallRefused(grpc.StatusCode.NOT_FOUND, f"unknown job {request.job_id}")
        return pb.StatementList(statements=job.statements.fetch(request.after_version, request.max_statements))

    def report_verdicts(self, request: pb.Signed) -> pb.VerdictAck:
        """Act on a trusted validator's signed verdicts (`Trainer.report_verdicts`)."""
        return self.trainer.report_verdicts(request)
