"""A trainer's admitted groups waiting for a step, with an index of the trainable ones.

The rule is the trainer's probation (`JobRuntime.trainable_cutoff` and the ledger's pending
query): a pending group may be trained once its peer has a passing verdict (`passed_s` <= now),
once it is `probation_s` old, or (with `last_chance`, the product's rule) at the last step that
may still train it: its version at the step's floor (`version - max_async_level`), so probation
never makes a group stale. The simulator asks "is a full batch trainable?" several times a
second per trainer, so instead of scanning every pending group on each ask, the pool keeps a
count of the trainable ones and promotes the others when they age out (a FIFO: groups arrive in
time order) or when their peer's passing verdict comes due (a heap of the verdicts' times,
`passed`). Removals (a step, stale drops, bans) mark groups gone; the queues drop them lazily.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from swarmrl.simulations.population import Worker


@dataclass(eq=False)
class Pending:
    """An admitted group waiting for a step."""

    peer: Worker
    version: int
    admitted_s: float
    trainable: bool = False
    gone: bool = False


class PendingPool:
    """The pending groups of one trainer, oldest first, and how many are trainable."""

    def __init__(self, probation_s: float, last_chance: bool = True) -> None:
        self.probation_s, self.last_chance = probation_s, last_chance
        self._groups: deque[Pending] = deque()
        self._trainable = 0
        self._held: deque[Pending] = deque()              # on probation, oldest first (lazy: gone/trainable skipped)
        self._held_of: dict[Worker, deque[Pending]] = {}  # the same, by peer
        self._passes: list[tuple[float, int, Worker]] = []  # (passed_s, seq, peer): verdicts coming due
        self._by_version: list[tuple[int, int, Pending]] = []  # (version, seq, group) on probation: last chances
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[Pending]:
        return iter(self._groups)

    def add(self, groups: list[Pending], now_s: float) -> None:
        """Admitted `groups` (admitted at `now_s`, s) join the pool."""
        for p in groups:
            self._groups.append(p)
            if self.probation_s <= 0 or p.peer.passed_s <= now_s:
                p.trainable = True
                self._trainable += 1
            else:
                self._held.append(p)
                self._held_of.setdefault(p.peer, deque()).append(p)
                if self.last_chance:
                    heapq.heappush(self._by_version, (p.version, next(self._seq), p))

    def passed(self, w: Worker) -> None:
        """A validator passed `w` (its `passed_s`, maybe still ahead): its held groups become
        trainable then (groups it sends before then included)."""
        heapq.heappush(self._passes, (w.passed_s, next(self._seq), w))

    def trainable(self, now_s: float, floor: int | None = None) -> int:
        """How many pending groups may be trained at `now_s` (s) by a step whose staleness floor
        is `floor` (groups of that version are at their last chance; None: no last chance)."""
        self._promote(now_s, floor)
        return self._trainable

    def _promote(self, now_s: float, floor: int | None) -> None:
        while floor is not None and self._by_version and self._by_version[0][0] <= floor:
            self._mark_trainable(heapq.heappop(self._by_version)[2])
        while self._passes and self._passes[0][0] <= now_s:
            _, _, w = heapq.heappop(self._passes)
            for p in self._held_of.pop(w, ()):
                self._mark_trainable(p)
        cutoff = now_s - self.probation_s
        while self._held and (self._held[0].trainable or self._held[0].gone or self._held[0].admitted_s <= cutoff):
            p = self._held.popleft()
            self._mark_trainable(p)
            mine = self._held_of.get(p.peer)
            while mine and (mine[0].trainable or mine[0].gone):
                mine.popleft()
            if mine is not None and not mine:
                del self._held_of[p.peer]

    def _mark_trainable(self, p: Pending) -> None:
        if not p.trainable and not p.gone:
            p.trainable = True
            self._trainable += 1

    def take(self, n: int, now_s: float, floor: int | None = None) -> list[Pending]:
        """The oldest `n` trainable groups (fewer if there are not as many), off the pool (`floor`
        as in `trainable`)."""
        self._promote(now_s, floor)
        out: list[Pending] = []
        for p in self._groups:
            if p.trainable:
                out.append(p)
                if len(out) == n:
                    break
        self._remove(out)
        return out

    def drop(self, doomed: Callable[[Pending], bool]) -> int:
        """Drop the groups `doomed` says to (stale, or of a banned peer); returns how many."""
        return self._remove([p for p in self._groups if doomed(p)])

    def clear(self) -> int:
        """Drop every group (the trainer died); returns how many."""
        return self._remove(list(self._groups))

    def _remove(self, groups: list[Pending]) -> int:
        if not groups:
            return 0
        for p in groups:
            p.gone = True
            self._trainable -= p.trainable
        self._groups = deque(p for p in self._groups if not p.gone)
        return len(groups)
