"""What a trainer keeps of a job's adapter versions on disk (a pure rule), and the disk it uses.

With head H, the job's staleness window A (`max_async_level`) and `keep_versions` K:

    floor = max(0, H - A - K)

Every version in [floor, H] stays servable: the store keeps one snapshot of `floor`, the deltas
floor+1 .. H, and the newest `keep_snapshots` snapshots above the floor (those published every
`snapshot_every` versions and those rebuilt on request: the head a late joiner asked for, the
versions a validator re-scores). Everything older is deleted as the job runs: at most
A + K deltas and keep_snapshots + 1 snapshots per job, whatever the job's length.

Why these versions: a rollout may claim any version >= H - A (admission), and a validator checks
admitted rollouts some time later, so it needs versions down to H - A minus its lag (K covers a lag
of K steps); a worker within `max_gap` (8) of the version it wants catches up by deltas, further
behind it takes one snapshot of the wanted version (always the head or near it), so a late joiner
can always catch up; the trainer's restart rolls its newest checkpoint (the head or one behind)
forward through the deltas after it (K >= 2). A version below the floor is answered "not kept"
(`protocol.updates.VersionNotKept`), never as "never published".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

KEEP_VERSIONS = 8     # defaults of TrainerConfig.keep_versions / keep_snapshots (tests check they agree)
KEEP_SNAPSHOTS = 3


@dataclass(frozen=True)
class Retention:
    """How many versions behind the staleness window stay servable, and how many spare snapshots.

    Raises:
        ValueError: keep_versions < 2 (a restart rolls the checkpoint forward through up to two
            deltas), keep_snapshots < 1 or max_async_level < 0.
    """

    keep_versions: int = KEEP_VERSIONS
    keep_snapshots: int = KEEP_SNAPSHOTS
    max_async_level: int = 0

    def __post_init__(self) -> None:
        if self.keep_versions < 2:
            raise ValueError(f"keep_versions must be >= 2 (checkpoint roll-forward), got {self.keep_versions}")
        if self.keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be >= 1, got {self.keep_snapshots}")
        if self.max_async_level < 0:
            raise ValueError(f"max_async_level must be >= 0, got {self.max_async_level}")

    def floor(self, head: int) -> int:
        """The oldest version kept servable at `head`."""
        return max(0, head - self.max_async_level - self.keep_versions)


@dataclass(frozen=True)
class PrunePlan:
    """What to do at one head: rebuild a snapshot of `rebase_at` first (None: one exists), then
    delete `drop_deltas` and `drop_snapshots` (versions)."""

    floor: int
    rebase_at: int | None
    drop_deltas: tuple[int, ...]
    drop_snapshots: tuple[int, ...]


def plan_prune(head: int, deltas: set[int], snapshots: set[int], retention: Retention,
               floor: int | None = None) -> PrunePlan:
    """The store's files to delete at `head` (see the module docstring).

    deltas: versions with a stored delta (d{v} produces v); snapshots: versions with a snapshot.
    Deletion assumes the snapshot of the floor exists (or is rebuilt first: `rebase_at`).
    floor: overrides the rule's floor (the store passes its oldest snapshot above the floor when
    the floor can't be rebuilt: a trainer that joined late holds no deltas before the snapshot it
    adopted from a cotrainer).
    """
    floor = retention.floor(head) if floor is None else floor
    rebase_at = None if floor in snapshots else floor
    above = sorted((v for v in snapshots if v > floor), reverse=True)
    spare = set(above[:retention.keep_snapshots])
    return PrunePlan(
        floor=floor, rebase_at=rebase_at,
        drop_deltas=tuple(sorted(v for v in deltas if v <= floor)),
        drop_snapshots=tuple(sorted(v for v in snapshots if v < floor or (v > floor and v not in spare))),
    )


def disk_use(state_dir: Path) -> dict[str, int]:
    """Bytes under a trainer's state folder, by kind: deltas, snapshots (`jobs/*/adapters`),
    checkpoints, final exports, the ledger (SQLite with its WAL) and the total.

    The trainer prunes and replaces files and folders while this runs: whatever vanishes during
    the walk is not counted (`os.walk` skips a folder it can no longer list; `Path.rglob` raises
    FileNotFoundError when a folder it listed is gone before it descends).
    """
    root = Path(state_dir)
    out = {"deltas": 0, "snapshots": 0, "checkpoints": 0, "final": 0, "ledger": 0, "total": 0}
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder, name)
            try:
                size = path.stat().st_size
            except FileNotFoundError:  # pruned while we walked
                continue
            out["total"] += size
            parts = path.relative_to(root).parts
            if parts[0].startswith("ledger"):
                out["ledger"] += size
            elif len(parts) > 3 and parts[2] == "adapters":
                out["deltas" if name.startswith("d") else "snapshots"] += size
            elif len(parts) > 3 and parts[2] in ("checkpoints", "final"):
                out[parts[2]] += size
    return out
