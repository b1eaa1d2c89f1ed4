"""What a role's start refuses before it does anything, checked without side effects: `run(cfg)`
of every role calls `preflight(cfg)` first, and `swarmrl ROLE --dry-run` calls the same function,
so a dry run passes exactly when a start gets past its checks (issue 28: `worker --dry-run -o
base_model=nosuch/model` exited 0 while the start failed).

Checked: the ports the role listens on (`ports.check_port_free`: DHT, trainer gRPC, /metrics),
and a worker's base models: a model folder or cached hub id with its files (`find_base_model`,
which builds nothing for those), a built-in one prepared in the cache or convertible there (its
package installed; nothing is built). Not checked: the key's lock (taking it is the start) and
whether initial peers answer (that needs the DHT node running).
"""

from __future__ import annotations

from pathlib import Path

from swarmrl.node.runtime.config import BootstrapConfig, TrainerConfig, ValidatorConfig, WorkerConfig
from swarmrl.node.runtime.lifecycle import StartupError
from swarmrl.node.runtime.ports import check_port_free

RoleConfig = BootstrapConfig | TrainerConfig | WorkerConfig | ValidatorConfig
ROLE_CONFIGS = (BootstrapConfig, TrainerConfig, WorkerConfig, ValidatorConfig)
"""The config classes of the roles `preflight` checks (RoleConfig, for isinstance)."""


def preflight(cfg: RoleConfig) -> None:
    """Refuse `cfg` as the role's start would, before anything starts.

    Raises:
        StartupError: a port is taken, or a worker's base model can't be found or prepared here.
    """
    check_port_free(cfg.net.host, cfg.net.dht_port, "the DHT", "net.dht_port")
    if isinstance(cfg, TrainerConfig):
        check_port_free(cfg.grpc_host or cfg.net.host, cfg.grpc_port, "gRPC", "grpc_port")
    if not isinstance(cfg, BootstrapConfig) and cfg.metrics_port is not None:
        check_port_free(cfg.metrics_host, cfg.metrics_port, "/metrics", "metrics_port")
    if isinstance(cfg, WorkerConfig):
        for name in cfg.base_models or [cfg.base_model]:
            check_base_model(name, cfg.cache_dir)


def check_base_model(name: str, cache_dir: Path | None) -> None:
    """Fail as the worker's start would on base model `name`, without building or loading it.

    Raises:
        StartupError: not a model folder or cached hub id with its files, or a built-in model
            neither prepared in the cache nor convertible there.
    """
    from swarmrl.node.models import base_model as models
    from swarmrl.node.models.recipes import RECIPES, require_package

    if not models.is_builtin_model(name):
        try:
            models.find_base_model(name, cache_dir)   # a folder or the HF cache: checked, never built
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        return
    canonical = models.resolve_model_name(name)
    root = Path(cache_dir) if cache_dir is not None else models.default_cache_dir()
    if (root / RECIPES[canonical] / models.MANIFEST).is_file():
        return
    try:
        require_package(canonical)   # tiny needs none: it is built on first use
    except RuntimeError as exc:
        raise StartupError(f"base model {canonical} is not in the cache {root} and cannot be converted there: "
                           f"{exc}") from None
