"""Work leases: which prompt indices a worker must answer, with which policy version, by when.

Prompt indices are handed out in order (0, 1, 2, ...) so a worker can't pick easy prompts; the
prompt itself is derived from (job seed, index). A lease that expires before its groups are
admitted returns its missing indices to the front of the queue. Several trainers of one job hand
out disjoint indices: trainer `rank` of `count` hands out rank, rank + count, rank + 2*count, ...

Bounded for a job that runs for days: the book holds its open leases (and their answered
indices), the re-queued indices, and the admitted indices above the admitted prefix (every index
of the shard below `admitted_below` was admitted; only those above it are kept one by one, so
the set is the frontier of leases answered out of order, not the job's history). A closed
lease is forgotten at once: whether a batch may still answer it is the caller's ledger and the
lease's deadline (`protocol.admission.check_batch_envelope`), never this book.

Pure (no network, no clock of its own: every time is a `now_ms` argument), so the trainer
(`node/trainer/admission.py`) and the simulator (`simulations/trainer.py`) run the same book.
Deadlines and expiry follow the clock of `now_ms`, which the trainer makes a monotonic one: a
wall clock stepped back or forward by an hour neither holds an expired lease's prompts for an
hour nor expires every open lease at once. A lease on the wire still carries wall-clock
`issued_ms` / `deadline_ms` (`wall_ms`), for people and for the ledger across restarts.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from swarmrl.protocol.pb import swarm_pb2 as pb

BACKLOG_BATCHES = 2  # the simulator's backlog_full: "busy" while this many batches of groups are pending
BUSY_RETRY_MS = 1000  # the retry hint of a "busy" refusal
EXPIRED_KEPT = 50_000  # ids of the leases expired last, remembered so a late batch reads lease_expired
MAX_SKIPS = 64  # new indices one lease may pass over (`LeaseBook.issue`'s `skip`)


def backlog_full(pending_groups: int, batch_groups: int, *, open_prompts: int = 0,
                 batches: int = BACKLOG_BATCHES) -> bool:
    """True when a trainer should refuse new leases ("busy"): `pending_groups` admitted and not
    trained yet, plus `open_prompts` still out on open leases (one group each), fill `batches`
    batches of `batch_groups` groups. The simulator's rule (its what-if passes
    `LeaseBook.open_prompts()`: in simulations/README.md ("Defaults") that cuts stale rollouts
    from ~76% to ~27% but trains ~27% fewer groups per hour). The trainer no longer uses it: it
    leases at most its open capacity (`protocol.demand.open_capacity`: a window of
    `(max_async_level + 1)` batches of `batch_max`, open leases counted), as the simulator
    does by default (`job.lease_rule = "capacity"`; "pending" runs this rule)."""
    return pending_groups + open_prompts >= batches * batch_groups


def _random_lease_id() -> str:
    """12 random bytes as 24 hex characters."""
    return secrets.token_hex(12)


class LeaseBook:
    """The leases of one job (thread-safe). Persisted by the caller through the ledger."""

    def __init__(self, job_id: str, *, ttl_ms: int, next_index: int = 0, shard: tuple[int, int] = (0, 1),
                 new_lease_id: Callable[[], str] | None = None) -> None:
        """`new_lease_id` makes each lease's id (default: 12 random bytes as hex, unguessable by
        workers; the simulator passes a counter, reproducible and cheaper). Raises ValueError
        unless 0 <= rank < count."""
        rank, count = shard
        if count < 1 or not 0 <= rank < count:
            raise ValueError(f"prompt shard {shard} is not (rank, count) with 0 <= rank < count")
        self.job_id = job_id
        self.ttl_ms = ttl_ms
        self.rank, self.count = rank, count
        self._next_index = max(next_index, rank)
        self._requeued: deque[int] = deque()
        self._admitted_below = self.rank   # every shard index below it was admitted (never re-issued)
        self._admitted: set[int] = set()  # indices >= _admitted_below answered under any lease
        self._open: dict[str, pb.Lease] = {}
        self._answered: dict[str, set[int]] = {}   # open lease id -> its indices admitted so far
        self._unanswered = 0  # prompts of open leases not answered yet (open_prompts)
        self._of_peer: dict[str, dict[str, None]] = {}   # peer id -> its open lease ids, in issue order (open_of)
        self._deadlines: list[tuple[int, int, str]] = []  # (deadline_ms, seq, lease id) of leases issued (expire)
        self._deadline_of: dict[str, int] = {}   # open lease id -> its deadline on the book's clock
        self._expired: OrderedDict[str, None] = OrderedDict()   # the last EXPIRED_KEPT expired ids
        self._seq = itertools.count()
        self._new_lease_id = new_lease_id or _random_lease_id
        self._lock = threading.Lock()

    def restore(self, leases: list[pb.Lease], admitted: set[int], *, now_ms: int | None = None,
                wall_ms: int | None = None) -> None:
        """Rebuild state after a restart from the ledger's open leases and admitted indices.

        With `now_ms` (the book's clock) and `wall_ms` (the wall clock, that of the leases'
        `deadline_ms`), each lease keeps what was left of its time, at most one TTL (a wall clock
        set back can't stretch a lease); without them the leases' deadlines are on the book's clock.
        """
        with self._lock:
            self._admit(admitted)
            for lease in leases:
                if now_ms is None or wall_ms is None:
                    self._add(lease, lease.deadline_ms)
                else:
                    self._add(lease, now_ms + min(max(lease.deadline_ms - wall_ms, 0), self.ttl_ms))
                self._answered[lease.lease_id] = {i for i in lease.prompt_indices if i in admitted}
                self._unanswered += len(set(lease.prompt_indices)) - len(self._answered[lease.lease_id])
            seen = {i for i in admitted | {i for lease in leases for i in lease.prompt_indices}
                    if i % self.count == self.rank}
            self._next_index = max(seen, default=self.rank - self.count) + self.count
            self._requeued.extend(sorted(set(range(self.rank, self._next_index, self.count)) - seen))

    def issue(self, peer_id: str, n: int, version: int, sampling: pb.SamplingParams, now_ms: int, *,
              wall_ms: int | None = None, skip: Callable[[int], bool] | None = None) -> pb.Lease:
        """A new lease of `n` prompt indices (re-queued ones first), due `ttl_ms` after `now_ms` on
        the book's clock. Its `issued_ms` / `deadline_ms` fields are on the wall clock `wall_ms`
        (default: the book's clock, as in the simulator). `skip(index)`: a new index it returns
        True for is passed over for good (`protocol.prompt_signal`; at most `MAX_SKIPS` a lease,
        then indices are taken as they come); re-queued indices are never skipped."""
        with self._lock:
            indices: list[int] = []
            while self._requeued and len(indices) < n:
                index = self._requeued.popleft()
                if not self._is_admitted(index):  # a revoked/expired lease may still have been answered
                    indices.append(index)
            skips = 0
            while len(indices) < n:
                index = self._next_index
                self._next_index += self.count
                if skip is not None and skips < MAX_SKIPS and skip(index):
                    skips += 1
                    self._admit([index])   # consumed: the admitted prefix moves past it
                    continue
                indices.append(index)
            lease = pb.Lease(
                lease_id=self._new_lease_id(), job_id=self.job_id, peer_id=peer_id, prompt_indices=indices,
                policy_version=version, sampling=sampling, issued_ms=now_ms if wall_ms is None else wall_ms,
            )
            lease.deadline_ms = lease.issued_ms + self.ttl_ms
            self._add(lease, now_ms + self.ttl_ms)
            self._answered[lease.lease_id] = set()
            self._unanswered += len(set(indices))
            return lease

    def _is_admitted(self, index: int) -> bool:
        """Whether `index` was admitted under any lease (caller holds the lock)."""
        return index < self._admitted_below or index in self._admitted

    def _admit(self, indices: Iterable[int]) -> None:
        """Mark `indices` admitted, then fold the admitted prefix into `_admitted_below` (caller
        holds the lock)."""
        self._admitted.update(i for i in indices if i >= self._admitted_below and i % self.count == self.rank)
        while self._admitted_below in self._admitted:
            self._admitted.remove(self._admitted_below)
            self._admitted_below += self.count

    def admitted_below(self) -> int:
        """The admitted prefix: every index of this book's shard below it was admitted."""
        with self._lock:
            return self._admitted_below

    def held(self) -> dict[str, int]:
        """Sizes of what the book holds (open leases, answered-index entries, admitted indices
        kept one by one, re-queued indices, deadline heap), for bounds checks and metrics."""
        with self._lock:
            return {"open": len(self._open), "answered": len(self._answered), "admitted": len(self._admitted),
                    "requeued": len(self._requeued), "deadlines": len(self._deadlines), "peers": len(self._of_peer),
                    "expired": len(self._expired)}

    def _add(self, lease: pb.Lease, deadline_ms: int) -> None:
        """Open `lease`, due at `deadline_ms` on the book's clock, and index it by peer and
        deadline (caller holds the lock)."""
        self._open[lease.lease_id] = lease
        self._of_peer.setdefault(lease.peer_id, {})[lease.lease_id] = None
        self._deadline_of[lease.lease_id] = deadline_ms
        heapq.heappush(self._deadlines, (deadline_ms, next(self._seq), lease.lease_id))

    def deadline_of(self, lease_id: str) -> int | None:
        """The open lease's deadline on the book's clock, or None if it is not open."""
        with self._lock:
            return self._deadline_of.get(lease_id)

    def expired_recently(self, lease_id: str) -> bool:
        """Whether this book expired `lease_id` (one of the last `EXPIRED_KEPT` it expired)."""
        with self._lock:
            return lease_id in self._expired

    def get(self, lease_id: str) -> pb.Lease | None:
        """The open lease `lease_id`, or None (unknown, expired, revoked or fully answered)."""
        with self._lock:
            return self._open.get(lease_id)

    def answered(self, lease_id: str) -> set[int]:
        """The prompt indices admitted so far under open lease `lease_id` (empty once it closed)."""
        with self._lock:
            return set(self._answered.get(lease_id, ()))

    def record_answers(self, lease_id: str, indices: list[int]) -> bool:
        """Mark indices admitted (under lease `lease_id`, open or already closed); returns True
        when the lease is now fully answered (and closed)."""
        with self._lock:
            self._admit(indices)
            lease = self._open.get(lease_id)
            if lease is None:
                return False
            done = self._answered[lease_id]
            self._unanswered -= len(set(indices).intersection(lease.prompt_indices) - done)
            done.update(indices)
            if done >= set(lease.prompt_indices):
                self._forget(lease)
                return True
            return False

    def open_prompts(self) -> int:
        """How many prompts of open leases are not answered yet (groups still to come back)."""
        with self._lock:
            return self._unanswered

    def expire(self, now_ms: int) -> list[str]:
        """Close leases past their deadline, re-queue their unanswered indices; returns their ids
        (earliest deadline first). Reads a heap of deadlines, so its cost is the leases it closes
        (and those closed since the last call), not the open ones."""
        with self._lock:
            expired = []
            while self._deadlines and now_ms > self._deadlines[0][0]:
                _, _, lid = heapq.heappop(self._deadlines)
                if lid in self._open:   # else answered in full or revoked already
                    expired.append(lid)
                    self._close(lid)
                    self._expired[lid] = None
                    if len(self._expired) > EXPIRED_KEPT:
                        self._expired.popitem(last=False)
            return expired

    def _forget(self, lease: pb.Lease) -> set[int]:
        """Drop `lease` from the open leases, its answered indices and the peer index; returns
        its answered indices (caller holds the lock; its deadline stays on the heap until
        `expire` passes it)."""
        del self._open[lease.lease_id]
        del self._deadline_of[lease.lease_id]
        answered = self._answered.pop(lease.lease_id)
        mine = self._of_peer[lease.peer_id]
        del mine[lease.lease_id]
        if not mine:
            del self._of_peer[lease.peer_id]
        return answered

    def _close(self, lease_id: str) -> None:
        """Drop open lease `lease_id` and re-queue its unanswered indices (caller holds the lock)."""
        lease = self._open[lease_id]
        answered = self._forget(lease)
        missing = [i for i in lease.prompt_indices if i not in answered]
        self._unanswered -= len(set(missing))
        self._requeued.extendleft(reversed(missing))

    def revoke(self, lease_ids: list[str]) -> list[str]:
        """Close open leases now (their answers were provably bad, or the holder was banned),
        re-queue their unanswered indices; returns the ids that were open."""
        with self._lock:
            closed = [lid for lid in lease_ids if lid in self._open]
            for lid in closed:
                self._close(lid)
            return closed

    def open_of(self, peer_id: str) -> list[str]:
        """Ids of the peer's open leases, in the order they were issued."""
        with self._lock:
            return list(self._of_peer.get(peer_id, ()))
