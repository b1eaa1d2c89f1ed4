"""Run some tests again and again under a background CPU load (issue 28 item 1).

    .venv/bin/python benchmarks/under_load.py --runs 10 --burners 6 -- tests/integration/test_lifecycle.py

Starts `--burners` busy-loop processes (each keeps one core's run queue full: on 2 cores, 6
burners plus the tests' own processes give a load average of about 8), runs pytest on the given
arguments `--runs` times in a row, and prints each run's outcome, wall time and the 1-minute
load average at its end, then the count that passed. The burners are killed at the end, on a
failure and on SIGTERM / Ctrl-C. Exit code 0 only when every run passed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

BURN = "import os, signal\nsignal.signal(signal.SIGTERM, lambda *_: os._exit(0))\nwhile True:\n    pass\n"


def main() -> int:
    """Parse the arguments, run the tests under load; returns the exit code."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--burners", type=int, default=6, help="busy-loop processes beside the tests")
    ap.add_argument("pytest_args", nargs="+", help="what pytest runs (after --)")
    args = ap.parse_args()
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(args.burners)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    passed = 0
    try:
        time.sleep(5)   # let the load average climb
        for run in range(1, args.runs + 1):
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.pytest_args],
                                  capture_output=True, text=True, check=False)
            seconds, load = time.monotonic() - t0, os.getloadavg()[0]
            last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
            passed += proc.returncode == 0
            print(f"run {run:2d}: exit {proc.returncode}  {seconds:6.1f} s  load {load:4.1f}  {last}", flush=True)
            if proc.returncode != 0:
                print(proc.stdout[-4000:], flush=True)
    finally:
        for b in burners:
            b.terminate()
        for b in burners:
            b.wait()
    print(f"{passed}/{args.runs} runs passed with {args.burners} burners")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
