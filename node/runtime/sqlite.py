"""One way every node opens its SQLite files (ledger, reputation, first sightings)."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def connect(path: Path | str, schema: str, *, durable: bool = False) -> sqlite3.Connection:
    """Open (creating folders and tables) a SQLite file shared by threads under the caller's lock.

    WAL journal, autocommit (callers use explicit transactions); `durable` adds
    synchronous=FULL so a committed transaction survives power loss (the ledger's promise that an
    acknowledged rollout is never lost). ":memory:" gives a throwaway store.
    """
    if str(path) != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    if durable:
        db.execute("PRAGMA synchronous=FULL")
    db.executescript(schema)
    return db
