"""The trainer's ops HTTP server: `/metrics` (trainer.metrics) and the live job pages
(node.ops.dashboard), with each job's leaderboard read from the trainer's own books
(`LocalBooks`: the statements it serves, the batches its ledger keeps), on
`metrics_host:metrics_port` (off when the port is None)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarmrl.node.ops.dashboard import (
    CREDIT_TTL_S,
    StatusCache,
    add_dashboard_routes,
    books_credit,
    local_fetch,
)
from swarmrl.node.ops.http_server import OpsServer, Routes, start_ops_server
from swarmrl.node.ops.metrics import add_metrics_route, registry_of
from swarmrl.node.trainer.calls import TrainerCalls
from swarmrl.node.trainer.metrics import trainer_metrics
from swarmrl.node.trainer.statements import MAX_STATEMENTS
from swarmrl.node.trainer.status import job_status
from swarmrl.protocol.book_paging import all_statements, batches_by_id
from swarmrl.protocol.pb import swarm_pb2 as pb

if TYPE_CHECKING:
    from collections.abc import Iterable

    from swarmrl.node.runtime.config import TrainerConfig
    from swarmrl.node.trainer.hosting import Trainer

STATUS_TTL_S = 1.0   # a job's status is read at most once a second for the pages


def start_trainer_ops(trainer: Trainer, cfg: TrainerConfig) -> OpsServer | None:
    """Start the ops server (None when `metrics_port` is None)."""
    if cfg.metrics_port is None:
        return None
    routes = Routes()
    add_metrics_route(routes, registry_of(lambda: trainer_metrics(trainer)))
    cache = StatusCache(local_fetch(lambda: trainer.jobs, job_status), ttl_s=STATUS_TTL_S)
    books = LocalBooks(trainer)
    credit = StatusCache(books_credit(lambda j: books if j in trainer.jobs else None), ttl_s=CREDIT_TTL_S)
    add_dashboard_routes(routes, cache, lambda: sorted(trainer.jobs), f"trainer {trainer.identity.peer_id}", credit)
    return start_ops_server(cfg.metrics_host, cfg.metrics_port, routes)


class LocalBooks:
    """A trainer's books read in-process, for its own leaderboards (`protocol.leaderboard.Books`):
    the same statements and batches its gRPC `FetchStatements` and `SampleAdmitted` serve."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.calls = trainer, TrainerCalls(trainer)

    def status(self, job_id: str) -> pb.JobStatus:
        """The job's status without history ("unknown" when not hosted)."""
        job = self.trainer.jobs.get(job_id)
        return pb.JobStatus(job_id=job_id, state="unknown") if job is None else job_status(job, 0)

    def statements(self, job_id: str) -> list[pb.Signed]:
        """Every signed statement of the job, ascending (paged as FetchStatements pages)."""
        job = self.trainer.jobs.get(job_id)
        return [] if job is None else all_statements(lambda after: job.statements.fetch(after, MAX_STATEMENTS))

    def batches(self, job_id: str, batch_ids: Iterable[str]) -> dict[str, pb.AdmittedBatch]:
        """The named batches the ledger keeps whole, by id (`TrainerCalls.sample_admitted`)."""
        return batches_by_id(lambda ids: self.calls.sample_admitted(
            pb.SampleRequest(job_id=job_id, batch_ids=ids, max_batches=len(ids))), batch_ids)


def ops_urls(server: OpsServer | None) -> dict[str, str]:
    """What the ready file says about the ops server ({} when off)."""
    return {} if server is None else {"metrics": server.url("/metrics"), "dashboard": server.url("/")}
