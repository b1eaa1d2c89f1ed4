"""Where a late joiner gets a full adapter: the nearest snapshot a peer holds plus the delta chain,
the trainer only when no peer can serve (the pure rule; issue 24 item 5, "no snapshot herd").

A replica that holds nothing, or is more than `max_gap` versions behind the version it wants
(`delta_sources.needs_snapshot`), takes one snapshot and the deltas after it. Which snapshot:
the newest version a peer announces within `max_gap` below the wanted one and newer than what the
replica holds (`peer_snapshot_versions`, nearest first: the shortest delta chain after it);
each is asked of its holders in turn (`delta_sources.ask_order`), and only when none of them
serves (none announced, each refused, failed or sent bytes that did not verify) the trainer's
snapshot of the wanted version (`snapshot_plan`'s last step).

Which peers hold snapshots (`SNAPSHOT_RULES`, worker config `snapshot_rule`):
- "rebuilt" (the default): every peer that holds a version's full adapter (a worker or validator
  that rebuilt it from a snapshot and deltas) serves it as a snapshot, for its newest
  `keep_snapshots` versions (`serves_snapshot`). The payload is the peer's own encoding of the
  state; the trainer-signed header of that version travels with it, so the receiver checks the
  trainer's signature over the version's adapter hash (`to_hash`) and rebuilds that hash from the
  bytes (`protocol.updates.open_snapshot`): a peer cannot make up a state.
- "received" (the rule before): a peer serves only the trainer-made snapshots it received itself
  (a joiner's), so the first joiners of a large swarm all ask the trainers.

A peer bounds what it serves so serving never starves its own work: at most `max_streams`
snapshot streams at once (`admits_stream`; more are refused at once, counted, and the asker goes to
the next holder), and only its newest `keep_snapshots` versions. The trainer bounds its snapshot
streams to workers the same way (`TRAINER_SNAPSHOT_STREAMS`), so that when a herd of joiners finds
no peer yet, the ones it refuses come back to the peers it seeded instead of queueing on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from swarmrl.protocol.delta_sources import needs_snapshot

SNAPSHOT_RULES = ("rebuilt", "received")
SNAPSHOT_RULE = "rebuilt"
KEEP_SNAPSHOTS = 2
"""Snapshot versions a peer keeps and serves per job (its newest): the head it holds and the one
before, which a joiner within `max_gap` of the head can always use."""
MAX_STREAMS = 2
"""Snapshot streams a peer serves at once (worker config `max_snapshot_streams`); past it a request is
refused (an empty answer, counted "busy"): a home uplink of 20 Mbit sends a 12.7 MB snapshot in
~5 s, so two at once stay well inside the asker's 30 s fetch timeout."""
TRAINER_SNAPSHOT_STREAMS = 4
"""Snapshot streams a trainer serves workers at once (trainer config `max_snapshot_streams`); past it
a worker's request is refused at once ("snapshot_busy", RESOURCE_EXHAUSTED with a retry hint) and
the worker looks for a peer's snapshot again: the trainer's uplink (1 Gbit: a 12.7 MB snapshot in
~0.1 s) stays as busy, but a herd of joiners no longer queues on it past its fetch timeout, and the
peers it seeded take over. A bound, not a rate: a swarm with no peers gets the trainer's full speed."""
SOURCES = ("peer", "trainer")
"""Where snapshot bytes come from (the Prometheus label `source`)."""
REFUSALS = ("busy", "signature", "untrusted", "version", "payload_sha256", "adapter_hash", "undecodable")
"""Why a snapshot was refused: "busy" by a serving peer at its stream bound; the others by the
joiner, for a peer's bytes that did not verify (`updates.SnapshotRefused.reason`)."""


def check_rule(rule: str) -> str:
    """`rule` itself when it is one of SNAPSHOT_RULES.

    Raises:
        ValueError: an unknown rule, naming the known ones."""
    if rule not in SNAPSHOT_RULES:
        raise ValueError(f"snapshot_rule must be one of {', '.join(SNAPSHOT_RULES)}, got {rule!r}")
    return rule


def peer_snapshot_versions(offered: Iterable[int], *, have: int, want: int, max_gap: int) -> list[int]:
    """The versions of peers' snapshots worth taking to reach `want` from `have` (-1: nothing),
    nearest first: newer than `have`, at most `want`, at least `want - max_gap` (so the chain of
    deltas after it is at most `max_gap` long). Empty when the replica needs no snapshot."""
    if not needs_snapshot(have, want, max_gap):
        return []
    low = max(want - max_gap, have + 1)
    return sorted({v for v in offered if low <= v <= want}, reverse=True)


@dataclass(frozen=True)
class SnapshotStep:
    """One source to try for the snapshot: `source` ("peer" or "trainer") and the version to ask
    for; the deltas `version + 1 .. want` follow it."""

    source: str
    version: int

    def chain(self, want: int) -> range:
        """The delta versions to fetch after this snapshot to reach `want`."""
        return range(self.version + 1, want + 1)


def snapshot_plan(offered: Iterable[int], *, have: int, want: int, max_gap: int) -> list[SnapshotStep]:
    """The sources to try in order for a replica at `have` that needs a snapshot to reach
    `want`: each peer-offered version of `peer_snapshot_versions`, then the trainer's snapshot of
    `want` (always last: it can be asked only when no peer serves). Empty when no snapshot is
    needed (the delta chain alone reaches `want`)."""
    if not needs_snapshot(have, want, max_gap):
        return []
    peers = [SnapshotStep("peer", v) for v in peer_snapshot_versions(offered, have=have, want=want, max_gap=max_gap)]
    return [*peers, SnapshotStep("trainer", want)]


def serves_snapshot(rule: str, *, version: int, newest_held: Iterable[int], received: bool,
                    keep: int = KEEP_SNAPSHOTS) -> bool:
    """Whether a peer serves a snapshot of `version` it holds under `rule`: "rebuilt", when
    `version` is among its newest `keep` held versions (`newest_held`: the versions whose full
    adapter it held, any order); "received", only a trainer-made snapshot it received itself
    (`received`), as long as it is among them too.

    Raises:
        ValueError: an unknown rule, or keep < 0."""
    check_rule(rule)
    if keep < 0:
        raise ValueError(f"keep_snapshots must be >= 0, got {keep}")
    newest = sorted(set(newest_held), reverse=True)[:keep]
    return version in newest and (rule == "rebuilt" or received)


def admits_stream(in_flight: int, max_streams: int = MAX_STREAMS) -> bool:
    """Whether a peer serving `in_flight` snapshot streams takes one more (`max_streams` 0: it
    serves no snapshots at all).

    Raises:
        ValueError: a negative count."""
    if in_flight < 0 or max_streams < 0:
        raise ValueError(f"stream counts must be >= 0, got in_flight={in_flight}, max_streams={max_streams}")
    return in_flight < max_streams


def trainer_share(peer_bytes: int, trainer_bytes: int) -> float:
    """The trainers' share of the snapshot bytes (0.0 when none moved)."""
    total = peer_bytes + trainer_bytes
    return trainer_bytes / total if total else 0.0
