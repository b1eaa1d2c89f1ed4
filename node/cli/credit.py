"""`swarmrl worker --credit`: the worker's credit per job, read from the trainer-signed receipts
it kept (`node.worker.receipts`), one line per job with its whole id; nothing is started."""

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
    from swarmrl.node.models.base_model import default_cache_dir
    from swarmrl.node.worker.receipts import ReceiptStore, receipts_path
    from swarmrl.protocol.identity import Identity

    if not cfg.key.is_file():
        raise UsageError(f"no worker key at {str(cfg.key)!r}: no worker ran with it, so it has no receipts "
                         "(give the worker's key with -o key=PATH or --config)")
    peer_id = Identity.load(cfg.key).peer_id
    path = receipts_path(cfg.cache_dir or default_cache_dir(), peer_id)
    if not path.is_file():
        print(f"worker {peer_id}: no receipts yet ({path})")
        return 0
    try:
        store = ReceiptStore(path)
        credit = store.credit()
        store.close()
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"{str(path)!r} is not a receipts file ({exc})") from exc
    print(f"worker {peer_id}: credit from trainer-signed receipts ({path})")
    for c in credit:
        print(f"job {c.job_id}: {c.admitted} groups admitted of {c.groups} sent, {c.batches} batches, "
              f"{c.trainers} trainer{'s' * (c.trainers != 1)}, {_utc(c.first_ms)} to {_utc(c.last_ms)}")
    return 0
