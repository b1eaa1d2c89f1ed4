"""Catching a replica up: deltas from peers that hold them, the trainer as the fallback source.

For each missing version the replica asks the peers that announce that delta (in random order, at
most `max_peer_attempts` of them per update and run, 0: all; each failed peer fetch can cost the
fetch's 30 s timeout), then, for whatever is still missing, the trainer (its client: gRPC, or in process). More than
`max_gap` versions behind (or holding nothing yet) it takes one snapshot instead: the newest one peers hold within
`max_gap` of the wanted version (then deltas from there), else the trainer's snapshot of it. Every update is verified exactly as when it comes from the trainer: the
header's signature (the job's trainer or a cotrainer it lists), the payload's sha256, the
version asked for, and the from/to adapter hashes when applied. A peer that sends something that
does not verify only wastes bandwidth: the bytes are counted and the peer is dropped for the
session. When no peer holds the next delta yet, the replica waits up to `peer_wait_s` (a random
share of it, so the first fetches of a fresh version spread out) for one to announce it; with
`wait_rule` "scaled*" that ceiling grows with the holders of the previous version
(`delta_sources.wait_ceiling_s`), and with "*-whole" the replica waits its whole drawn share, then
reads the holder records and asks a random holder (`delta_sources.waits_whole`; otherwise it stops
at the first holder record it sees). A replica holding nothing or too far behind waits up to
`peer_wait_s` for a peer to announce a snapshot, stopping at the first (whatever the rule).

Which snapshot, and from whom, is `protocol/snapshot_sources.py`'s rule: the nearest one a peer
holds within `max_gap` (then the deltas after it), the trainer's only when no peer serves. A peer's
snapshot is verified as a trainer's (`updates.open_snapshot`: the trainer-signed header of the
version, the content address, the rebuilt adapter hash); one that fails is refused, counted by
reason (`SyncStats.snapshot_refused`) and its peer dropped.

Verified updates are kept by the gossip node and served to others; under the snapshot rule
"rebuilt" (the default) the replica also keeps a snapshot of the version each catch-up ends at,
made from its own state (`updates.rebuilt_snapshot`), so every peer that holds a head can serve it.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hivemind

from swarmrl.node.net.trainer_client import AdapterFetcher
from swarmrl.node.swarm.gossip import GossipNode
from swarmrl.node.swarm.holders import Holder, UpdateKey, find_holders
from swarmrl.protocol import adapter as ad
from swarmrl.protocol import delta_codec as dc
from swarmrl.protocol import delta_sources, signing, snapshot_sources
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.signing import signer_id
from swarmrl.protocol.updates import (
    AdapterReplica,
    ReceivedUpdate,
    SnapshotRefused,
    assemble,
    open_snapshot,
    rebuilt_snapshot,
)

log = logging.getLogger(__name__)

_SNAPSHOT: UpdateKey = (-1, True)
"""The peer-attempt budget every snapshot version of one run shares (one update: the snapshot)."""


class UntrustedSigner(ad.AdapterError):
    """A validly signed update from a trainer this replica does not accept (e.g. a cotrainer its
    trainer's record does not list yet)."""


HELD_AT_KEPT = 1024   # versions whose first-held time a replica keeps (the newest)
PEERS_KEPT = 1024     # dropped peers, and peers with failed fetches, a replica remembers (the newest)
FAILURES_TO_DROP = 3  # failed fetches (unreachable, stalled) after which a peer is dropped


@dataclass
class SyncStats:
    """Where a replica's bytes came from (payload bytes), and when it first held each version.
    `rejected`: verified (signed, hash-matching) updates whose delta payload was malformed
    (`delta_codec.DeltaFormatError`), never applied. `snapshot_bytes`: snapshot payload bytes by
    source ("peer", "trainer"); `snapshot_refused`: peers' snapshots that did not verify, by reason
    (`snapshot_sources.REFUSALS`).

    Bounded for a worker that runs for days: `held_at` keeps the newest HELD_AT_KEPT versions,
    `dropped_peers` the newest PEERS_KEPT drops (a forgotten liar costs one more wasted fetch
    before it is dropped again), and the failed-fetch counts the newest PEERS_KEPT peers."""

    bytes_from_peers: int = 0
    bytes_from_trainer: int = 0
    wasted_bytes: int = 0
    peer_updates: int = 0
    trainer_updates: int = 0
    snapshots: int = 0
    rejected: int = 0
    snapshot_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(snapshot_sources.SOURCES, 0))
    snapshot_refused: dict[str, int] = field(default_factory=dict)
    dropped_peers: dict[str, None] = field(default_factory=dict)   # in drop order (a set with an order)
    held_at: dict[int, float] = field(default_factory=dict)   # version -> unix seconds
    _failures: dict[str, int] = field(default_factory=dict, repr=False)   # peer -> failed fetches, newest last

    def note_held(self, version: int, at: float) -> None:
        """Record when `version` was first held (unix seconds); forget the oldest beyond HELD_AT_KEPT."""
        self.held_at.setdefault(version, at)
        while len(self.held_at) > HELD_AT_KEPT:
            del self.held_at[min(self.held_at)]

    def drop(self, peer: str) -> None:
        """Ask `peer` no more (it wasted bytes or failed too often); the oldest drop beyond
        PEERS_KEPT is forgotten."""
        self.dropped_peers.pop(peer, None)
        self.dropped_peers[peer] = None
        self._failures.pop(peer, None)
        while len(self.dropped_peers) > PEERS_KEPT:
            del self.dropped_peers[next(iter(self.dropped_peers))]

    def failed(self, peer: str) -> bool:
        """Count a failed fetch from `peer`; drops it at FAILURES_TO_DROP and returns True then.
        The counts of the peers that failed longest ago beyond PEERS_KEPT are forgotten."""
        n = self._failures.pop(peer, 0) + 1
        if n >= FAILURES_TO_DROP:
            self.drop(peer)
            return True
        self._failures[peer] = n
        while len(self._failures) > PEERS_KEPT:
            del self._failures[next(iter(self._failures))]
        return False

    def report(self) -> dict[str, Any]:
        """The counters as a JSON-ready dict: dropped peers sorted, `held_at` as version string ->
        unix seconds (rounded to ms)."""
        return {"bytes_from_peers": self.bytes_from_peers, "bytes_from_trainer": self.bytes_from_trainer,
                "wasted_bytes": self.wasted_bytes, "peer_updates": self.peer_updates,
                "trainer_updates": self.trainer_updates, "snapshots": self.snapshots, "rejected": self.rejected,
                "snapshot_bytes": dict(self.snapshot_bytes), "snapshot_refused": dict(self.snapshot_refused),
                "dropped_peers": sorted(self.dropped_peers),
                "held_at": {str(v): round(t, 3) for v, t in sorted(self.held_at.items())}}


class CatchUp:
    """Brings one job's `AdapterReplica` to a wanted version (thread-safe; see module docstring).

    trainer: the followed trainer, the last resort (`node.net.trainer_client.AdapterFetcher`: a
        worker's `WorkerTrainer`); reassign it to follow another trainer of the job.
    signers: the trainer ids whose signatures are accepted now (from the followed job record).
    gossip/dht: None to fetch from the trainer only (no peers).
    max_peer_attempts: peers asked per update in one `run` before the trainer (0: every holder;
    the snapshot, whichever version, counts as one update).
    snapshot_rule: `snapshot_sources.SNAPSHOT_RULES`; "rebuilt" keeps (and so serves) a snapshot of
    the version each run ends at, made from the replica's state.
    """

    def __init__(self, replica: AdapterReplica, *, trainer: AdapterFetcher, signers: Callable[[], set[str]],
                 gossip: GossipNode | None = None, dht: hivemind.DHT | None = None, max_gap: int = 8,
                 peer_wait_s: float = 1.0, max_peer_attempts: int = delta_sources.MAX_PEER_ATTEMPTS,
                 wait_rule: str = delta_sources.WAIT_RULE, rng: random.Random | None = None,
                 snapshot_rule: str = snapshot_sources.SNAPSHOT_RULE) -> None:
        delta_sources.needs_snapshot(0, 0, max_gap)   # raises ValueError unless max_gap >= 1
        delta_sources.attempts_left(max_peer_attempts, 0)
        delta_sources.wait_ceiling_s(peer_wait_s, wait_rule, 0)   # raises ValueError for an unknown rule
        self.replica, self.trainer, self.signers = replica, trainer, signers
        self.gossip, self.dht = gossip, dht
        self.max_gap, self.peer_wait_s, self.max_peer_attempts = max_gap, peer_wait_s, max_peer_attempts
        self.wait_rule = wait_rule
        self.snapshot_rule = snapshot_sources.check_rule(snapshot_rule)
        self._last: ReceivedUpdate | None = None   # the update that produced the replica's version
        self.rng = rng or random.Random()
        self.stats = SyncStats()
        self._asked: dict[UpdateKey, int] = {}   # peer fetches per update in the current run (snapshots: _SNAPSHOT)
        self._lock = threading.Lock()

    @property
    def job_id(self) -> str:
        """The job whose adapter the replica holds."""
        return self.replica.job_id

    def held(self) -> tuple[ad.State | None, int, bytes]:
        """(state, version, adapter hash) of the replica, read consistently with a running catch-up."""
        with self._lock:
            return self.replica.state, self.replica.version, self.replica.hash

    def forget(self) -> None:
        """Drop the replica's adapter (the next `run` starts from a snapshot): it is a version
        the trainer now followed may not hold (DiLoCo: another trainer's inner version)."""
        with self._lock:
            self.replica.state, self.replica.version, self.replica.hash = None, -1, b""
            self.replica.applied.clear()

    def run(self, want: int) -> None:
        """Bring the replica to at least `want`.

        Raises:
            ad.AdapterError: the trainer's answer does not verify.
            grpc.RpcError: the trainer could not be reached (and no peer had what was missing).
        """
        with self._lock:
            if self.replica.version >= want:
                return
            start = self.replica.version
            try:
                self._run(want)
            finally:
                if self.gossip is not None:
                    if self.replica.version > start:
                        self._hold_head()
                    self.gossip.announce(self.job_id)

    def _hold_head(self) -> None:
        """Keep a snapshot of the version reached, made from the replica's own state (rule
        "rebuilt"; a received snapshot is held already)."""
        last = self._last
        if (self.snapshot_rule != "rebuilt" or last is None or last.header.snapshot or self.gossip is None
                or self.replica.state is None or int(last.header.to_version) != self.replica.version):
            return
        try:
            self.gossip.hold(rebuilt_snapshot(last, self.replica.state))
        except ad.AdapterError as exc:   # cannot happen after a verified apply; never worth a crash
            log.warning("job %s: no snapshot of v%d to serve: %s", self.job_id[:12], self.replica.version, exc)

    def _run(self, want: int) -> None:
        self._asked = {}
        holders = self._holders()
        far = delta_sources.needs_snapshot(self.replica.version, want, self.max_gap)
        if far and not self._snapshot_from_peers(want, holders):
            if self._left(_SNAPSHOT) != 0:   # peers left to ask: wait for one to announce a snapshot
                holders = self._wait_for_holder(lambda h: self._near_snapshots(want, h), self.peer_wait_s,
                                                whole=False)
            if not self._snapshot_from_peers(want, holders):
                self._from_trainer(want, snapshot=True)
                return
        waited = False
        while self.replica.version < want:
            key = (self.replica.version + 1, False)
            if self._from_peers(key, holders):
                continue
            if waited or self._left(key) == 0:
                break
            ceiling = delta_sources.wait_ceiling_s(self.peer_wait_s, self.wait_rule,
                                                   len(holders.get((self.replica.version, False), [])))
            holders = self._wait_for_holder(functools.partial(self._candidates, key), ceiling,
                                            whole=delta_sources.waits_whole(self.wait_rule))
            waited = True
        if self.replica.version < want:
            self._from_trainer(want, snapshot=False)

    # ---- peers
    def _holders(self) -> dict[UpdateKey, list[Holder]]:
        if self.gossip is None or self.dht is None:
            return {}
        try:
            return find_holders(self.dht, self.job_id)
        except Exception as exc:  # noqa: BLE001 - the DHT can fail: fall back to the trainer
            log.warning("job %s: looking up delta holders failed: %r", self.job_id[:12], exc)
            return {}

    def _wait_for_holder(
        self, found: Callable[[dict[UpdateKey, list[Holder]]], Sequence[object]], ceiling_s: float, *, whole: bool
    ) -> dict[UpdateKey, list[Holder]]:
        """Wait a random share of `ceiling_s` (`delta_sources.holder_wait_s`) for a holder: `whole`
        (`delta_sources.waits_whole`), sleep all of it, then read the holder records once (the
        caller asks a random holder of them); else poll the records every 0.1 s and stop as soon as
        `found(holders)` (every worker waiting then asks the first holder that announced)."""
        holders: dict[UpdateKey, list[Holder]] = {}
        if self.gossip is None or ceiling_s <= 0:
            return holders
        deadline = time.monotonic() + delta_sources.holder_wait_s(ceiling_s, self.rng)
        if whole:
            time.sleep(max(0.0, deadline - time.monotonic()))
            return self._holders()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            holders = self._holders()
            if found(holders):
                break
        return holders

    def _candidates(self, key: UpdateKey, holders: dict[UpdateKey, list[Holder]]) -> list[Holder]:
        """Holders of `key` worth asking: not us, not dropped, holding an update signed by a
        trainer we accept (a holder's claim; what arrives is verified anyway)."""
        me = self.gossip.identity.peer_id if self.gossip is not None else ""
        signers = self.signers()
        return delta_sources.candidates(holders.get(key, []), me=me, dropped=self.stats.dropped_peers, signers=signers)

    def _near_snapshots(self, want: int, holders: dict[UpdateKey, list[Holder]]) -> list[int]:
        """Versions of snapshots peers hold that are newer than ours and within `max_gap` of `want`,
        nearest first (`snapshot_sources.peer_snapshot_versions`)."""
        offered = [v for v, snap in holders if snap and self._candidates((v, True), holders)]
        return snapshot_sources.peer_snapshot_versions(offered, have=self.replica.version, want=want,
                                                       max_gap=self.max_gap)

    def _snapshot_from_peers(self, want: int, holders: dict[UpdateKey, list[Holder]]) -> bool:
        """The newest snapshot peers hold within `max_gap` of `want` (deltas follow from there)."""
        return any(self._from_peers((v, True), holders, budget=_SNAPSHOT)
                   for v in self._near_snapshots(want, holders))

    def _left(self, budget: UpdateKey) -> int | None:
        return delta_sources.attempts_left(self.max_peer_attempts, self._asked.get(budget, 0))

    def _from_peers(self, key: UpdateKey, holders: dict[UpdateKey, list[Holder]],
                    budget: UpdateKey | None = None) -> bool:
        """Ask the candidates holding `key` (at most what is left of `budget`'s peer attempts, by
        default `key`'s own)."""
        budget = budget or key
        for holder in delta_sources.ask_order(self._candidates(key, holders), self.rng, self._left(budget)):
            self._asked[budget] = self._asked.get(budget, 0) + 1
            if self._from_peer(key, holder):
                return True
        return False

    def _from_peer(self, key: UpdateKey, holder: Holder) -> bool:
        assert self.gossip is not None
        version, snapshot = key
        req = pb.UpdateRequest(job_id=self.job_id, version=version, snapshot=snapshot,
                               payload_sha256=holder.payload_sha256)
        try:
            got = self.gossip.fetch(holder.libp2p_peer_id, req, maddrs=holder.maddrs)
        except Exception as exc:  # noqa: BLE001 - a peer can vanish or stall: try the next one
            self.stats.failed(holder.holder_id)
            log.debug("job %s: fetching v%d from %s failed: %r", self.job_id[:12], version, holder.holder_id[:8], exc)
            return False
        size = sum(len(c.data) for c in got)
        if not got:
            return False  # it no longer holds it
        try:
            update = self._verified_one(got, key, holder.payload_sha256)
        except SnapshotRefused as exc:
            self.stats.snapshot_refused[exc.reason] = self.stats.snapshot_refused.get(exc.reason, 0) + 1
            if exc.reason == "untrusted":   # a genuine update we don't accept (yet): not a lie
                self.stats.wasted_bytes += size
            else:
                self._drop(holder, size, str(exc))
            return False
        except UntrustedSigner as exc:      # a genuine update we don't accept (yet): not a lie
            self.stats.wasted_bytes += size
            log.info("job %s: v%d from %s: %s", self.job_id[:12], version, holder.holder_id[:8], exc)
            return False
        except ad.AdapterError as exc:
            self._drop(holder, size, str(exc))
            return False
        try:
            self._apply(update)
        except ad.AdapterError as exc:  # signed, but for another branch than ours: useless, not a lie
            self.stats.wasted_bytes += size
            log.info("job %s: v%d from %s does not apply here: %s", self.job_id[:12], version, holder.holder_id[:8], exc)
            return False
        self.stats.bytes_from_peers += len(update.payload)
        self.stats.peer_updates += 1
        if snapshot:
            self.stats.snapshot_bytes["peer"] += len(update.payload)
        return True

    def _verified_one(self, got: list[pb.AdapterChunk], key: UpdateKey, sha: bytes) -> ReceivedUpdate:
        if key[1]:   # a snapshot: the trainer's, re-served, or a peer's rebuilt one
            return open_snapshot(got, self.signers(), job_id=self.job_id, version=key[0], payload_sha256=sha)
        first = got[0].header if got[0].HasField("header") else None
        if first is not None and len(first.public_key) == 32 and signer_id(first) not in self.signers():
            try:
                signing.open_signed(first, signing.ADAPTER_UPDATE, pb.AdapterUpdate)
            except signing.SignatureError as exc:
                raise ad.AdapterError(f"adapter update header: {exc}") from exc
            raise UntrustedSigner(f"signed by {signer_id(first)[:12]}, not a trainer we accept")
        updates = list(assemble(got, self.signers()))
        if len(updates) != 1:
            raise ad.AdapterError(f"expected one update, got {len(updates)}")
        h = updates[0].header
        if (h.job_id != self.job_id or (int(h.to_version), bool(h.snapshot)) != key
                or bytes(h.payload_sha256) != sha):
            raise ad.AdapterError(f"asked for {key} of job {self.job_id[:12]}, got {h.to_version} of {h.job_id[:12]}")
        return updates[0]

    def _drop(self, holder: Holder, size: int, why: str) -> None:
        self.stats.wasted_bytes += size
        self.stats.drop(holder.holder_id)
        log.warning("job %s: dropping peer %s for this session: %s", self.job_id[:12], holder.holder_id[:12], why)

    # ---- trainer
    def _from_trainer(self, want: int, *, snapshot: bool) -> None:
        req = pb.AdapterRequest(job_id=self.job_id, have_version=max(self.replica.version, 0), want_version=want,
                                snapshot=snapshot, requester="worker")
        try:
            for update in assemble(self.trainer.fetch_adapter(req), self.signers()):
                self._apply(update)
                self._count_trainer(update)
        except ad.AdapterError as exc:
            if snapshot:
                raise
            log.info("job %s: the delta chain does not apply here (%s); taking a snapshot", self.job_id[:12], exc)
            self._from_trainer(want, snapshot=True)

    def _count_trainer(self, update: ReceivedUpdate) -> None:
        self.stats.bytes_from_trainer += len(update.payload)
        self.stats.trainer_updates += 1
        if update.header.snapshot:
            self.stats.snapshot_bytes["trainer"] += len(update.payload)

    # ---- both
    def _apply(self, update: ReceivedUpdate) -> None:
        try:
            self.replica.apply(update)
        except dc.DeltaFormatError:
            self.stats.rejected += 1
            raise
        if update.header.snapshot:
            self.stats.snapshots += 1
        self.stats.note_held(self.replica.version, time.time())
        self._last = update
        if self.gossip is not None:
            self.gossip.hold(update)
