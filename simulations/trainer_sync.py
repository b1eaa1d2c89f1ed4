"""One job's trainers in different regions on the simulated clock: per-step averaging against
DiLoCo's outer rounds, over slow links, with trainers that drop out and come back.

The swarm simulator (`world.py`) steps every trainer of a job in lockstep and charges each step
one all-reduce; this model looks only at the trainers, to plan where they may sit. Each trainer
receives admitted groups as a Poisson stream (`groups_per_s`, its workers' supply) and steps on
`batch_groups` of them in `step_s` seconds. The product's rules it runs:

- `every_step` (`node.swarm.job_swarm`): every version is one averaging round of all live
  trainers. A trainer opens it when it has a batch; the others join at once with what they have
  (weight 0 when nothing), so versions advance in lockstep. Each trainer computes its step, then
  the round: hivemind's matchmaking (`matchmaking_s`), a round trip between the farthest members,
  and its parts out and the averaged parts back over its link.
- `diloco` (`node.trainer.outer`, `protocol.diloco`): each trainer takes its inner steps alone;
  at every outer version (`protocol.diloco.is_outer_version`) it waits for the live trainers in
  the outer round, at most `round_timeout_s` from the first arrival
  (`node.swarm.outer_round`), then the int8 all-reduce. A trainer that arrives after the round
  went on without it steps on its own pseudo-gradient and then adopts the others' outer state
  (a state download, `Cotrainers.sync_target`).
- A trainer that drops out (`dropouts`) is expected in the rounds that begin before the others
  notice (the first round after its death waits its whole matchmaking time: `round_timeout_s`
  for an outer round, `matchmaking_s` for a per-step one), then left out. It comes back after
  `back_after_s`, downloads the others' state (`snapshot_bytes` over its link) and continues from
  their last outer version (DiLoCo) or their head (per-step); its inner steps since its last
  outer version are lost, its groups while dead go elsewhere.

Bytes per round and trainer are calibrated on the product's measured rounds (Gemma 270M, two
trainers, docs/DILOCO.md): float32 per-step rounds sent 15.35 MB per trainer for a 12.47 MB
adapter (`step_ratio` 1.23 of one float32 copy x 2(n-1)/n), int8 outer rounds 4.06 MB
(`outer_ratio` 0.326). A trainer's compute utilization is the issue's: time stepping over time
stepping plus time in rounds (waiting for the other members, the wire, a state download after a
missed round); time waiting for groups counts in neither.
"""

from __future__ import annotations

import random
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Literal

import simpy

from swarmrl.protocol.diloco import is_outer_version, last_outer_version
from swarmrl.simulations.network import MBIT
from swarmrl.simulations.regions import REGIONS, one_way_s


@dataclass(frozen=True)
class Dropout:
    """Trainer `rank` dies at `at_s` (s) and comes back `back_after_s` later (inf: never)."""

    rank: int
    at_s: float
    back_after_s: float = float("inf")


@dataclass(frozen=True)
class SyncSetup:
    """One job's trainers and how they sync (units in the names: s, mbit, bytes)."""

    regions: tuple[str, ...]             # one per trainer (simulations.regions.REGIONS)
    sync: Literal["every_step", "diloco"]
    link_mbit: float = 20.0              # each trainer's WAN link, each direction
    steps: int = 60                      # the job's versions
    inner_steps: int = 8                 # DiLoCo's H
    step_s: float = 4.1                  # one optimizer step's compute (Gemma 270M, 2 CPU cores)
    batch_groups: int = 8
    groups_per_s: float = 2.5            # admitted groups per second at each trainer (its workers' supply)
    adapter_bytes: int = 12_470_000      # one float32 copy of the LoRA parameters
    snapshot_bytes: int = 12_700_000     # a state download on adoption or rejoin
    step_ratio: float = 1.23             # per-step round bytes over float32 bytes sent (calibrated)
    outer_ratio: float = 0.326           # int8 outer round bytes over float32 bytes sent (calibrated)
    one_way_s: float | None = None       # one-way latency between any two trainers (None: by region)
    matchmaking_s: float = 1.0           # hivemind's matchmaking per round
    round_timeout_s: float = 15.0        # an outer round's wait for its members (outer_timeout_s)
    dropouts: tuple[Dropout, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        for r in self.regions:
            if r not in REGIONS:
                raise ValueError(f"regions: unknown region {r!r} (known: {', '.join(REGIONS)})")
        if len(self.regions) < 1 or self.steps < 1 or self.inner_steps < 1 or self.link_mbit <= 0:
            raise ValueError("regions, steps, inner_steps and link_mbit must be positive")


@dataclass
class SyncResult:
    """What a run gave: wall time to the last version, per-trainer figures, rounds."""

    wall_s: float = 0.0
    compute_s: list[float] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)   # in rounds: waiting for members, the wire, downloads
    bytes_sent: list[float] = field(default_factory=list)
    rounds_met: int = 0                  # rounds (per-step or outer) with every live trainer in them
    rounds: int = 0
    late: int = 0                        # outer rounds a trainer missed (it adopted the others' state)
    lost_steps: int = 0                  # inner steps lost to a dropout

    def utilization(self) -> list[float]:
        """Each trainer's time stepping over time stepping plus time in rounds (0 when it never stepped)."""
        return [c / (c + w) if c > 0 else 0.0 for c, w in zip(self.compute_s, self.round_s)]

    def figures(self) -> dict[str, Any]:
        """The run as plain numbers (JSON-able)."""
        return {"wall_s": round(self.wall_s, 1), "utilization": [round(u, 3) for u in self.utilization()],
                "bytes_between_trainers": int(sum(self.bytes_sent)), "rounds": self.rounds,
                "rounds_met": self.rounds_met, "late": self.late, "lost_steps": self.lost_steps}


class TrainerSync:
    """The model (module docstring); `run()` once."""

    def __init__(self, setup: SyncSetup) -> None:
        self.s, self.env, n = setup, simpy.Environment(), len(setup.regions)
        self.rng = random.Random(f"trainer-sync/{setup.seed}")
        self.res = SyncResult(compute_s=[0.0] * n, round_s=[0.0] * n, bytes_sent=[0.0] * n)
        self.pending = [0] * n
        self.arrived = [self.env.event() for _ in range(n)]
        self.alive = [True] * n
        self.noticed_dead = [False] * n
        self.version = [0] * n
        self.rounds: dict[int, dict[str, Any]] = {}   # outer version -> its round

    # ---- the wire
    def _latency(self, members: list[int]) -> float:
        if self.s.one_way_s is not None:
            return self.s.one_way_s if len(members) > 1 else 0.0
        return max((one_way_s(self.s.regions[a], self.s.regions[b]) for a in members for b in members), default=0.0)

    def _allreduce(self, members: list[int], ratio: float) -> float:
        """Seconds of one butterfly round among `members` (each sends and receives its share),
        counting each member's bytes sent."""
        if len(members) < 2:
            return 0.0
        n = len(members)
        sent = ratio * self.s.adapter_bytes * 2 * (n - 1) / n
        for r in members:
            self.res.bytes_sent[r] += sent
        return self.s.matchmaking_s + 2 * self._latency(members) + sent / (self.s.link_mbit * MBIT)

    def _download(self, r: int, peers: list[int]) -> float:
        return self.s.snapshot_bytes / (self.s.link_mbit * MBIT) + 2 * self._latency([r, *peers])

    def _expected(self) -> list[int]:
        return [r for r in range(len(self.s.regions)) if self.alive[r] or not self.noticed_dead[r]]

    # ---- processes
    def _supply(self, r: int) -> Generator[simpy.Event, Any, None]:
        while True:
            yield self.env.timeout(self.rng.expovariate(self.s.groups_per_s))
            if self.alive[r]:
                self.pending[r] += 1
                ev, self.arrived[r] = self.arrived[r], self.env.event()
                ev.succeed()

    def _batch(self, r: int) -> Generator[simpy.Event, Any, bool]:
        """Wait for a batch at trainer `r` and take it; False when `r` died meanwhile."""
        while self.pending[r] < self.s.batch_groups:
            if not self.alive[r]:
                return False
            yield self.arrived[r] | self.env.timeout(1.0)
        self.pending[r] -= self.s.batch_groups
        return True

    def _dropout(self, d: Dropout) -> Generator[simpy.Event, Any, None]:
        yield self.env.timeout(d.at_s)
        self.alive[d.rank], self.pending[d.rank] = False, 0
        if d.back_after_s == float("inf"):
            return
        yield self.env.timeout(d.back_after_s)
        if self.s.sync == "every_step":   # it takes the others' head before it steps with them again
            yield self.env.timeout(self._download(d.rank, [p for p in range(len(self.s.regions)) if self.alive[p]]))
        self.alive[d.rank], self.noticed_dead[d.rank] = True, False

    def _lockstep(self) -> Generator[simpy.Event, Any, None]:
        """every_step: one round per version, all live trainers in it."""
        s, n = self.s, len(self.s.regions)
        version = 0
        while version < s.steps:
            live = [r for r in range(n) if self.alive[r]]
            if not live:
                yield self.env.timeout(1.0)
                continue
            yield self.env.any_of([self.arrived[r] for r in live]) if not any(
                self.pending[r] >= s.batch_groups for r in live) else self.env.timeout(0)
            stepping = [r for r in live if self.pending[r] >= s.batch_groups]
            if not stepping:
                continue
            for r in stepping:
                self.pending[r] -= s.batch_groups
                self.res.compute_s[r] += s.step_s
            expected = self._expected()
            wait = s.matchmaking_s if len(expected) > len(live) else 0.0   # a dead member is still expected
            for r in expected:
                if not self.alive[r]:
                    self.noticed_dead[r] = True
            self.res.rounds += 1
            self.res.rounds_met += int(len(live) == n)
            in_round = wait + self._allreduce(live, s.step_ratio)
            for r in live:   # one that had no batch joined with weight 0 and waited for the others' step
                self.res.round_s[r] += in_round + (0.0 if r in stepping else s.step_s)
            yield self.env.timeout(s.step_s + in_round)
            version += 1
            for r in live:
                self.version[r] = version

    def _inner(self, r: int) -> Generator[simpy.Event, Any, None]:
        """diloco: trainer `r`'s inner steps and outer rounds."""
        s = self.s
        while self.version[r] < s.steps:
            if not self.alive[r]:
                self.res.lost_steps += self.version[r] - last_outer_version(self.version[r], s.inner_steps)
                while not self.alive[r]:
                    yield self.env.timeout(1.0)
                peers = [p for p in range(len(s.regions)) if p != r and self.alive[p]]
                yield self.env.timeout(self._download(r, peers))
                self.version[r] = max([last_outer_version(self.version[p], s.inner_steps) for p in peers]
                                      + [last_outer_version(self.version[r], s.inner_steps)])
                continue
            if not (yield from self._batch(r)):
                continue
            yield self.env.timeout(s.step_s)
            if not self.alive[r]:
                continue
            self.res.compute_s[r] += s.step_s
            self.version[r] += 1
            if is_outer_version(self.version[r], s.inner_steps):
                t0 = self.env.now
                yield from self._outer_round(r, self.version[r])
                self.res.round_s[r] += self.env.now - t0

    def _outer_round(self, r: int, version: int) -> Generator[simpy.Event, Any, None]:
        s = self.s
        rd = self.rounds.get(version)
        if rd is None:
            rd = self.rounds[version] = {"members": [], "closed": False, "go": self.env.event(),
                                         "deadline": self.env.now + s.round_timeout_s}
            self.res.rounds += 1
            self.env.process(self._close_at_deadline(version))
        if rd["closed"]:   # it went on without us: our own step, then the others' state
            self.res.late += 1
            peers = [p for p in rd["members"] if self.alive[p]]
            yield self.env.timeout(self._download(r, peers))
            return
        rd["members"].append(r)
        if all(p in rd["members"] for p in self._expected()):   # a dead member not yet noticed holds it open
            self._close(version)
        yield rd["go"]
        yield self.env.timeout(rd["cost"])

    def _close_at_deadline(self, version: int) -> Generator[simpy.Event, Any, None]:
        rd = self.rounds[version]
        yield self.env.timeout(max(0.0, rd["deadline"] - self.env.now))
        if not rd["closed"]:
            for p in self._expected():
                if not self.alive[p]:
                    self.noticed_dead[p] = True
            self._close(version)

    def _close(self, version: int) -> None:
        rd = self.rounds[version]
        members = [p for p in rd["members"] if self.alive[p]]
        rd["closed"], rd["cost"] = True, self._allreduce(members, self.s.outer_ratio)
        self.res.rounds_met += int(len(members) == len(self.s.regions))
        rd["go"].succeed()

    def run(self, until_s: float = 86_400.0) -> SyncResult:
        """Run until the job's last version at every live trainer (or `until_s`); the result."""
        n = len(self.s.regions)
        for r in range(n):
            self.env.process(self._supply(r))
        for d in self.s.dropouts:
            self.env.process(self._dropout(d))
        done: simpy.Event = self.env.process(self._lockstep()) if self.s.sync == "every_step" else \
            self.env.all_of([self.env.process(self._inner(r)) for r in range(n)])
        self.env.run(until=simpy.AnyOf(self.env, [done, self.env.timeout(until_s)]))
        self.res.wall_s = self.env.now
        return self.res
