"""Lease latency with and without slow downloaders holding streams (issue 11 item 4), for the
trainer's gRPC server now and at an older commit, in one run.

    .venv/bin/python benchmarks/lease_latency.py            # vs 7a25018 (one pool of 8 threads)

Each child process serves the real `TrainerService` over loopback with an in-memory trainer
behind it (tests/unit/grpc_fakes.py: leases granted at once, 64 MiB adapter downloads), times
`--calls` signed lease requests, then opens `--downloaders` adapter downloads that read one chunk
and stop reading, and times lease requests again (1 s timeout each; after 16 unanswered in a row
it stops). Prints p50/p99 and how many were answered, old and new, with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from old_code import OLD_REF, ROOT, old_tree  # benchmarks/old_code.py (run as a script)


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def _leases(endpoint: str, calls: int) -> tuple[list[float], int]:
    import grpc

    from swarmrl.protocol.identity import Identity
    from tests.unit.grpc_fakes import lease_request, stub

    channel, s = stub(endpoint)
    waits, missed = [], 0
    for _ in range(calls):
        request = lease_request(Identity.generate())   # a peer per call: no per-peer rate limit in the way
        t0 = time.perf_counter()
        try:
            reply = s.RequestLease(request, timeout=1.0)
            assert reply.HasField("lease"), reply.reason
            waits.append(time.perf_counter() - t0)
            missed = 0
        except grpc.RpcError as exc:
            print("lease failed:", exc.code(), exc.details(), file=sys.stderr)
            missed += 1
            if missed >= 16:
                break
    channel.close()
    return waits, len(waits)


def measure(calls: int, downloaders: int) -> dict[str, float]:
    """Lease latencies (ms) without and with slow downloaders, on a fresh server."""
    from swarmrl.node.trainer.service import serve
    from tests.unit.grpc_fakes import FakeTrainer, SlowDownloader

    _server, port = serve(FakeTrainer(), "127.0.0.1", 0, 64)   # kept serving until the child exits
    endpoint = f"127.0.0.1:{port}"
    calm, _ = _leases(endpoint, calls)
    slow = [SlowDownloader(endpoint, f"slow-{i}") for i in range(downloaders)]
    deadline = time.monotonic() + 5
    for d in slow:
        d.first.wait(max(0.0, deadline - time.monotonic()))
    loaded, answered = _leases(endpoint, calls)
    return {"p50_ms": _pct(calm, 0.5), "p99_ms": _pct(calm, 0.99), "loaded_p50_ms": _pct(loaded, 0.5),
            "loaded_p99_ms": _pct(loaded, 0.99), "answered": answered, "holding": sum(d.first.is_set() and d.error is None
                                                                                       for d in slow)}


def _child(args: argparse.Namespace, pythonpath: Path | None) -> dict[str, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ":".join(str(p) for p in (pythonpath, ROOT, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, __file__, "--child", "--calls", str(args.calls), "--downloaders", str(args.downloaders)]
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=cwd, timeout=300).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    """Parse the options; as the parent, run old and new children and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--downloaders", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--old-ref", default=OLD_REF)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.calls, args.downloaders)), flush=True)
        os._exit(0)   # the old server's pool threads may still sit on cancelled streams
    rows: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        old = old_tree(args.old_ref, Path(tmp))
        for r in range(args.repeats):
            for name, path in (("old", old), ("new", None)):
                f = _child(args, path)
                rows[name].append(f)
                print(f"repeat {r + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in f.items()), flush=True)
    print(f"\nlease latency, {args.calls} calls; then with {args.downloaders} slow downloaders; median of {args.repeats}")
    med = {n: {k: statistics.median(x[k] for x in v) for k in v[0]} for n, v in rows.items()}
    for name, m in med.items():
        print(f"{name:3s}: without p50/p99 {m['p50_ms']:.1f}/{m['p99_ms']:.1f} ms; with: p50/p99 "
              f"{m['loaded_p50_ms']:.1f}/{m['loaded_p99_ms']:.1f} ms, answered {m['answered']:.0f}"
              f" (downloaders holding streams: {m['holding']:.0f})")
    print(f"new/old without downloaders: p50 x{med['new']['p50_ms'] / med['old']['p50_ms']:.2f},"
          f" p99 x{med['new']['p99_ms'] / med['old']['p99_ms']:.2f}")


if __name__ == "__main__":
    main()
