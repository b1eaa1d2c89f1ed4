"""Does a long-lived idle connection survive our server's keepalive enforcement? (issue 11)

    .venv/bin/python -m benchmarks.keepalive_soak --seconds 600       # the 10-minute check
    .venv/bin/python -m benchmarks.keepalive_soak --seconds 70 --old  # grpc's default enforcement

A real trainer server on 127.0.0.1 and three clients (the product's options, and standard clients
pinging every 30 s and every 10 s), each holding an idle channel and an idle health `Watch`
stream for `--seconds` (tests/integration/keepalive_clients.py says what each is and how a
GOAWAY shows). Prints what each channel saw; `--json PATH` writes the result as JSON too.

The 10-minute soak test runs this in the background from the start of the test session
(tests/conftest.py, with `--json` and `--parent-pid`); `--parent-pid` makes it exit as soon as
the run's controlling process is gone, so a test run killed outright leaves no soak behind.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

from swarmrl.node.net import grpc_options
from swarmrl.node.net.grpc_options import channel_options
from tests.integration.keepalive_clients import soak


def _exit_with_parent(pid: int) -> None:
    """Exit this process (at once, code 3) once process `pid` (the test run's controller: our
    parent, or the parent of the xdist worker that started us) is gone."""
    def watch() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(3)
            time.sleep(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> None:
    """Serve an empty trainer on loopback and hold every client on it; print what each saw."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--standard-ping-s", type=float, nargs="+", default=[30.0, 10.0])
    ap.add_argument("--old", action="store_true", help="grpc's default server enforcement (as before issue 11)")
    ap.add_argument("--json", type=Path, help="also write the result here (written when the hold ends)")
    ap.add_argument("--parent-pid", type=int, help="exit as soon as this process (the test run's) is gone")
    args = ap.parse_args()
    if args.parent_pid is not None:
        _exit_with_parent(args.parent_pid)
    if args.old:   # the server options before issue 11: no ping enforcement settings
        grpc_options.server_options = lambda mb: [*channel_options(mb), ("grpc.so_reuseport", 0)]
        import swarmrl.node.net.grpc_server as gs
        gs.server_options = grpc_options.server_options
    result = soak(args.seconds, tuple(args.standard_ping_s))
    for r in result.records:
        print(f"{r.client:14s} {r.kind:6s} survived={r.survived} states={r.states} stream_end={r.stream_end or '-'}")
    print(f"held {result.held_s:.0f} s; all survived: {result.survived}", flush=True)
    if args.json is not None:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(result.to_json())
        tmp.replace(args.json)   # whole or absent: the test never reads half a file


if __name__ == "__main__":
    main()
