"""Delta gossip on the simulated network: who fetches each version from whom, and when.

The rule is the product's (`protocol/delta_sources.py`, `protocol/snapshot_sources.py`): a joining
worker takes one snapshot (the nearest a peer holds within `max_gap`, else its trainer's) and
deltas from there. Which peers hold snapshots follows `gossip.snapshot_rule`: "rebuilt" (the
product's now) every reachable worker holding one of the newest `keep_snapshots` versions serves
it (`snapshot_sources.serves_snapshot`: the head and the one before, at most `max_snapshot_streams`
at once: a holder whose uplink already carries that many snapshots' worth refuses at once, counted
in `snapshot_refused`, and the joiner asks its next holder; a trainer past `trainer_snapshot_streams`
refuses "snapshot_busy", counted in `trainer_refused`, and the joiner looks at the peers again at its
next sync poll); "received" (the rule before) only the
joiners that received a snapshot serve it. With `snapshot_wait` a joiner that finds no peer's
snapshot waits a random share of `peer_wait_s` for one (the product's CatchUp) and asks among those
announced when its wait ends (the product stops at the first); without, it asks its trainer at
once (the simulator before issue 24). A running
worker notices a new version at its next sync poll and asks the announced holders in random order
(at most `max_peer_attempts` of them per update and catch-up), waiting a random share of
`peer_wait_s` (`wait_rule` "scaled*": of `delta_sources.wait_ceiling_s` for the previous version's
reachable holders) for one to appear before it asks the trainer: it asks the first holder that
announces, or under the "*-whole" rules (`delta_sources.waits_whole`) a random one of the holders
announced when its wait ends. Peers behind
NAT accept no inbound stream, so they never announce and are never a source.

Fetches fail as the product's do (network.fetch): a peer fetch after PEER_FETCH_TIMEOUT_S or when
the holder leaves mid-transfer, and the worker asks the next holder it has not failed with (else
waits for one, else the trainer; past `max_peer_attempts` peer fetches, the trainer at once); a
trainer fetch after TRAINER_FETCH_TIMEOUT_S or when the trainer is gone, and the worker tries again, peers first, at its next sync poll. A worker whose trainer
died asks another trainer once it has moved (`reconnect_s` later).

Granularity: a version's spread over all live workers is computed when it is published, in order
of the workers' decision times (a heap, retries included) with a heap of pending announcements
(no SimPy event per fetch). A holder that left is skipped, as a failed dial would be. A worker
still failing GIVE_UP_S after the version was published stops there; its next lease catches it up
afresh (worker.py). Fetches are booked on the senders' uplinks as they are computed, which can be
ahead of the clock (a whole version's spread at its publish, a joiner's chain of deltas); the
uplink book keeps its stretches in time order (network.Uplink), so those bookings do not delay
requests made later for an earlier time.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

from swarmrl.protocol import delta_sources, snapshot_sources
from swarmrl.simulations import regions
from swarmrl.simulations.network import Fetch, Uplink, fetch
from swarmrl.simulations.population import Worker
from swarmrl.simulations.scenario import Gossip

_PICK_TRIES = 6
PEER_FETCH_TIMEOUT_S = 30.0      # node/swarm/gossip.py: GossipNode.fetch(timeout_s=30.0)
TRAINER_FETCH_TIMEOUT_S = 120.0  # node/net/trainer_client.py: FETCH_TIMEOUT_S
MAX_TRIES = 1000                 # a bound on fetch attempts per worker and version (the product retries for ever)
GIVE_UP_S = 600.0                # a catch-up still failing this long after it began is left to the worker's next lease

TrainerSource = Callable[[Worker, float], tuple[Uplink, float]]
"""(uplink, gone_s) of the trainer a worker asks at a time (s): gone_s is when that trainer dies."""


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
    failed_peer_fetches: int = 0
    failed_trainer_fetches: int = 0


class DeltaSpread:
    """Per-version holders and the time each worker holds each version."""

    def __init__(self, cfg: Gossip, delta_bytes: int, snapshot_bytes: int, announce_s: float, seed: int | str,
                 trainer_source: TrainerSource, signer: str = "trainer") -> None:
        self.cfg, self.delta_bytes, self.snapshot_bytes, self.announce_s = cfg, delta_bytes, snapshot_bytes, announce_s
        self.rng = random.Random(f"gossip/{seed}")
        self.trainer_source, self.signer = trainer_source, signer
        self.held: dict[int, dict[int, float]] = {0: {}}    # version -> worker idx -> when held
        self.holders: dict[int, list[SimHolder]] = {0: []}  # version -> reachable holders (delta or snapshot)
        self.snapshots: dict[int, list[SimHolder]] = {}      # version -> reachable snapshot holders
        self.published: dict[int, float] = {0: 0.0}
        self.version = 0
        self.spreads: list[VersionSpread] = []
        self.trainer_bytes = 0
        self.peer_bytes = 0
        self.failed = {"peer": 0, "trainer": 0}              # failed fetches (timed out or sender gone)
        self.snapshot_sent = {"peer": 0, "trainer": 0}       # snapshot bytes sent, by source (failed ones too)
        self.snapshot_refused = 0                            # snapshot requests a peer refused at its stream bound
        self.trainer_refused = 0                             # snapshot requests a trainer refused ("snapshot_busy")
        self.queue_s_max = {"peer": 0.0, "trainer": 0.0}     # longest a fetch's first byte waited on an uplink (s)
        self.clock_s = 0.0                                   # the simulated clock at the last publish or join
        self._served = 0                                     # trainer fetches of the version being spread
        self.sources_chosen: list[Worker] = []               # peers ever chosen as a source (tests read it)
        self.limit = cfg.max_peer_attempts                   # peer fetches per update and catch-up (0: all)
        self.events = 0                                      # decisions, announcements and wait ends processed

    # ---- queries
    def held_at(self, w: Worker, version: int) -> float:
        """When `w` holds `version` (0.0 when the version is older than what we keep: it holds it)."""
        got = self.held.get(version)
        if got is None:
            return 0.0
        return got.get(w.idx, math.inf)

    # ---- sources
    def _pick(self, found: list[SimHolder], me: Worker, at: float, failed: Container[str] = (),
              left: int | None = None) -> Worker | None:
        """The first of delta_sources.ask_order over the live, announced candidates (not the
        holders `me` already failed with for this update: `failed`, peer ids), None once `left`
        (delta_sources.attempts_left) is 0. Past 64 records: a few uniform draws instead (the same
        distribution as the first of a shuffle, without shuffling thousands of records per fetch)."""
        if len(found) <= 64:
            live = [h for h in found if h.since <= at and h.worker.alive and h.worker.leaves_s > at]
            cands = delta_sources.candidates(live, me=me.peer_id, dropped=failed, signers={self.signer})
            order = delta_sources.ask_order(cands, self.rng, left)
            return order[0].worker if order else None
        if left == 0:
            return None
        for _ in range(_PICK_TRIES):
            h = found[self.rng.randrange(len(found))]
            if (h.holder_id != me.peer_id and h.holder_id not in failed and h.worker.alive and h.since <= at
                    and h.worker.leaves_s > at):
                return h.worker
        return None

    def _fetch(self, w: Worker, src: Worker | None, size: int, start: float) -> Fetch:
        """One fetch of `size` bytes by `w` from peer `src` (None: its trainer) asked at `start` (s)."""
        if src is None:
            up, gone = self.trainer_source(w, start)
            up.forget_before(self.clock_s)
            got = fetch(up, gone, w.region, w.down_bps, size, start, TRAINER_FETCH_TIMEOUT_S)
            self.trainer_bytes += got.sent_bytes
        else:
            up = src.uplink
            up.forget_before(self.clock_s)
            got = fetch(up, src.leaves_s, w.region, w.down_bps, size, start, PEER_FETCH_TIMEOUT_S)
            self.peer_bytes += got.sent_bytes
            self.sources_chosen.append(src)
        kind = "trainer" if src is None else "peer"
        self.queue_s_max[kind] = max(self.queue_s_max[kind], got.queued_s)
        if not got.ok:
            self.failed[kind] += 1
        return got

    def _retry_at(self, src: Worker | None, got: Fetch) -> float:
        """When a worker tries again after a failed fetch: at once after a peer (the next holder),
        at its next sync poll after the trainer (prefetch_loop: sync_poll_s x U(0.5, 1.5))."""
        return got.end_s if src is not None else got.end_s + self.cfg.sync_poll_s * self.rng.uniform(0.5, 1.5)

    def _admits(self, up: Uplink, at: float, bound: int) -> bool:
        """Whether a sender whose uplink is `up` takes one more snapshot stream at `at` (s) under
        `bound` (`snapshot_sources.admits_stream`): the snapshots' worth its uplink still carries
        stand for the streams it serves."""
        backlog_s = max(0.0, up.busy_until - at)
        in_flight = math.ceil(backlog_s * up.up_bps / self.snapshot_bytes - 1e-9)
        return snapshot_sources.admits_stream(in_flight, bound)

    def _get(self, w: Worker, found: list[SimHolder], size: int, start: float,
             snapshot: bool = False) -> tuple[float, Worker | None]:
        """Fetch an update the `found` holders announce, retrying as the product does; returns
        (when `w` holds it, the peer that served it or None) (inf: never, within MAX_TRIES).
        `snapshot`: a holder at its stream bound refuses (one round trip) and the next is asked."""
        failed: set[str] = set()
        asked = 0   # peer fetches in this catch-up
        at = start
        for _ in range(MAX_TRIES):
            if at >= min(w.leaves_s, start + GIVE_UP_S):
                break
            self.events += 1
            src = self._pick(found, w, at, failed, delta_sources.attempts_left(self.limit, asked))
            if snapshot and src is not None and not self._admits(src.uplink, at, self.cfg.max_snapshot_streams):
                self.snapshot_refused += 1
                failed.add(src.peer_id)
                asked += 1
                at += 2 * regions.one_way_s(src.region, w.region)
                continue
            if snapshot and src is None and self.cfg.trainer_snapshot_streams:
                up, _ = self.trainer_source(w, at)
                if not self._admits(up, at, self.cfg.trainer_snapshot_streams):   # "snapshot_busy": peers
                    self.trainer_refused += 1                                     # again at the next poll
                    asked = 0
                    at += 2 * regions.one_way_s(up.region, w.region) + self.cfg.sync_poll_s * self.rng.uniform(0.5, 1.5)
                    continue
            got = self._fetch(w, src, size, at)
            if snapshot:
                self.snapshot_sent["trainer" if src is None else "peer"] += got.sent_bytes
            if got.ok:
                return got.end_s, src
            if src is not None:
                failed.add(src.peer_id)
                asked += 1
            else:
                asked = 0   # a new catch-up at the next sync poll
            at = self._retry_at(src, got)
        return math.inf, None

    def _hold(self, w: Worker, version: int, at: float) -> None:
        self.held.setdefault(version, {})[w.idx] = at
        if w.reachable and at < w.leaves_s:
            self.holders.setdefault(version, []).append(
                SimHolder(w.peer_id, self.signer, w, at + self.announce_s))

    # ---- a worker joins: snapshot, then deltas
    def snapshot_holders(self, version: int) -> list[SimHolder]:
        """The reachable peers that announce a snapshot of `version` under the snapshot rule:
        "rebuilt", every holder of one of the newest `keep_snapshots` versions (workers do not run
        ahead of the head, so a holder of such a version keeps it among its newest); "received",
        the joiners that took a snapshot of it."""
        if self.cfg.snapshot_rule == "received":
            return self.snapshots.get(version, [])
        newest = range(self.version - self.cfg.keep_snapshots + 1, self.version + 1)
        if not snapshot_sources.serves_snapshot("rebuilt", version=version, newest_held=newest, received=False,
                                                keep=self.cfg.keep_snapshots):
            return []
        return self.holders.get(version, [])

    def _snapshot_source(self, w: Worker, want: int, at: float) -> int | None:
        """The nearest version a live peer serves a snapshot of for `w` at `at` (the first peer step
        of `snapshot_sources.snapshot_plan`), None: the trainer's of `want` (its last step)."""
        window = snapshot_sources.peer_snapshot_versions(range(want + 1), have=-1, want=want, max_gap=self.cfg.max_gap)
        for v in window:   # nearest first; the first a live peer serves (snapshot_plan's first step)
            if self._pick(self.snapshot_holders(v), w, at) is not None:
                return v
        return None

    def join(self, w: Worker, now: float) -> float:
        """Catch a new worker up to the current version; returns when it holds it."""
        want, self.clock_s = self.version, now
        assert delta_sources.needs_snapshot(-1, want, self.cfg.max_gap)
        at = now
        snap_v = self._snapshot_source(w, want, at)
        if snap_v is None and self.cfg.snapshot_wait and self.cfg.peer_wait_s > 0:
            at = now + delta_sources.holder_wait_s(self.cfg.peer_wait_s, self.rng)   # wait for a peer's snapshot
            snap_v = self._snapshot_source(w, want, at)
        snap_v = want if snap_v is None else snap_v
        t, _ = self._get(w, self.snapshot_holders(snap_v), self.snapshot_bytes, at, snapshot=True)
        if math.isinf(t):
            return t
        w.snapshot_version = snap_v
        self._hold(w, snap_v, t)
        if w.reachable and t < w.leaves_s:
            self.snapshots.setdefault(snap_v, []).append(SimHolder(w.peer_id, self.signer, w, t + self.announce_s))
        return self._deltas(w, snap_v, want, t)

    def _deltas(self, w: Worker, have: int, want: int, t: float) -> float:
        """Fetch the deltas after `have` up to `want` for `w`, one after the other from `t` (s);
        returns when it holds `want` (inf: a delta no source served)."""
        for v in range(have + 1, want + 1):
            t, _ = self._get(w, self.holders.get(v, []), self.delta_bytes, t)
            if math.isinf(t):
                return t
            self._hold(w, v, t)
        return t

    def catch_up(self, w: Worker, now: float) -> float:
        """A worker comes back to this job (a market's worker that served others meanwhile): the
        deltas from the newest version it holds, if within `max_gap` of the head (the product's
        replica, kept), else a snapshot first (`join`). Returns when it holds the head (inf: never)."""
        held = [v for v, got in self.held.items() if w.idx in got]
        have = max(held, default=-1)
        if delta_sources.needs_snapshot(have, self.version, self.cfg.max_gap):
            return self.join(w, now)
        self.clock_s = now
        return self._deltas(w, have, self.version, max(now, self.held[have][w.idx]))

    # ---- a version is published: every live worker fetches it
    def publish(self, version: int, now: float, live: list[Worker]) -> VersionSpread:
        """Spread `version` (published at `now`, s) over the `live` workers; returns its figures."""
        self.version, self.published[version], self.clock_s = version, now, now
        got = self.held.setdefault(version, {})
        self.holders.setdefault(version, [])
        tb, pb_, fp, ft = self.trainer_bytes, self.peer_bytes, self.failed["peer"], self.failed["trainer"]
        prev = self.held.get(version - 1, {})
        self._served = 0
        poll = self.cfg.sync_poll_s * 1.5
        fetchers = [w for w in live if w.idx in prev]
        rand = self.rng.random   # uniform(0, poll) is 0 + poll * random(): the same draws, one call fewer each
        _Round(self, version, [(max(prev[w.idx], now + poll * rand()), w) for w in fetchers]).run()
        spread = VersionSpread(version, now, len(fetchers), trainer_bytes=self.trainer_bytes - tb,
                               peer_bytes=self.peer_bytes - pb_, failed_peer_fetches=self.failed["peer"] - fp,
                               failed_trainer_fetches=self.failed["trainer"] - ft)
        spread.reach_s = _reach([got[w.idx] - now for w in fetchers if got.get(w.idx, math.inf) < w.leaves_s],
                                len(fetchers))
        self.spreads.append(spread)
        self._forget(version)
        return spread

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


_ANNOUNCE, _DECIDE, _DEADLINE = 0, 1, 2   # event kinds; at one instant an announcement comes first


class _Round:
    """One version's spread as events on a heap: a worker decides (an announced holder, else wait
    a random share of the wait rule's ceiling, else the trainer), a holder announces (every waiting
    worker, polling the DHT, sees it and asks it at once, as CatchUp._wait_for_holder does; not under
    a "*-whole" rule), a wait ends (a random announced holder under "*-whole", else the trainer). A failed peer fetch: the next holder not failed with; a failed trainer fetch:
    a new catch-up at the next sync poll (peers first, wait again)."""

    def __init__(self, spread: DeltaSpread, version: int, starts: list[tuple[float, Worker]]) -> None:
        self.s, self.version = spread, version
        self.give_up_s = spread.published[version] + GIVE_UP_S
        self.found = spread.holders[version]
        self.got = spread.held[version]
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count()
        self.waiting: dict[int, tuple[Worker, int]] = {}   # worker idx -> (worker, tries) waiting for a holder
        self.waited: set[int] = set()                      # waited once in the current catch-up
        self.failed: dict[int, set[str]] = {}               # worker idx -> holders it failed with
        self.looked: dict[int, float] = {}                  # worker idx -> when it last read the holder records
        self.asked: dict[int, int] = {}                     # worker idx -> peer fetches in its current catch-up
        self.announcing = 0                                 # announcements still on the heap
        self.wait_s = delta_sources.wait_ceiling_s(        # the ceiling of a wait for a holder
            spread.cfg.peer_wait_s, spread.cfg.wait_rule, len(spread.holders.get(version - 1, ())))
        self.whole = delta_sources.waits_whole(spread.cfg.wait_rule)   # read the records when the wait ends
        self.heap = [(at, _DECIDE, next(self.seq), (w, 0)) for at, w in starts]   # as _push, one heapify
        heapq.heapify(self.heap)

    def _push(self, at: float, kind: int, item: Any) -> None:
        heapq.heappush(self.heap, (at, kind, next(self.seq), item))

    def run(self) -> None:
        """Process every event until each live worker holds the version or gave up."""
        at = self.s.published[self.version]
        while self.heap or self.waiting:
            if not self.heap:   # what-if fan-out: no peer left to wait for; the trainer serves them
                left, self.waiting = list(self.waiting.values()), {}
                for w, tries in left:
                    if at < w.leaves_s:
                        self._fetch(w, None, at, tries)
                continue
            at, kind, _, item = heapq.heappop(self.heap)
            self.s.events += 1
            if kind == _ANNOUNCE:
                self.announcing -= 1
                self.found.append(item)
                self._wake(at)
            elif kind == _DECIDE:
                self._decide(item[0], at, item[1])
            else:
                self._deadline(item, at)

    def _decide(self, w: Worker, at: float, tries: int) -> None:
        """`w` looks for a source at `at` (s): after a failed peer fetch, the next holder of the
        records it read before (CatchUp does not re-read them), else it waits once, else the trainer;
        past `max_peer_attempts` peer fetches, the trainer at once."""
        if at >= min(w.leaves_s, self.give_up_s) or tries >= MAX_TRIES:
            return
        looked = self.looked.setdefault(w.idx, at)
        left = self._left(w)
        src = self.s._pick(self.found, w, looked, self.failed.get(w.idx, ()), left)
        if src is not None:
            self._fetch(w, src, at, tries)
        elif w.idx not in self.waited and left != 0:
            self.waited.add(w.idx)
            self.waiting[w.idx] = (w, tries)
            self._push(at + delta_sources.holder_wait_s(self.wait_s, self.s.rng), _DEADLINE, w)
        else:
            self._fetch(w, None, at, tries)

    def _left(self, w: Worker) -> int | None:
        return delta_sources.attempts_left(self.s.limit, self.asked.get(w.idx, 0))

    def _wake(self, at: float) -> None:
        """A holder announced: the waiting workers that can use it ask a holder now."""
        if self.whole:
            return   # a waiting worker reads the records only when its wait ends
        for idx, (w, tries) in list(self.waiting.items()):
            if at >= w.leaves_s:
                del self.waiting[idx]
                continue
            src = self.s._pick(self.found, w, at, self.failed.get(idx, ()), self._left(w))
            if src is not None:
                del self.waiting[idx]
                self.looked[idx] = at
                self._fetch(w, src, at, tries)

    def _deadline(self, w: Worker, at: float) -> None:
        """`w`'s wait for a holder ended: ask the trainer (unless the fan-out what-if refuses); under
        a "*-whole" rule, a random holder of those announced by now if any."""
        if w.idx not in self.waiting:
            return
        fanout = self.s.cfg.trainer_fanout
        if fanout and self.s._served >= fanout and self.announcing > 0:
            return   # what-if: the trainer refuses; wait for the next peer to announce
        _, tries = self.waiting.pop(w.idx)
        if at >= w.leaves_s:
            return
        src = (self.s._pick(self.found, w, at, self.failed.get(w.idx, ()), self._left(w))
               if self.whole else None)
        self.looked[w.idx] = at
        self._fetch(w, src, at, tries)

    def _fetch(self, w: Worker, src: Worker | None, at: float, tries: int) -> None:
        got = self.s._fetch(w, src, self.s.delta_bytes, at)
        if src is None:
            self.s._served += 1
        if got.ok:
            self.got[w.idx] = got.end_s
            if w.reachable and got.end_s < w.leaves_s:
                since = got.end_s + self.s.announce_s
                self.announcing += 1
                self._push(since, _ANNOUNCE, SimHolder(w.peer_id, self.s.signer, w, since))
        elif src is not None:
            self.failed.setdefault(w.idx, set()).add(src.peer_id)
            self.asked[w.idx] = self.asked.get(w.idx, 0) + 1
            self._push(got.end_s, _DECIDE, (w, tries + 1))
        else:   # a new catch-up at the next sync poll: fresh records, a new wait, a new peer budget
            self.waited.discard(w.idx)
            self.looked.pop(w.idx, None)
            self.asked.pop(w.idx, None)
            self._push(self.s._retry_at(None, got), _DECIDE, (w, tries + 1))
