"""Group commit for a SQLite database in WAL mode: each writer is answered only once its commit
is on disk, and one fdatasync of the write-ahead log covers every commit made before it began.

The connection runs with synchronous=NORMAL, so COMMIT appends the transaction's frames to the
WAL (the OS's page cache) without waiting for the disk. The writer then calls `wait(ticket)`
outside any lock: if no sync is running it becomes the leader and fdatasyncs the WAL; commits
that land while that sync runs wait for it to end and share the next one. A writer running
alone pays one sync per commit, as synchronous=FULL does; writers arriving together (the
trainer's gRPC threads admitting batches of many workers) share one. SQLite's own promises for
NORMAL in WAL mode still hold: the database never corrupts, the WAL is synced before each
checkpoint and the database after (https://www.sqlite.org/pragma.html#pragma_synchronous); what
FULL adds, that a commit survives a power loss once COMMIT returns, holds here once `wait`
returns. A failed sync leaves the kernel free to drop the unwritten pages, so the store is
marked broken and every later `wait` raises too (the process must restart and reread the
database, as PostgreSQL does on a failed fsync).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_fdatasync = getattr(os, "fdatasync", os.fsync)   # (macOS has no fdatasync)


class WalSyncError(OSError):
    """The write-ahead log could not be synced: commits since the last sync may be lost."""


class GroupCommit:
    """Durability of the commits of one SQLite connection in WAL mode (see the module docstring).

    path: the database file; its log is `path` + "-wal" (opened at the first sync).
    Thread-safe: `committed` is called after each COMMIT (under the caller's connection lock,
    so tickets follow commit order), `wait` afterwards without that lock.
    """

    def __init__(self, path: Path | str) -> None:
        self.wal_path = Path(f"{path}-wal")
        self._cv = threading.Condition()
        self._committed = 0     # tickets handed out: commits whose frames are written
        self._synced = 0        # every commit up to this ticket is on disk
        self._syncing = False
        self._broken: BaseException | None = None
        self._fd: int | None = None
        self.syncs = 0          # fdatasync calls made (for tests and benchmarks)

    def committed(self) -> int:
        """Register a COMMIT that just returned; its ticket for `wait`."""
        with self._cv:
            self._committed += 1
            return self._committed

    def last(self) -> int:
        """The ticket of the latest registered commit (0 if none)."""
        with self._cv:
            return self._committed

    def wait(self, ticket: int) -> None:
        """Return once the commit with `ticket` (and every one before it) is on disk.

        Raises:
            WalSyncError: this sync or an earlier one failed (the store is unusable).
        """
        with self._cv:
            while True:
                if self._broken is not None:
                    raise WalSyncError(f"{self.wal_path}: an earlier sync failed: {self._broken}")
                if self._synced >= ticket:
                    return
                if not self._syncing:
                    break
                self._cv.wait()
            self._syncing, target = True, self._committed   # every COMMIT so far has written its frames
        try:
            self._sync()
        except OSError as exc:
            with self._cv:
                self._broken, self._syncing = exc, False
                self._cv.notify_all()
            raise WalSyncError(f"{self.wal_path}: fdatasync failed: {exc}") from exc
        with self._cv:
            self._synced, self._syncing = max(self._synced, target), False
            self.syncs += 1
            self._cv.notify_all()

    def _sync(self) -> None:
        # The WAL lives as long as the database has an open connection (ours), and a restart after
        # a checkpoint rewrites it in place, so one descriptor serves; reopened if it was replaced.
        if self._fd is not None and os.fstat(self._fd).st_ino != _inode(self.wal_path):
            os.close(self._fd)
            self._fd = None
        if self._fd is None:
            self._fd = os.open(self.wal_path, os.O_RDONLY)
        _fdatasync(self._fd)

    def close(self) -> None:
        """Release the log's descriptor (after the connection's last commit was waited for)."""
        with self._cv:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _inode(path: Path) -> int:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return -1
