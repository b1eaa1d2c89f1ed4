"""The trainer's ledger: SQLite, the durable record of jobs, leases, admitted groups and steps.

Admitted groups are committed and on disk (WAL, synced by a group commit unless the operator
chose "normal": see `Ledger`) before the worker's receipt is sent, so no acknowledged rollout is
lost to a crash. Groups move pending -> trained | dropped.

A job that runs for days keeps its ledger small with `compact`: a batch whose groups are all
trained or dropped, received before a horizon, loses its token payloads (the batch envelope and
its groups' blobs, most of the bytes) and a closed lease past its deadline is deleted once no
whole batch names it. What stays, one small row each, is what replay protection and the counts
need: every batch id (a replayed batch is refused `replay`), every admitted prompt index (never
admitted twice), states, peers, rejections, verdicts. A pending group is never touched.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from swarmrl.node.runtime.group_commit import GroupCommit
from swarmrl.node.runtime.sqlite import connect
from swarmrl.node.trainer.ledger_credit import CreditTables
from swarmrl.node.trainer.ledger_peers import PeerTables
from swarmrl.node.trainer.ledger_schema import SCHEMA
from swarmrl.protocol.pb import swarm_pb2 as pb

COMPACT_BATCHES = 1000   # batches one Ledger.compact call clears at most


@dataclass(frozen=True)
class Probation:
    """Which pending groups of peers without a passing verdict a step may not use yet: those
    whose batch arrived after `held_after_ms` (unix ms) and whose policy version is above
    `last_chance_version` (the step's staleness floor: a group at it is trained now or never)."""

    held_after_ms: int
    last_chance_version: int


@dataclass(frozen=True)
class PendingGroup:
    """An admitted, not yet trained group as the learner consumes it."""

    row_id: int
    peer_id: str
    group: pb.Group


class Ledger(PeerTables, CreditTables):
    """Thread-safe SQLite ledger (one connection, serialized by a lock).

    synchronous: "full" (default): every write method returns only once its transaction is on
    disk (the write-ahead log synced), so an acknowledged group survives a power loss or an OS
    crash. The sync is a group commit (`node.runtime.group_commit`): transactions committed while one
    sync runs share the next, so concurrent admissions need fewer than one sync each, and
    `admit(sync=False)` lets the admission gate take the next batch while its own commit is
    being synced (the caller then calls `sync()` before answering). "normal" never waits for
    the disk: a commit still survives the trainer process crashing or being killed (it is in
    the OS's page cache), but a power loss may roll back the last commits, i.e. lose groups
    whose workers were told they were admitted. It costs less CPU per batch
    (benchmarks/admission_throughput.py) and is the operator's call (TrainerConfig.ledger_sync);
    the default keeps the stronger promise.

    Raises (any write, with "full"): node.runtime.group_commit.WalSyncError when the log can't be
    synced; from then on the ledger refuses every write (restart the trainer).

    Reads (this connection) see a committed transaction before its sync ends, e.g. the next
    batch's duplicate check sees the groups of one whose receipt waits for the sync, as it must.
    A write made on what it read lands later in the same log, so a power cut loses it too, and
    its answer waits for its own sync; an answer that writes nothing (a validator's sample of
    admitted batches, a lease refused as busy) may show such a transaction for that long.
    """

    def __init__(self, path: Path, *, synchronous: Literal["full", "normal"] = "full") -> None:
        self._db = connect(path, SCHEMA, durable=True)
        self._db.execute("PRAGMA synchronous=NORMAL")   # "full": GroupCommit syncs what COMMIT wrote
        self._group = GroupCommit(path) if synchronous == "full" and str(path) != ":memory:" else None
        self._lock = threading.Lock()

    @contextmanager
    def _tx(self, *, sync: bool = True) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            ticket = self._group.committed() if self._group is not None else 0
        if sync and self._group is not None:
            self._group.wait(ticket)   # outside the lock: others commit meanwhile and share the next sync

    def sync(self) -> None:
        """Return once every transaction committed so far is on disk (with "full"; at once with
        "normal"). Raises node.runtime.group_commit.WalSyncError as the write methods do."""
        if self._group is not None:
            self._group.wait(self._group.last())

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        """Close the database connection; the ledger is unusable afterwards."""
        with self._lock:
            self._db.close()
            if self._group is not None:
                self._group.close()

    # ---- jobs
    def add_job(self, job_id: str, envelope: pb.Signed, created_ms: int) -> None:
        """Record a job's signed spec `envelope`, received at unix ms `created_ms` (no-op for a known job)."""
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO jobs VALUES (?, ?, ?)", (job_id, envelope.SerializeToString(), created_ms))

    def jobs(self) -> list[tuple[str, pb.Signed]]:
        """(job_id, signed spec envelope) of every recorded job, oldest first."""
        return [(j, pb.Signed.FromString(e)) for j, e in self._query("SELECT job_id, envelope FROM jobs ORDER BY created_ms")]

    # ---- leases
    def add_lease(self, lease: pb.Lease) -> None:
        """Record a newly issued lease as open.

        Raises sqlite3.IntegrityError if a lease with its `lease_id` is already recorded.
        """
        with self._tx() as db:
            db.execute(
                "INSERT INTO leases VALUES (?, ?, ?, ?, ?, 1)",
                (lease.lease_id, lease.job_id, lease.peer_id, lease.SerializeToString(), lease.deadline_ms),
            )

    def close_lease(self, lease_id: str) -> None:
        """Mark the lease answered or expired (no-op for an unknown lease id)."""
        with self._tx() as db:
            db.execute("UPDATE leases SET open = 0 WHERE lease_id = ?", (lease_id,))

    def leases(self, job_id: str, *, open_only: bool) -> list[pb.Lease]:
        """The job's recorded leases (unordered); with `open_only` only those not closed."""
        sql = "SELECT lease FROM leases WHERE job_id = ?" + (" AND open = 1" if open_only else "")
        return [pb.Lease.FromString(b) for (b,) in self._query(sql, (job_id,))]

    # ---- batches and groups
    def batch_seen(self, batch_id: str) -> bool:
        """True if a batch with this id was admitted before (replay protection)."""
        return bool(self._query("SELECT 1 FROM batches WHERE batch_id = ?", (batch_id,)))

    def admit(
        self, batch_id: str, batch: pb.RolloutBatch, envelope: pb.Signed, groups: Iterable[pb.Group], now_ms: int,
        *, close_lease: bool = False, rejections: Mapping[str, int] | None = None, sync: bool = True,
    ) -> int:
        """Durably record a batch and its admitted groups in one transaction; returns its seq.

        In the same transaction (one commit; one sync, shared with concurrent commits): the batch's rejected groups
        (`rejections`: reason -> count, as `reject` records them) and, with `close_lease`, the
        closing of the lease it answered. A group's recorded policy version is the oldest of its
        completions'. Raises sqlite3.IntegrityError (and records nothing) if the batch id was
        recorded before or a group's prompt index was already admitted for the job.

        sync=False returns once committed, before the commit is on disk: the caller must call
        `sync()` before telling anyone the groups were admitted.
        """
        with self._tx(sync=sync) as db:
            if rejections:
                db.executemany("INSERT INTO rejections (job_id, peer_id, reason, at_ms) VALUES (?,?,?,?)",
                               [(batch.job_id, batch.peer_id, r, now_ms) for r, n in rejections.items() for _ in range(n)])
            if close_lease:
                db.execute("UPDATE leases SET open = 0 WHERE lease_id = ?", (batch.lease_id,))
            cur = db.execute(
                "INSERT INTO batches (batch_id, job_id, peer_id, lease_id, received_ms, envelope) VALUES (?,?,?,?,?,?)",
                (batch_id, batch.job_id, batch.peer_id, batch.lease_id, now_ms, envelope.SerializeToString()),
            )
            seq = int(cur.lastrowid or 0)
            db.executemany(
                "INSERT INTO groups (batch_seq, job_id, lease_id, peer_id, prompt_index, policy_version, grp)"
                " VALUES (?,?,?,?,?,?,?)",
                [(seq, batch.job_id, batch.lease_id, batch.peer_id, g.prompt_index,
                  min(c.policy_version for c in g.completions), g.SerializeToString()) for g in groups],
            )
        return seq

    def admitted_among(self, job_id: str, indices: Iterable[int]) -> set[int]:
        """Those of `indices` admitted for the job (in any state): a lookup per index in the
        (job_id, prompt_index) unique index, not a scan of the job's groups."""
        wanted = list(indices)
        if not wanted:
            return set()
        marks = ",".join("?" * len(wanted))
        return {i for (i,) in self._query(
            f"SELECT prompt_index FROM groups WHERE job_id = ? AND prompt_index IN ({marks})", (job_id, *wanted))}

    def admitted_indices(self, job_id: str) -> set[int]:
        """Prompt indices of every group admitted for the job, in any state."""
        return {i for (i,) in self._query("SELECT prompt_index FROM groups WHERE job_id = ?", (job_id,))}

    # Pending groups a step may use when new peers are on probation: the peer has a passing verdict
    # in the job, the group's batch arrived at or before the cutoff (its hold is over), or the
    # group is at its last chance (its version at or below the step's staleness floor).
    _TRAINABLE = (
        "(b.received_ms <= ? OR g.policy_version <= ? OR EXISTS (SELECT 1 FROM verdicts v"
        " WHERE v.job_id = g.job_id AND v.peer_id = g.peer_id AND v.passed = 1))"
    )

    def pending(self, job_id: str, limit: int, *, hold: Probation | None = None) -> list[PendingGroup]:
        """The oldest `limit` pending groups. With `hold`, only the trainable ones: groups of peers
        without a passing verdict whose batch arrived after its cutoff, above its last-chance
        version, are held back."""
        where, args = self._pending_filter(job_id, hold)
        rows = self._query(
            f"SELECT g.id, g.peer_id, g.grp FROM groups g JOIN batches b ON b.seq = g.batch_seq WHERE {where}"
            " ORDER BY g.id LIMIT ?", (*args, limit),
        )
        return [PendingGroup(r, p, pb.Group.FromString(g)) for r, p, g in rows]

    def _pending_filter(self, job_id: str, hold: Probation | None) -> tuple[str, tuple[Any, ...]]:
        if hold is None:
            return "g.job_id = ? AND g.state = 'pending'", (job_id,)
        return (f"g.job_id = ? AND g.state = 'pending' AND {self._TRAINABLE}",
                (job_id, hold.held_after_ms, hold.last_chance_version))

    def drop_stale(self, job_id: str, min_version: int, note: str) -> int:
        """Drop pending groups generated before `min_version` (out of the staleness window)."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE groups SET state = 'dropped', note = ? WHERE job_id = ? AND state = 'pending'"
                " AND policy_version < ?",
                (note, job_id, min_version),
            )
            return cur.rowcount

    def count_pending(self, job_id: str, *, hold: Probation | None = None) -> int:
        """Pending groups of the job (with `hold`: the trainable ones, as `pending`)."""
        where, args = self._pending_filter(job_id, hold)
        return int(self._query(
            f"SELECT COUNT(*) FROM groups g JOIN batches b ON b.seq = g.batch_seq WHERE {where}", args)[0][0])

    def count_on_probation(self, job_id: str, hold: Probation) -> int:
        """Pending groups of the job that are not trainable yet (held by `hold`, their peer with no
        passing verdict): one query, so groups admitted meanwhile can't make it negative, as the
        difference of two counts could."""
        return int(self._query(
            "SELECT COUNT(*) FROM groups g JOIN batches b ON b.seq = g.batch_seq"
            f" WHERE g.job_id = ? AND g.state = 'pending' AND NOT {self._TRAINABLE}",
            (job_id, hold.held_after_ms, hold.last_chance_version))[0][0])

    def mark(self, row_ids: Iterable[int], state: str, *, step: int | None = None, note: str = "") -> None:
        """Set the state (e.g. "trained", "no_signal", "dropped") of the groups with ledger ids `row_ids`.

        step: the optimizer step that used them (None if none); note: why (e.g. a drop reason).
        """
        with self._tx() as db:
            db.executemany(
                "UPDATE groups SET state = ?, step = ?, note = ? WHERE id = ?", [(state, step, note, r) for r in row_ids]
            )

    def drop_peer(self, job_id: str, peer_id: str, note: str) -> int:
        """Drop a peer's not-yet-trained groups (a ban); returns how many."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE groups SET state = 'dropped', note = ? WHERE job_id = ? AND peer_id = ? AND state = 'pending'",
                (note, job_id, peer_id),
            )
            return cur.rowcount

    def group_counts(self, job_id: str) -> Counter[str]:
        """Group state ("pending", "trained", "no_signal", "dropped") -> number of the job's admitted groups."""
        rows = self._query("SELECT state, COUNT(*) FROM groups WHERE job_id = ? GROUP BY state", (job_id,))
        return Counter({s: n for s, n in rows})

    def batches_after(self, job_id: str, after_seq: int, limit: int) -> list[tuple[int, str, pb.Signed]]:
        """Up to `limit` of the job's admitted batches with seq > `after_seq`, ascending, those
        cleared by `compact` left out.

        Each as (seq, lease_id, signed RolloutBatch envelope as received); for SampleAdmitted.
        """
        rows = self._query(
            "SELECT seq, lease_id, envelope FROM batches WHERE job_id = ? AND seq > ? AND length(envelope) > 0"
            " ORDER BY seq LIMIT ?",
            (job_id, after_seq, limit),
        )
        return [(s, lease_id, pb.Signed.FromString(e)) for s, lease_id, e in rows]

    def batch_group_indices(self, seq: int) -> list[int]:
        """Prompt indices of the groups admitted from batch `seq`, in admission order."""
        return [i for (i,) in self._query("SELECT prompt_index FROM groups WHERE batch_seq = ? ORDER BY id", (seq,))]

    def lease(self, lease_id: str) -> pb.Lease | None:
        """The recorded lease `lease_id` (open or closed), or None if unknown."""
        rows = self._query("SELECT lease FROM leases WHERE lease_id = ?", (lease_id,))
        return pb.Lease.FromString(rows[0][0]) if rows else None

    def compact(self, job_id: str, before_ms: int, *, limit: int = COMPACT_BATCHES) -> tuple[int, int]:
        """Clear the token payloads of the job's finished batches received before unix ms
        `before_ms` (the oldest `limit` of them: one call holds the ledger's lock briefly, a
        backlog, e.g. an old ledger's first compaction, drains over calls), then delete its
        closed leases whose deadline is before it and that no whole batch names; one
        transaction. Returns (batches cleared, leases deleted).

        A batch is finished when none of its groups is pending: a pending group (not trained or
        dropped yet) keeps its batch whole, so no admitted rollout is lost. Replay protection
        stays exact: batch ids and admitted prompt indices stay, and a batch naming a deleted
        lease is refused (`unknown_lease`) as it was before (`lease_expired`: its deadline is
        past). Cleared batches are no longer offered to validators (`batches_after`).
        """
        with self._tx() as db:
            seqs = [s for (s,) in db.execute(
                "SELECT seq FROM batches b WHERE job_id = ? AND length(envelope) > 0 AND received_ms < ?"
                " AND NOT EXISTS (SELECT 1 FROM groups g WHERE g.batch_seq = b.seq AND g.state = 'pending')"
                " ORDER BY received_ms LIMIT ?", (job_id, before_ms, limit))]
            self._clear(db, "groups", "grp", "batch_seq", seqs)
            self._clear(db, "batches", "envelope", "seq", seqs)
            cur = db.execute(
                "DELETE FROM leases WHERE job_id = ? AND open = 0 AND deadline_ms < ? AND NOT EXISTS"
                " (SELECT 1 FROM batches b WHERE b.lease_id = leases.lease_id AND length(b.envelope) > 0)",
                (job_id, before_ms))
            return len(seqs), cur.rowcount

    @staticmethod
    def _clear(db: sqlite3.Connection, table: str, blob: str, key: str, values: list[int]) -> None:
        """Rewrite the rows of `table` whose `key` is in `values` with an empty `blob`, as a delete
        and an insert of the same row: SQLite merges the leaf pages a delete leaves underfull,
        where an UPDATE that shrinks a row in place leaves them near empty (a cleared group kept
        its own 4 KiB page: benchmarks/long_run_memory.py)."""
        cols = [c for (_, c, *_) in db.execute(f"PRAGMA table_info({table})")]
        kept = ", ".join(c for c in cols if c != blob)
        rows = [r for v in values for r in db.execute(f"SELECT {kept} FROM {table} WHERE {key} = ?", (v,))]
        db.executemany(f"DELETE FROM {table} WHERE {key} = ?", [(v,) for v in values])
        db.executemany(f"INSERT INTO {table} ({kept}, {blob}) VALUES ({', '.join('?' * (len(cols)))})",
                       [(*r, b"") for r in rows])

    def stored_bytes(self, job_id: str) -> dict[str, int]:
        """Rows and payload bytes the job holds: {"batches", "batch_bytes", "groups", "group_bytes",
        "leases", "lease_bytes"}, and "db_bytes": the whole database's pages (every job), for
        bounds checks and measurements."""
        ((pages,),), ((size,),) = self._query("PRAGMA page_count"), self._query("PRAGMA page_size")
        out = {"db_bytes": int(pages) * int(size)}
        for table, blob, key in (("batches", "envelope", "batch_bytes"), ("groups", "grp", "group_bytes"),
                                 ("leases", "lease", "lease_bytes")):
            n, size = self._query(f"SELECT COUNT(*), COALESCE(SUM(length({blob})), 0) FROM {table} WHERE job_id = ?",
                                  (job_id,))[0]
            out[table], out[key] = int(n), int(size)
        return out

    # ---- steps
    def record_step(self, job_id: str, step: int, metrics: dict[str, Any]) -> None:
        """Store step `step`'s metrics (replaces an earlier row for the same step).

        Raises TypeError if `metrics` is not JSON-serializable.
        """
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO steps VALUES (?, ?, ?)", (job_id, step, json.dumps(metrics)))

    def steps(self, job_id: str) -> list[dict[str, Any]]:
        """Every recorded step's metrics dict for the job, by step ascending."""
        return [json.loads(m) for (m,) in self._query("SELECT metrics FROM steps WHERE job_id = ? ORDER BY step", (job_id,))]

    def lease_exposed(self, lease_id: str) -> bool:
        """True once a batch answering the lease was recorded (SampleAdmitted then shows the lease)."""
        return bool(self._query("SELECT 1 FROM batches WHERE lease_id = ? LIMIT 1", (lease_id,)))
