"""A simulation scenario: plain pydantic data, loadable from TOML, checked at the boundary.

Every field has the unit in its name (_s seconds, _mbit megabits/s, _ms milliseconds, share in
[0, 1]). Contradictory settings raise `ValueError` naming the field (`scenario_error` turns a
pydantic error into one line). `build()` lives in world.py: a scenario opens nothing.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from swarmrl.protocol import delta_sources, snapshot_sources
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.leases import BACKLOG_BATCHES
from swarmrl.protocol.market import FOLLOW_IDLE_S, MAX_WEIGHT
from swarmrl.protocol.red_team_modes import MODES
from swarmrl.simulations.profiles import GPU_CLASSES, MODEL_PROFILES
from swarmrl.simulations.regions import REGIONS


class Strict(BaseModel):
    """Base of the scenario sections: unknown keys are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class JobShape(Strict):
    """The job's knobs that matter on the clock (defaults: the product's, protocol/jobspec.py)."""

    model: str = Field("gemma-270m-gpu", description="a profile of profiles.MODEL_PROFILES")
    group_size: int = Field(8, ge=2)
    batch_groups: int = Field(256, ge=1, description="groups per trainer per step (with batch_max: the fewest)")
    batch_max: int = Field(0, ge=0, description="elastic intake (JobSpec batch_groups = [batch_groups, batch_max]): "
                           "a step takes what is trainable up to this many groups, its time growing with the batch; "
                           "0: no range")
    prompts_per_lease: int = Field(4, ge=1)
    max_async_level: int = Field(2, ge=0)
    lease_ttl_s: float = Field(120.0, gt=0)
    steps: int = Field(0, ge=0, description="0: train until the simulated time ends")
    lease_rule: Literal["capacity", "pending"] = Field(
        "capacity", description="how much a trainer leases: 'capacity' the product's promise since issue 24 "
        "(protocol.demand.open_capacity: (max_async_level + 1) batches less pending groups and open leases' "
        "prompts; a busy worker goes to another trainer with capacity at once), 'pending' the rule before "
        "(leases.backlog_full over pending groups: unlimited leases until backlog_batches are pending)")
    backlog_batches: int = Field(BACKLOG_BATCHES, ge=1, description="lease_rule 'pending': batches pending "
                                 "(and leased) before 'busy'")
    backlog_counts_open: bool = Field(False, description="lease_rule 'pending', what-if: the backlog rule counts "
                                      "the prompts of open leases (leases.backlog_full)")
    ask_at_head: bool = Field(True, description="a worker asks for a lease only once it holds the job's head "
                              "version (waiting up to worker.HEAD_WAIT_MAX_S), so a lease's share of the promise is "
                              "not held while its worker catches up: the product's rule (JobSession.catch_up_to_head); "
                              "false: the rule before")
    weight: float = Field(1.0, gt=0, description="the job's weight (JobSpec.weight, protocol.market)")

    @model_validator(mode="after")
    def _known_model(self) -> JobShape:
        if self.model not in MODEL_PROFILES:
            raise ValueError(f"job.model: unknown profile {self.model!r} (known: {', '.join(MODEL_PROFILES)})")
        try:
            self.spec()
        except ValidationError as exc:
            raise ValueError(f"job: beyond the product's bounds ({scenario_error(exc)})") from None
        return self

    def spec(self) -> JobSpec:
        """The product's `JobSpec` with this job's knobs (what `protocol.demand` reads: group size,
        batch, async level, lease size and TTL, weight); model and environment are stand-ins."""
        return JobSpec(base_model="sim", base_model_sha256="0" * 64, group_size=self.group_size,
                       batch_groups=(self.batch_groups, self.batch_max) if self.batch_max else self.batch_groups,
                       prompts_per_lease=self.prompts_per_lease,
                       max_async_level=self.max_async_level, lease_ttl_s=self.lease_ttl_s,
                       steps=self.steps or 1_000_000, weight=self.weight)


class Churn(Strict):
    """Arrivals (Poisson), session lengths (Pareto, heavy-tailed) and crashes."""

    joins_per_hour: float = Field(0.0, ge=0, description="new workers per hour (Poisson)")
    median_session_s: float = Field(0.0, ge=0, description="0: workers never leave")
    session_shape: float = Field(1.2, gt=0, description="Pareto tail index (smaller: heavier tail)")
    crash_share: float = Field(1.0, ge=0, le=1, description="share of departures that crash mid-lease")


class Network(Strict):
    """Per-peer links. Bandwidths are medians of log-normal draws."""

    worker_down_mbit: float = Field(100.0, gt=0)
    worker_up_mbit: float = Field(20.0, gt=0)
    trainer_up_mbit: float = Field(1000.0, gt=0)
    spread: float = Field(0.6, ge=0, description="sigma of the log-normal bandwidth draws")
    nat_share: float = Field(0.4, ge=0, le=1, description="peers that accept no inbound connection")
    region_shares: dict[str, float] = Field(default_factory=lambda: {"na": 0.35, "eu": 0.35, "asia": 0.2,
                                                                     "sa": 0.05, "oceania": 0.05})
    slow_region: str = Field("", description="a region whose links are `slow_factor` times slower")
    slow_factor: float = Field(1.0, ge=1)
    announce_s: float = Field(1.0, ge=0, description="DHT: from a holder's apply to readers seeing its record")

    @model_validator(mode="after")
    def _regions(self) -> Network:
        unknown = sorted(set(self.region_shares) - set(REGIONS))
        if unknown:
            raise ValueError(f"network.region_shares: unknown region(s) {unknown} (known: {', '.join(REGIONS)})")
        if any(v < 0 for v in self.region_shares.values()) or sum(self.region_shares.values()) <= 0:
            raise ValueError("network.region_shares: shares must be >= 0 and not all zero")
        if self.slow_region and self.slow_region not in REGIONS:
            raise ValueError(f"network.slow_region: unknown region {self.slow_region!r}")
        return self


class Cheating(Strict):
    """Cheaters: a share of all workers, spread evenly over `modes` (default: every red-team mode)."""

    share: float = Field(0.0, ge=0, le=1, description="share of workers that cheat")
    modes: list[str] = Field(default_factory=lambda: list(MODES))

    @model_validator(mode="after")
    def _modes(self) -> Cheating:
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise ValueError(f"cheaters.modes: unknown mode(s) {bad} (known: {', '.join(MODES)})")
        if self.share > 0 and not self.modes:
            raise ValueError("cheaters.modes: a share > 0 needs at least one mode")
        return self


class Validation(Strict):
    """The validators: how many, how often they sample, and what a check costs."""

    validators: int = Field(2, ge=0)
    sample_rate: float = Field(0.25, ge=0, le=1, description="base rate (validator config sample_rate)")
    regrade_s: float = Field(0.05, ge=0, description="validator time per regraded group")
    prefill_s: float = Field(0.2, ge=0, description="validator time per log-prob recomputation (one prefill)")
    poll_s: float = Field(1.0, gt=0, description="validator round period")
    probation_s: float = Field(60.0, ge=0)
    probation_ends: Literal["age", "age_or_last_chance"] = Field(
        "age_or_last_chance", description="when a group of an unchecked peer may be trained: 'age' once it is "
        "probation_s old (the rule before); 'age_or_last_chance' also at the last step that can still train it "
        "(its version at the step's staleness floor: the product's rule, JobRuntime.trainable_cutoff)")


class Gossip(Strict):
    """Delta gossip between workers (worker config peer_wait_s, max_gap, ...)."""

    peer_wait_s: float = Field(1.0, ge=0, description="worker config peer_wait_s")
    max_gap: int = Field(8, ge=1)
    sync_poll_s: float = Field(0.5, gt=0, description="worker config sync_poll_s (prefetch of a newer version)")
    max_peer_attempts: int = Field(delta_sources.MAX_PEER_ATTEMPTS, ge=0, description="worker config "
                                   "max_peer_attempts: peers asked per update before the trainer (0: every holder)")
    wait_rule: str = Field(delta_sources.WAIT_RULE, description="worker config wait_rule (CatchUp): 'fixed*' wait "
                           "up to peer_wait_s for a holder, 'scaled*' up to peer_wait_s * log2(previous version's "
                           "holders / 128) (delta_sources.wait_ceiling_s); '*-whole' wait the whole drawn share, "
                           "then ask a random holder, the others the first holder seen (delta_sources.waits_whole)")
    snapshot_rule: str = Field(snapshot_sources.SNAPSHOT_RULE, description="worker config snapshot_rule: "
                               "'rebuilt' every peer serves its newest keep_snapshots versions as snapshots, "
                               "'received' only snapshots it received (the rule before; protocol/snapshot_sources)")
    keep_snapshots: int = Field(snapshot_sources.KEEP_SNAPSHOTS, ge=1, description="worker config keep_snapshots")
    max_snapshot_streams: int = Field(snapshot_sources.MAX_STREAMS, ge=0,
                                      description="worker config max_snapshot_streams: snapshots a peer serves at once")
    trainer_snapshot_streams: int = Field(snapshot_sources.TRAINER_SNAPSHOT_STREAMS, ge=0, description="trainer "
                                          "config max_snapshot_streams: snapshots a trainer serves workers at once, "
                                          "past it 'snapshot_busy' (0: no bound)")
    snapshot_wait: bool = Field(True, description="a joiner finding no peer's snapshot waits a random share of "
                                "peer_wait_s for one before its trainer (the product's CatchUp; false: the "
                                "simulator before issue 24, which asked the trainer at once)")
    trainer_fanout: int = Field(0, ge=0, description="what-if: the trainer serves each delta to at most this many "
                                "workers, the others wait for a peer (0: unlimited, the product today)")

    @model_validator(mode="after")
    def _rule(self) -> Gossip:
        if self.wait_rule not in delta_sources.WAIT_RULES:
            raise ValueError(f"gossip.wait_rule: unknown rule {self.wait_rule!r} "
                             f"(known: {', '.join(delta_sources.WAIT_RULES)})")
        if self.snapshot_rule not in snapshot_sources.SNAPSHOT_RULES:
            raise ValueError(f"gossip.snapshot_rule: unknown rule {self.snapshot_rule!r} "
                             f"(known: {', '.join(snapshot_sources.SNAPSHOT_RULES)})")
        return self


class Trainers(Strict):
    """The trainers: how many co-train the job, averaging and loss of one."""

    count: int = Field(1, ge=1)
    averaging_timeout_s: float = Field(5.0, ge=0, description="how long a ready trainer waits for cotrainers "
                                       "(join_rounds false)")
    join_rounds: bool = Field(True, description="a trainer without a full batch joins a cotrainer's round at once "
                              "with the trainable groups it has (the product's TrainerNode.step: ready() or "
                              "peer_round_open()); false: the rule before, it sits the step out and the round waits "
                              "averaging_timeout_s for it to have a full batch")
    lost_at_s: float = Field(-1.0, description="when one trainer dies (< 0: never)")
    reconnect_s: float = Field(30.0, ge=0, description="how long its workers take to move to another trainer")


class MarketJob(Strict):
    """A class of alike jobs in a market scenario: `count` jobs of this weight, batch and trainers;
    every other knob is the scenario's `job`."""

    count: int = Field(1, ge=1)
    weight: float = Field(1.0, gt=0, le=MAX_WEIGHT)
    batch_groups: int = Field(64, ge=1, description="groups per trainer per step (with batch_max: the fewest)")
    batch_max: int = Field(0, ge=0, description="elastic intake: the most groups per step (0: no range)")
    trainers: int = Field(1, ge=1, description="trainers co-training each job of the class")


class Market(Strict):
    """Many jobs sharing the workers (issue 24). No `jobs`: the single job of `job` and `trainers`."""

    jobs: list[MarketJob] = Field(default_factory=list)
    choice: Literal["demand", "walk"] = Field(
        "demand", description="how a worker picks its job: 'demand' the product's rule (protocol.market.choose_job "
        "over the records' capacity, intake and weight; a job kept while its trainer grants leases, left at once "
        "on 'busy'); 'walk' the rule before (every live job in turn, one lease each, whatever it needs)")
    record_every_s: float = Field(10.0, gt=0, description="how often a trainer refreshes its job record's demand "
                                  "(node/swarm/dht.REFRESH_S); workers choose on the last one")
    follow_idle_s: float = Field(FOLLOW_IDLE_S, ge=0, description="a worker stops following (prefetching the versions "
                                 "of) a job it did not choose for this long (worker config follow_idle_s, "
                                 "protocol.market.follows; 0: every job it chose, until the job ends or it leaves)")
    follow_on: Literal["choice", "grant"] = Field(
        "choice", description="what keeps a worker following a job for follow_idle_s: 'choice' (a round chose "
        "it) or 'grant' (its trainer granted this worker a lease; a worker refused by a job that granted it "
        "none within follow_idle_s stops following it at once, after the catch-up its choice made)")

    def shapes(self, base: JobShape) -> list[tuple[JobShape, int]]:
        """(job knobs, trainers) of every job, class by class."""
        return [(base.model_copy(update={"weight": c.weight, "batch_groups": c.batch_groups, "batch_max": c.batch_max}),
                 c.trainers)
                for c in self.jobs for _ in range(c.count)]


class Scenario(Strict):
    """One simulated run."""

    name: str = "custom"
    seed: int = 0
    hours: float = Field(1.0, gt=0)
    workers: int = Field(100, ge=1, description="workers at the start")
    gpu_mix: dict[str, float] = Field(default_factory=lambda: {"rtx3060": 0.3, "rtx3090": 0.3, "rtx4090": 0.25,
                                                               "a100": 0.15})
    job_start_s: float = Field(0.0, ge=0, description="from submission to the job's record being found")
    timeline_every_s: float = Field(60.0, gt=0)
    job: JobShape = JobShape()
    trainers: Trainers = Trainers()
    churn: Churn = Churn()
    network: Network = Network()
    cheaters: Cheating = Cheating()
    validation: Validation = Validation()
    gossip: Gossip = Gossip()
    market: Market = Market()

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        unknown = sorted(set(self.gpu_mix) - set(GPU_CLASSES))
        if unknown:
            raise ValueError(f"gpu_mix: unknown GPU class(es) {unknown} (known: {', '.join(GPU_CLASSES)})")
        if any(v < 0 for v in self.gpu_mix.values()) or sum(self.gpu_mix.values()) <= 0:
            raise ValueError("gpu_mix: shares must be >= 0 and not all zero")
        if self.trainers.count > self.workers:
            raise ValueError(f"trainers.count: {self.trainers.count} trainers for {self.workers} workers "
                             "(more trainers than peers)")
        if self.trainers.lost_at_s >= 0 and self.trainers.count < 2:
            raise ValueError("trainers.lost_at_s: losing the only trainer ends the job; use count >= 2")
        if self.market.jobs:
            trainers = sum(c.count * c.trainers for c in self.market.jobs)
            if trainers > self.workers:
                raise ValueError(f"market.jobs: {trainers} trainers for {self.workers} workers (more trainers than peers)")
            if self.trainers.lost_at_s >= 0:
                raise ValueError("trainers.lost_at_s: a trainer's loss is not simulated in a market (market.jobs)")
            for i, (shape, _) in enumerate(self.market.shapes(self.job)):
                try:
                    shape.spec()
                except ValidationError as exc:
                    raise ValueError(f"market.jobs: job {i} is beyond the product's bounds ({scenario_error(exc)})") from None
        return self

    @property
    def seconds(self) -> float:
        """The simulated duration, `hours` in seconds."""
        return self.hours * 3600.0


CHURN_PRESETS: dict[str, dict[str, float]] = {
    "none": {"joins_per_hour": 0.0, "median_session_s": 0.0},
    "low": {"joins_per_hour_per_worker": 0.1, "median_session_s": 4 * 3600.0},
    # a third of the workers gone within the hour: Lomax (Pareto II) at tail index 1.2 with median
    # 7000 s has P(session < 1 h) = 1 - (1 + 3600/8957)**-1.2 = 0.33; joins replace them
    "high": {"joins_per_hour_per_worker": 0.35, "median_session_s": 7000.0},
}


def churn_preset(name: str, workers: int) -> dict[str, float]:
    """`--churn none|low|high` as Churn fields for `workers` starting workers."""
    if name not in CHURN_PRESETS:
        raise ValueError(f"churn: unknown preset {name!r} (known: {', '.join(CHURN_PRESETS)})")
    p = dict(CHURN_PRESETS[name])
    p["joins_per_hour"] = p.pop("joins_per_hour_per_worker", 0.0) * workers
    return p


def load_scenario(path: Path | None, overrides: dict[str, Any] | None = None) -> Scenario:
    """A scenario from a TOML file (or the defaults) with nested `overrides` on top."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"scenario: no such file {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"scenario: {path} is not valid TOML ({exc})") from None
    return Scenario.model_validate(_merge(data, overrides or {}))


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def scenario_error(exc: ValidationError) -> str:
    """One line naming the first offending field."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    return f"{where}: {msg}" if where and not msg.startswith(where) else msg
