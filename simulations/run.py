"""`swarmrl simulate`: build a scenario, run it, write summary.json, timeline.csv and plots.

Exit codes: 0 done, 2 bad scenario (one line naming the field), 130 interrupted (Ctrl-C or
SIGTERM: the run stops at the next slice of simulated time, writes what it has and says how far
it got).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from swarmrl.protocol import snapshot_sources
from swarmrl.simulations.market_figures import market_summary
from swarmrl.simulations.market_world import MarketWorld
from swarmrl.simulations.metrics import summarize, write_outputs
from swarmrl.simulations.scenario import Scenario, churn_preset, load_scenario, scenario_error
from swarmrl.simulations.world import World


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The scenario file (or defaults) with the command-line flags on top. Raises ValueError."""
    top: dict[str, Any] = {}
    if args.workers is not None:
        top["workers"] = args.workers
    if args.trainers is not None:
        top["trainers"] = {"count": args.trainers}
    if args.hours is not None:
        top["hours"] = args.hours
    if args.cheaters is not None:
        top["cheaters"] = {"share": args.cheaters}
    if args.seed is not None:
        top["seed"] = args.seed
    try:
        sc = load_scenario(args.scenario, top)
        if args.churn is not None:
            sc = load_scenario(args.scenario, {**top, "churn": churn_preset(args.churn, sc.workers)})
    except ValidationError as exc:
        raise ValueError(scenario_error(exc)) from None
    return sc


GC_THRESHOLDS = (100_000, 50, 100)
"""The cyclic garbage collector's thresholds while a simulation runs (CPython's default: 700, 10,
10). A 10,000-worker hour keeps millions of objects alive (714 MB peak) and allocates in bursts
(10k decisions per version), so the default thresholds collect again and again over survivors:
py-spy, on a loaded machine, found 35% of a 10k run in `gc_collect_main`. Reference counting still frees nearly everything at
once; these thresholds only make the cycle collector run less often (same peak memory: 10k
workers x 0.1 h, 142 MB either way). The figures: simulations/README.md, "Speed"."""


@contextlib.contextmanager
def fewer_collections(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> Iterator[None]:
    """Run the body with the cycle collector's `thresholds`, then restore the previous ones."""
    before = gc.get_threshold()
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def snapshot_figures(by_source: dict[str, int], refused: int, trainer_refused: int) -> dict[str, Any]:
    """The joiners' snapshot bytes by source, the trainers' share of them
    (`snapshot_sources.trainer_share`) and the snapshot requests peers and trainers refused at
    their stream bounds."""
    return {"bytes": dict(by_source), "refused": refused, "trainer_refused": trainer_refused,
            "trainer_share": round(snapshot_sources.trainer_share(by_source["peer"], by_source["trainer"]), 4)}


def simulate(sc: Scenario, out: Path | None, *, should_stop: Callable[[], bool] = lambda: False,
             progress: Callable[[float], None] | None = None) -> dict[str, Any]:
    """Run `sc`; write its outputs under `out` (None: write nothing); returns the summary."""
    t0 = time.monotonic()
    if sc.market.jobs:
        return simulate_market(sc, out, should_stop=should_stop, progress=progress)
    with fewer_collections():
        world = World(sc)
        reached = world.run(sc.seconds, should_stop, slice_s=10.0, progress=progress)
    interrupted = reached < sc.seconds and not world.done
    summary = summarize(world.metrics, scenario=sc.model_dump(), sim_s=reached, wall_s=time.monotonic() - t0,
                        version=world.version, workers=world.workers, spreads=world.gossip.spreads,
                        trainer_bytes=world.gossip.trainer_bytes, peer_bytes=world.gossip.peer_bytes,
                        trainers=sc.trainers.count, interrupted=interrupted, job_start_s=sc.job_start_s,
                        fetches_failed=world.gossip.failed, uplink_queue_s_max=world.gossip.queue_s_max,
                        events={"simpy": world.simpy_events(), "gossip": world.gossip.events})
    summary["snapshots"] = snapshot_figures(world.gossip.snapshot_sent, world.gossip.snapshot_refused,
                                            world.gossip.trainer_refused)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "scenario.json").write_text(sc.model_dump_json(indent=2) + "\n")
        write_outputs(out, summary, world.metrics, world.gossip.spreads)
    return summary


def simulate_market(sc: Scenario, out: Path | None, *, should_stop: Callable[[], bool] = lambda: False,
                    progress: Callable[[float], None] | None = None) -> dict[str, Any]:
    """Run a market scenario (`sc.market.jobs`); write scenario.json and summary.json under `out`
    (None: write nothing); returns the summary (`market_figures.market_summary`)."""
    t0 = time.monotonic()
    with fewer_collections():
        mw = MarketWorld(sc)
        reached = mw.run(sc.seconds, should_stop, slice_s=10.0, progress=progress)
    summary = market_summary(mw, sim_s=reached, wall_s=time.monotonic() - t0,
                             interrupted=reached < sc.seconds and not mw.done)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "scenario.json").write_text(sc.model_dump_json(indent=2) + "\n")
        (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def main(args: argparse.Namespace) -> int:
    """The command: 0 done, 2 bad scenario, 130 interrupted."""
    try:
        sc = scenario_from_args(args)
    except ValueError as exc:
        print(f"swarmrl simulate: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(sc.model_dump_json(indent=2))
        return 0
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        summary = simulate(sc, args.out, should_stop=lambda: bool(stop["signal"]),
                           progress=lambda t: print(f"\rsimulated {t / 3600:.2f} h of {sc.hours:g} h",
                                                    end="", file=sys.stderr, flush=True) if int(t) % 600 == 0 else None)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    print(file=sys.stderr)
    market = "per_job" in summary
    keys = ("versions", "groups_trained_per_hour", "wasted_share_total", "fairness", "honest_banned", "wall_s") \
        if market else ("versions", "versions_per_hour", "groups_admitted", "wasted_share_total", "honest_banned", "wall_s")
    print(json.dumps({k: summary[k] for k in keys}))
    if summary["interrupted"]:
        print(f"swarmrl simulate: interrupted at simulated {summary['simulated_s']:.0f} s of {sc.seconds:.0f} s "
              f"(version {summary['versions']}); partial outputs in {args.out}", file=sys.stderr)
        return 130
    print(f"outputs in {args.out}: " + ("summary.json, scenario.json" if market else "summary.json, timeline.csv, swarm.png"),
          file=sys.stderr)
    return 0
