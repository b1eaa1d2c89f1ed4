"""What `swarmrl audit` fetches from a trainer: its signed contribution statements (paged by
version, `FetchStatements`), the credited batches it still keeps whole (`SampleAdmitted` by
batch id), and the signed update header of a version (`FetchAdapter`). Anonymous calls, retried
briefly (`AUDIT_BACKOFF`): an unreachable trainer fails fast. Checks are `protocol.audit`'s."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial

from swarmrl.node.net import tls
from swarmrl.node.net.grpc_options import channel_options
from swarmrl.node.net.grpc_retry import Backoff, call_with_backoff, stream_with_backoff
from swarmrl.protocol.book_paging import all_statements, batches_by_id
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc
from swarmrl.protocol.updates import ReceivedUpdate, assemble, headers

AUDIT_BACKOFF = Backoff(attempts=2, base_s=0.25, max_s=1.0)
PAGE = 64                    # statements asked per call (the trainer's cap)


class AuditClient:
    """A trainer's books over gRPC (`endpoint` HOST:PORT; TLS pinned to `tls_sha256` if given).

    Raises (on construction):
        tls.PinError: TLS was asked for and the pinned certificate could not be confirmed.
    """

    def __init__(self, endpoint: str, tls_sha256: bytes = b"", timeout_s: float = 30) -> None:
        self.channel = tls.channel(endpoint, tls_sha256, channel_options(64))
        self.trainer = pb_grpc.TrainerStub(self.channel)
        self.timeout_s = timeout_s

    def close(self) -> None:
        """Close the channel to the trainer."""
        self.channel.close()

    def status(self, job_id: str) -> pb.JobStatus:
        """The trainer's status of the job (state "unknown" when it does not host it)."""
        st: pb.JobStatus = call_with_backoff(lambda: self.trainer.GetJobStatus(
            pb.JobStatusRequest(job_id=job_id), timeout=self.timeout_s), AUDIT_BACKOFF)
        return st

    def statements(self, job_id: str) -> list[pb.Signed]:
        """Every signed statement of the job, ascending versions (`book_paging.all_statements`)."""
        return all_statements(partial(self.page, job_id))

    def page(self, job_id: str, after_version: int, max_statements: int = PAGE) -> Sequence[pb.Signed]:
        """The job's signed statements above `after_version`, ascending, at most `max_statements`."""
        req = pb.StatementRequest(job_id=job_id, after_version=after_version, max_statements=max_statements)
        got: pb.StatementList = call_with_backoff(
            partial(self.trainer.FetchStatements, req, timeout=self.timeout_s), AUDIT_BACKOFF)
        return got.statements

    def batches(self, job_id: str, batch_ids: Iterable[str]) -> dict[str, pb.AdmittedBatch]:
        """The named batches (hex ids) the trainer still keeps whole, by the id it claims for each
        (the caller checks the id against the body; `book_paging.batches_by_id`)."""
        def page(ids: list[str]) -> Iterable[pb.AdmittedBatch]:
            req = pb.SampleRequest(job_id=job_id, batch_ids=ids, max_batches=len(ids))
            return stream_with_backoff(partial(self.trainer.SampleAdmitted, req, timeout=self.timeout_s),
                                       AUDIT_BACKOFF)
        return batches_by_id(page, batch_ids)

    def update_header(self, job_id: str, version: int, trainer_id: str) -> pb.AdapterUpdate | None:
        """The trainer-signed update header that produced `version` (its delta from version - 1,
        else a snapshot), its signature checked (`updates.headers`), fetched without the payload
        (`header_only`); None when the trainer no longer keeps it."""
        req = pb.AdapterRequest(job_id=job_id, have_version=version - 1, want_version=version, header_only=True,
                                requester="auditor")
        try:
            for header in headers(stream_with_backoff(lambda: self.trainer.FetchAdapter(req, timeout=self.timeout_s),
                                                      AUDIT_BACKOFF), trainer_id):
                if header.to_version == version:
                    return header
        except Exception:  # noqa: BLE001 - OUT_OF_RANGE (pruned) or a bad stream: not available
            return None
        return None


    def updates(self, job_id: str, have_version: int, want_version: int, trainer_id: str) -> list[ReceivedUpdate]:
        """The trainer's signed updates from `have_version` to `want_version` with their payloads
        (deltas, or a snapshot where a delta is no longer kept), verified (`updates.assemble`).

        Raises:
            grpc.RpcError: the call failed (OUT_OF_RANGE: a version the trainer no longer keeps).
            AdapterError: a header or payload that does not verify.
        """
        req = pb.AdapterRequest(job_id=job_id, have_version=have_version, want_version=want_version,
                                requester="auditor")
        return list(assemble(stream_with_backoff(lambda: self.trainer.FetchAdapter(req, timeout=self.timeout_s),
                                                 AUDIT_BACKOFF), trainer_id))


def hosting_books(endpoints: Sequence[str]) -> Callable[[str], AuditClient | None]:
    """job id -> the books of the first trainer at `endpoints` (HOST:PORT, plaintext) that hosts
    the job, None when none does; a trainer that can't be reached is skipped."""
    import grpc

    clients = [AuditClient(e) for e in endpoints]

    def books(job_id: str) -> AuditClient | None:
        for c in clients:
            try:
                if c.status(job_id).state != "unknown":
                    return c
            except grpc.RpcError:
                continue
        return None
    return books
