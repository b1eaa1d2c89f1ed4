"""The `swarmrl simulate` flags, apart from the simulator so the command line can build its parser
without importing it (node/cli/main.py imports swarmrl.simulations.run only when the command runs)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `simulate` subcommand's flags (each overrides the scenario file's field)."""
    p.add_argument("--scenario", type=Path, help="scenario TOML (simulations/scenarios/*.toml)")
    p.add_argument("--workers", type=int, help="workers at the start")
    p.add_argument("--trainers", type=int, help="trainers of the job (they average gradients)")
    p.add_argument("--hours", type=float, help="simulated hours")
    p.add_argument("--cheaters", type=float, help="share of cheating workers, spread over the red-team modes")
    p.add_argument("--churn", choices=["none", "low", "high"], help="churn preset")
    p.add_argument("--seed", type=int, help="random seed (default: the scenario's, 0)")
    p.add_argument("--out", type=Path, default=Path("runs/simulate"), help="folder for summary.json, timeline.csv, plots")
    p.add_argument("--dry-run", action="store_true", help="print the resolved scenario and exit")
