"""What `swarmrl audit` fetches from a trainer: its signed contribution statements (paged by
version, `FetchStatements`), the credited batches it still keeps whole (`SampleAdmitted` by
batch id), and the signed update header of a version (`FetchAdapter`). Anonymous calls, retried
briefly (`AUDIT_BACKOFF`): an unreachable trainer fails fast. Checks are `protocol.audit`'s."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial

from swarmrl.node.net.grpc_retry import Backoff, call_with_backoff, stream_with_backoff
from swarmrl.node.submitter.client import stub
from swarmrl.protocol.audit import statement_version
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc
from swarmrl.protocol.updates import headers

AUDIT_BACKOFF = Backoff(attempts=2, base_s=0.25, max_s=1.0)
MAX_STATEMENTS = 1_000_000   # an audit stops paging there (a chain longer than any job)
PAGE = 64                    # statements asked per call (the trainer's cap)
SAMPLE_PAGE = 256            # batch ids asked per SampleAdmitted call (the trainer's cap)


class AuditClient:
    """A trainer's books over gRPC (`endpoint` HOST:PORT; TLS pinned to `tls_sha256` if given)."""

    def __init__(self, endpoint: str, tls_sha256: bytes = b"", timeout_s: float = 30) -> None:
        self.trainer: pb_grpc.TrainerStub = stub(endpoint, tls_sha256=tls_sha256)
        self.timeout_s = timeout_s

    def status(self, job_id: str) -> pb.JobStatus:
        """The trainer's status of the job (state "unknown" when it does not host it)."""
        st: pb.JobStatus = call_with_backoff(lambda: self.trainer.GetJobStatus(
            pb.JobStatusRequest(job_id=job_id), timeout=self.timeout_s), AUDIT_BACKOFF)
        return st

    def statements(self, job_id: str) -> list[pb.Signed]:
        """Every signed statement of the job, ascending versions (paged by `after_version`)."""
        out: list[pb.Signed] = []
        after = 0
        while len(out) < MAX_STATEMENTS:
            req = pb.StatementRequest(job_id=job_id, after_version=after, max_statements=PAGE)
            page: pb.StatementList = call_with_backoff(
                partial(self.trainer.FetchStatements, req, timeout=self.timeout_s), AUDIT_BACKOFF)
            if not page.statements:
                break
            out += page.statements
            after = max(after + 1, *(statement_version(e) for e in page.statements))
        return out

    def batches(self, job_id: str, batch_ids: Iterable[str]) -> dict[str, pb.AdmittedBatch]:
        """The named batches (hex ids) the trainer still keeps whole, by the id it claims for each
        (the caller checks the id against the body)."""
        from swarmrl.protocol.signing import envelope_id

        ids, out = list(batch_ids), {}
        for lo in range(0, len(ids), SAMPLE_PAGE):
            req = pb.SampleRequest(job_id=job_id, batch_ids=ids[lo:lo + SAMPLE_PAGE], max_batches=SAMPLE_PAGE)
            for ab in stream_with_backoff(partial(self.trainer.SampleAdmitted, req, timeout=self.timeout_s),
                                          AUDIT_BACKOFF):
                out[envelope_id(ab.batch)] = ab
        return out

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
