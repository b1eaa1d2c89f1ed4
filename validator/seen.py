"""What this validator has already seen: first sightings of completions, and ledger cursors.

SQLite (stdlib), one connection serialized by a lock. `first_seen` is insert-or-get in one
statement, so the first batch to present a completion keeps the credit however often the
same ledgers are read again (a restart re-reads from the saved cursor).
"""

from __future__ import annotations

import threading
from pathlib import Path

from swarmrl.node.runtime.sqlite import connect
from swarmrl.validator.checks import FirstSeen

SCHEMA = """
CREATE TABLE IF NOT EXISTS completions (
    key TEXT PRIMARY KEY, job_id TEXT NOT NULL, prompt_index INTEGER NOT NULL, peer_id TEXT NOT NULL,
    batch_id TEXT NOT NULL, seq INTEGER NOT NULL, at_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS cursors (
    job_id TEXT NOT NULL, trainer_id TEXT NOT NULL, seq INTEGER NOT NULL, PRIMARY KEY (job_id, trainer_id));
"""


class SeenStore:
    """First sightings of completions (by content key) and per-(job, trainer) ledger cursors.

    path: the SQLite file (":memory:" for a throwaway store).
    """

    def __init__(self, path: Path | str) -> None:
        self._db = connect(path, SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the database connection; the store is unusable afterwards."""
        with self._lock:
            self._db.close()

    def first_seen(
        self, key: str, *, job_id: str, prompt_index: int, peer_id: str, batch_id: str, seq: int, now_ms: int
    ) -> FirstSeen:
        """Record this sighting unless the key is known; return the first sighting."""
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO completions VALUES (?, ?, ?, ?, ?, ?, ?)",
                (key, job_id, prompt_index, peer_id, batch_id, seq, now_ms),
            )
            peer, first_batch, first_seq = self._db.execute(
                "SELECT peer_id, batch_id, seq FROM completions WHERE key = ?", (key,)
            ).fetchone()
        return FirstSeen(peer, first_batch, int(first_seq))

    def cursor(self, job_id: str, trainer_id: str) -> int:
        """The highest ledger sequence already validated for (job, trainer); 0 when none."""
        with self._lock:
            row = self._db.execute(
                "SELECT seq FROM cursors WHERE job_id = ? AND trainer_id = ?", (job_id, trainer_id)
            ).fetchone()
        return int(row[0]) if row else 0

    def set_cursor(self, job_id: str, trainer_id: str, seq: int) -> None:
        """Advance the cursor of (job, trainer) to `seq` (never moves it back)."""
        with self._lock:
            self._db.execute(
                "INSERT INTO cursors VALUES (?, ?, ?) ON CONFLICT (job_id, trainer_id)"
                " DO UPDATE SET seq = MAX(seq, excluded.seq)",
                (job_id, trainer_id, seq),
            )
