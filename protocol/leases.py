"""Work leases: which prompt indices a worker must answer, with which policy version, by when.

Prompt indices are handed out in order (0, 1, 2, ...) so a worker can't pick easy prompts; the
prompt itself is derived from (job seed, index). A lease that expires before its groups are
admitted returns its missing indices to the front of the queue. Several trainers of one job hand
out disjoint indices: trainer `rank` of `count` hands out rank, rank + count, rank + 2*count, ...

Pure (no network, no clock of its own: every time is a `now_ms` argument), so the trainer
(`node/trainer/admission.py`) and the simulator (`simulations/trainer.py`) run the same book.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque

from swarmrl.protocol.pb import swarm_pb2 as pb

BACKLOG_BATCHES = 2  # leases are refused ("busy") while this many batches of groups are pending
BUSY_RETRY_MS = 1000  # the retry hint of a "busy" refusal


class LeaseBook:
    """The leases of one job (thread-safe). Persisted by the caller through the ledger."""

    def __init__(self, job_id: str, *, ttl_ms: int, next_index: int = 0, shard: tuple[int, int] = (0, 1)) -> None:
        rank, count = shard
        if count < 1 or not 0 <= rank < count:
            raise ValueError(f"prompt shard {shard} is not (rank, count) with 0 <= rank < count")
        self.job_id = job_id
        self.ttl_ms = ttl_ms
        self.rank, self.count = rank, count
        self._next_index = max(next_index, rank)
        self._requeued: deque[int] = deque()
        self._admitted: set[int] = set()  # indices answered under any lease (never re-issued)
        self._open: dict[str, pb.Lease] = {}
        self._answered: dict[str, set[int]] = {}
        self._lock = threading.Lock()

    def restore(self, leases: list[pb.Lease], admitted: set[int]) -> None:
        """Rebuild state after a restart from the ledger's open leases and admitted indices."""
        with self._lock:
            self._admitted |= admitted
            for lease in leases:
                self._open[lease.lease_id] = lease
                self._answered[lease.lease_id] = {i for i in lease.prompt_indices if i in admitted}
            seen = {i for i in admitted | {i for lease in leases for i in lease.prompt_indices}
                    if i % self.count == self.rank}
            self._next_index = max(seen, default=self.rank - self.count) + self.count
            self._requeued.extend(sorted(set(range(self.rank, self._next_index, self.count)) - seen))

    def issue(self, peer_id: str, n: int, version: int, sampling: pb.SamplingParams, now_ms: int) -> pb.Lease:
        """A new lease of `n` prompt indices (re-queued ones first)."""
        with self._lock:
            indices: list[int] = []
            while self._requeued and len(indices) < n:
                index = self._requeued.popleft()
                if index not in self._admitted:  # a revoked/expired lease may still have been answered
                    indices.append(index)
            while len(indices) < n:
                indices.append(self._next_index)
                self._next_index += self.count
            lease = pb.Lease(
                lease_id=secrets.token_hex(12), job_id=self.job_id, peer_id=peer_id, prompt_indices=indices,
                policy_version=version, sampling=sampling, issued_ms=now_ms, deadline_ms=now_ms + self.ttl_ms,
            )
            self._open[lease.lease_id] = lease
            self._answered[lease.lease_id] = set()
            return lease

    def get(self, lease_id: str) -> pb.Lease | None:
        """The open lease `lease_id`, or None (unknown, expired, revoked or fully answered)."""
        with self._lock:
            return self._open.get(lease_id)

    def answered(self, lease_id: str) -> set[int]:
        """The prompt indices admitted so far under lease `lease_id`."""
        with self._lock:
            return set(self._answered.get(lease_id, ()))

    def record_answers(self, lease_id: str, indices: list[int]) -> bool:
        """Mark indices admitted; returns True when the lease is now fully answered (and closed)."""
        with self._lock:
            done = self._answered.setdefault(lease_id, set())
            done.update(indices)
            self._admitted.update(indices)
            lease = self._open.get(lease_id)
            if lease is not None and done >= set(lease.prompt_indices):
                del self._open[lease_id]
                return True
            return False

    def expire(self, now_ms: int) -> list[str]:
        """Close leases past their deadline, re-queue their unanswered indices; returns their ids."""
        with self._lock:
            expired = [lid for lid, lease in self._open.items() if now_ms > lease.deadline_ms]
            for lid in expired:
                lease = self._open.pop(lid)
                missing = [i for i in lease.prompt_indices if i not in self._answered.get(lid, set())]
                self._requeued.extendleft(reversed(missing))
            return expired

    def revoke(self, lease_ids: list[str]) -> list[str]:
        """Close open leases now (their answers were provably bad, or the holder was banned),
        re-queue their unanswered indices; returns the ids that were open."""
        with self._lock:
            closed = [lid for lid in lease_ids if lid in self._open]
            for lid in closed:
                lease = self._open.pop(lid)
                missing = [i for i in lease.prompt_indices if i not in self._answered.get(lid, set())]
                self._requeued.extendleft(reversed(missing))
            return closed

    def open_of(self, peer_id: str) -> list[str]:
        """Ids of the peer's open leases."""
        with self._lock:
            return [lid for lid, lease in self._open.items() if lease.peer_id == peer_id]
