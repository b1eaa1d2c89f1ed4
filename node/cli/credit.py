"""`swarmrl worker --credit`: the worker's credit per job, read from the trainer-signed receipts
it kept (`node.worker.receipts`), printed as a table; nothing is started."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime

from swarmrl.node.cli.checks import UsageError
from swarmrl.node.runtime.config import WorkerConfig


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def print_credit(cfg: WorkerConfig) -> int:
    """Print the credit per job of the worker whose key `cfg.key` names (groups admitted, groups
    in the receipted batches, batches, signing trainers, first and last receipt); returns 0.

    Raises:
        UsageError: no key at `cfg.key` (no worker ran with it), or the receipts file is not one.
    """
    from rich.console import Console
    from rich.table import Table

    from swarmrl.node.models.base_model import default_cache_dir
    from swarmrl.node.worker.receipts import ReceiptStore, receipts_path
    from swarmrl.protocol.identity import Identity

    if not cfg.key.is_file():
        raise UsageError(f"no worker key at {str(cfg.key)!r}: no worker ran with it, so it has no receipts "
                         "(give the worker's key with -o key=PATH or --config)")
    peer_id = Identity.load(cfg.key).peer_id
    path = receipts_path(cfg.cache_dir or default_cache_dir(), peer_id)
    console = Console()
    if not path.is_file():
        console.print(f"worker {peer_id}: no receipts yet ({path})", markup=False)
        return 0
    try:
        store = ReceiptStore(path)
        credit = store.credit()
        store.close()
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"{str(path)!r} is not a receipts file ({exc})") from exc
    table = Table("job", "groups admitted", "groups sent", "batches", "trainers", "first", "last",
                  title=f"worker {peer_id}: credit from trainer-signed receipts ({path})")
    for c in credit:
        table.add_row(c.job_id, str(c.admitted), str(c.groups), str(c.batches), str(c.trainers), _utc(c.first_ms),
                      _utc(c.last_ms))
    console.print(table)
    return 0
