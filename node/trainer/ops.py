"""The trainer's ops HTTP server: `/metrics` (trainer.metrics) and the live job pages
(node.ops.dashboard), on `metrics_host:metrics_port` (off when the port is None)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarmrl.node.ops.dashboard import StatusCache, add_dashboard_routes, local_fetch
from swarmrl.node.ops.http_server import OpsServer, Routes, start_ops_server
from swarmrl.node.ops.metrics import add_metrics_route, registry_of
from swarmrl.node.trainer.metrics import trainer_metrics
from swarmrl.node.trainer.status import job_status

if TYPE_CHECKING:
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
    add_dashboard_routes(routes, cache, lambda: sorted(trainer.jobs), f"trainer {trainer.identity.peer_id}")
    return start_ops_server(cfg.metrics_host, cfg.metrics_port, routes)


def ops_urls(server: OpsServer | None) -> dict[str, str]:
    """What the ready file says about the ops server ({} when off)."""
    return {} if server is None else {"metrics": server.url("/metrics"), "dashboard": server.url("/")}
