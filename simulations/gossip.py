"""Delta gossip on the simulated network: who fetches each version from whom, and when.

The rule is the product's (`protocol/delta_sources.py`): a joining worker takes one snapshot
(from a peer holding one within `max_gap`, else its trainer) and deltas from there; a running
worker notices a new version at its next sync poll and asks the announced holders in random order,
waiting a random share of `peer_wait_s` for one to appear before it asks the trainer. Peers behind
NAT accept no inbound stream, so they never announce and are never a source.

Granularity: a version's spread over all live workers is computed when it is published, in order
of the workers' decision times with a heap of pending announcements (no SimPy event per fetch).
A holder that left is skipped, as a failed dial would be.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from swarmrl.protocol import delta_sources
from swarmrl.simulations.network import Uplink, transfer_end
from swarmrl.simulations.population import Worker
from swarmrl.simulations.scenario import Gossip

_PICK_TRIES = 6


@dataclass(frozen=True)
class SimHolder:
    """A holder record as delta_sources sees it."""

    holder_id: str
    signer: str
    worker: Worker
    since: float


@dataclass
class VersionSpread:
    """What one version's spread cost and how fast it reached the live workers."""

    version: int
    published_s: float
    live: int
    reach_s: dict[str, float] = field(default_factory=dict)   # "50"/"95"/"99" -> seconds after publish
    trainer_bytes: int = 0
    peer_bytes: int = 0


class DeltaSpread:
    """Per-version holders and the time each worker holds each version."""

    def __init__(self, cfg: Gossip, delta_bytes: int, snapshot_bytes: int, announce_s: float, seed: int,
                 trainer_uplink: Callable[[Worker], Uplink], signer: str = "trainer") -> None:
        self.cfg, self.delta_bytes, self.snapshot_bytes, self.announce_s = cfg, delta_bytes, snapshot_bytes, announce_s
        self.rng = random.Random(f"gossip/{seed}")
        self.trainer_uplink, self.signer = trainer_uplink, signer
        self.held: dict[int, dict[int, float]] = {0: {}}    # version -> worker idx -> when held
        self.holders: dict[int, list[SimHolder]] = {0: []}  # version -> reachable holders (delta or snapshot)
        self.snapshots: dict[int, list[SimHolder]] = {}      # version -> reachable snapshot holders
        self.published: dict[int, float] = {0: 0.0}
        self.version = 0
        self.spreads: list[VersionSpread] = []
        self.trainer_bytes = 0
        self.peer_bytes = 0
        self._served = 0                                     # trainer fetches of the version being spread
        self.sources_chosen: list[Worker] = []               # peers ever chosen as a source (tests read it)

    # ---- queries
    def held_at(self, w: Worker, version: int) -> float:
        """When `w` holds `version` (0.0 when the version is older than what we keep: it holds it)."""
        got = self.held.get(version)
        if got is None:
            return 0.0
        return got.get(w.idx, math.inf)

    # ---- sources
    def _pick(self, found: list[SimHolder], me: Worker, at: float) -> Worker | None:
        """The first of delta_sources.ask_order over the live, announced candidates. Past 64
        records: a few uniform draws instead (the same distribution as the first of a shuffle,
        without shuffling thousands of records per fetch)."""
        if len(found) <= 64:
            live = [h for h in found if h.since <= at and h.worker.alive and h.worker.leaves_s > at]
            cands = delta_sources.candidates(live, me=me.peer_id, dropped=(), signers={self.signer})
            return delta_sources.ask_order(cands, self.rng)[0].worker if cands else None
        for _ in range(_PICK_TRIES):
            h = found[self.rng.randrange(len(found))]
            if h.holder_id != me.peer_id and h.worker.alive and h.since <= at and h.worker.leaves_s > at:
                return h.worker
        return None

    def _fetch(self, w: Worker, src: Worker | None, size: int, start: float) -> float:
        up = src.uplink if src is not None else self.trainer_uplink(w)
        end = transfer_end(up, w.region, w.down_bps, size, start)
        if src is None:
            self.trainer_bytes += size
        else:
            self.peer_bytes += size
            self.sources_chosen.append(src)
        return end

    def _hold(self, w: Worker, version: int, at: float) -> None:
        self.held.setdefault(version, {})[w.idx] = at
        if w.reachable and at < w.leaves_s:
            self.holders.setdefault(version, []).append(
                SimHolder(w.peer_id, self.signer, w, at + self.announce_s))

    # ---- a worker joins: snapshot, then deltas
    def join(self, w: Worker, now: float) -> float:
        """Catch a new worker up to the current version; returns when it holds it."""
        want = self.version
        assert delta_sources.needs_snapshot(-1, want, self.cfg.max_gap)
        t, snap_v, src = now, want, None
        for v in range(want, max(-1, want - self.cfg.max_gap - 1), -1):   # the newest within max_gap
            src = self._pick(self.snapshots.get(v, []), w, now)
            if src is not None:
                snap_v = v
                break
        t = self._fetch(w, src, self.snapshot_bytes, t)
        w.snapshot_version = snap_v
        self._hold(w, snap_v, t)
        if w.reachable and t < w.leaves_s:
            self.snapshots.setdefault(snap_v, []).append(SimHolder(w.peer_id, self.signer, w, t + self.announce_s))
        for v in range(snap_v + 1, want + 1):
            src = self._pick(self.holders.get(v, []), w, t)
            t = self._fetch(w, src, self.delta_bytes, t)
            self._hold(w, v, t)
        return t

    # ---- a version is published: every live worker fetches it
    def publish(self, version: int, now: float, live: list[Worker]) -> VersionSpread:
        """Spread `version` (published at `now`) over the `live` workers; returns its figures."""
        self.version, self.published[version] = version, now
        self.held.setdefault(version, {})
        self.holders.setdefault(version, [])
        tb, pb_ = self.trainer_bytes, self.peer_bytes
        prev = self.held.get(version - 1, {})
        self._served = 0
        poll = self.cfg.sync_poll_s * 1.5
        decisions = sorted((max(prev.get(w.idx, now), now + self.rng.uniform(0, poll)), w.idx, w)
                           for w in live if w.idx in prev)
        pending: list[tuple[float, int, SimHolder]] = []
        found: list[SimHolder] = self.holders[version]
        for at, _, w in decisions:
            at, src = self._decide(w, at, pending, found)
            end = self._fetch(w, src, self.delta_bytes, at)
            self.held[version][w.idx] = end
            if w.reachable and end < w.leaves_s:
                heapq.heappush(pending, (end + self.announce_s, w.idx, SimHolder(w.peer_id, self.signer, w,
                                                                                  end + self.announce_s)))
        found.extend(h for _, _, h in sorted(pending))
        spread = VersionSpread(version, now, len(decisions), trainer_bytes=self.trainer_bytes - tb,
                               peer_bytes=self.peer_bytes - pb_)
        spread.reach_s = _reach([self.held[version][w.idx] - now for _, _, w in decisions if
                                 self.held[version][w.idx] < w.leaves_s], len(decisions))
        self.spreads.append(spread)
        self._forget(version)
        return spread

    def _decide(self, w: Worker, at: float, pending: list[tuple[float, int, SimHolder]], found: list[SimHolder]) -> tuple[float, Worker | None]:
        """When `w` starts its fetch and from whom: an announced holder now, else the first one to
        announce within its random wait, else the trainer when the wait ends."""
        while pending and pending[0][0] <= at:
            found.append(heapq.heappop(pending)[2])
        src = self._pick(found, w, at)
        if src is not None:
            return at, src
        deadline = at + delta_sources.holder_wait_s(self.cfg.peer_wait_s, self.rng)
        if self.cfg.trainer_fanout and self._served >= self.cfg.trainer_fanout and pending:
            deadline = math.inf   # what-if: the trainer refuses; wait for the next peer to announce
        while pending and pending[0][0] <= deadline:
            h = heapq.heappop(pending)[2]
            found.append(h)
            if h.worker.alive and h.worker.leaves_s > h.since:
                return max(at, h.since), h.worker
        self._served += 1
        return max(at, deadline if math.isfinite(deadline) else at), None

    def _forget(self, version: int) -> None:
        old = version - self.cfg.max_gap - 2
        if old > 0:
            self.held.pop(old, None)
            self.holders.pop(old, None)
            self.snapshots.pop(old, None)


def _reach(delays: list[float], live: int) -> dict[str, float]:
    """Seconds after publishing until 50/95/99% of the `live` workers held the version (inf: never)."""
    delays = sorted(delays)
    out = {}
    for q in (50, 95, 99):
        k = math.ceil(q / 100 * live) - 1
        out[str(q)] = delays[k] if 0 <= k < len(delays) else math.inf
    return out
