"""How long each role takes to end after SIGTERM, children included, on an idle machine and under a
background CPU load (issue 28: the lifecycle tests' bound is set from these figures).

Each role (`swarmrl bootstrap | trainer | worker | validator`, the tiny model, threads=1) is started
as a real process, waited on until it serves (its ready file), sent SIGTERM, and timed until its
process and every descendant (DHT process, p2pd) are gone. The load is `--load N` busy Python
processes at normal priority (a load average of about N on top of whatever else runs).

    .venv/bin/python benchmarks/exit_under_load.py --load 0 8 --repeats 3

Prints, per load and role, the median and the largest exit time in seconds, and the largest over
the lifecycle module's hard bound (SHUTDOWN_GRACE_S + CHILD_GRACE_S).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from swarmrl.node.models.base_model import default_cache_dir, prepare_base_model
from swarmrl.node.runtime import procs
from swarmrl.node.runtime.lifecycle import CHILD_GRACE_S, SHUTDOWN_GRACE_S

ROLES = ("bootstrap", "trainer", "worker", "validator")


def _start(role: str, tmp: Path, cache: Path) -> tuple[subprocess.Popen, Path]:
    ready = tmp / f"{role}.ready"
    args = [sys.executable, "-m", "swarmrl.node.cli.main", role, "-o", f"ready_file={json.dumps(str(ready))}"]
    if role != "bootstrap":
        args += ["-o", f"key={json.dumps(str(tmp / (role + '.key')))}", "-o", "threads=1",
                 "-o", f"cache_dir={json.dumps(str(cache))}"]
    if role in ("trainer", "validator"):
        args += ["-o", f"state_dir={json.dumps(str(tmp / role))}"]
    if role == "worker":
        args += ["-o", 'base_model="tiny"']
    log = open(tmp / f"{role}.log", "wb")   # noqa: SIM115 - closed with the process below
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, ready


def exit_seconds(role: str, cache: Path) -> float:
    """Start `role`, wait until it serves, SIGTERM it; seconds until it and its descendants are gone.

    Raises:
        RuntimeError: the role exited before serving, or did not serve within 300 s.
    """
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        proc, ready = _start(role, tmp, cache)
        deadline = time.monotonic() + 300
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{role} did not serve: {(tmp / f'{role}.log').read_text()[-2000:]}")
            time.sleep(0.1)
        tree = procs.descendants(proc.pid)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        while any(procs.alive(p) for p in tree):
            time.sleep(0.02)
        return time.monotonic() - t0


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    """Parse arguments, measure each load in turn, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--load", type=int, nargs="+", default=[0, 8], help="busy processes per run")
    ap.add_argument("--repeats", type=int, default=3, help="exits measured per role and load")
    ap.add_argument("--roles", nargs="+", default=list(ROLES), choices=ROLES)
    args = ap.parse_args()
    cache = default_cache_dir()
    prepare_base_model("tiny", cache)
    bound = SHUTDOWN_GRACE_S + CHILD_GRACE_S
    print(f"{'load':>4} {'role':<10} {'median_s':>8} {'max_s':>6} {'max/bound':>9}   (bound {bound:.1f} s; "
          f"load average at start shown per row)")
    for n in args.load:
        busy = _busy(n)
        try:
            time.sleep(3 if n else 0)
            for role in args.roles:
                la = os.getloadavg()[0]
                times = [exit_seconds(role, cache) for _ in range(args.repeats)]
                print(f"{n:>4} {role:<10} {statistics.median(times):>8.2f} {max(times):>6.2f} "
                      f"{max(times) / bound:>9.2f}   la={la:.1f}", flush=True)
        finally:
            for p in busy:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
