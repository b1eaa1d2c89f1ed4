"""Does a long-lived idle connection survive our server's keepalive enforcement? (issue 11)

    .venv/bin/python benchmarks/keepalive_soak.py --seconds 600      # the 10-minute check
    .venv/bin/python benchmarks/keepalive_soak.py --seconds 70 --old  # grpc's default enforcement

Two clients connect to a trainer server (the real `serve`, an empty trainer behind it): one with
the product's own channel options (`grpc_options.channel_options`: a ping every 30 s, with or
without calls) and one "standard" client configured as a gRPC user typically would (a ping every
`standard_ping_s` with no call open and no cap on pings between data frames, as Go and Java
clients do). Each holds an idle channel and an idle
health `Watch` stream for `seconds`; a GOAWAY (e.g. "too_many_pings") would drop the connection:
the channel leaves READY and the stream ends. Used by the slow test (about 70 s) and by
this script's `--seconds 600` (10 minutes).
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field
from typing import ClassVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]  # no stubs installed

from swarmrl.node import grpc_options
from swarmrl.node.grpc_options import channel_options
from swarmrl.node.trainer.service import serve


@dataclass
class ClientRecord:
    """What one client saw: its channel's connectivity states and how its stream ended."""

    name: str
    states: list[str] = field(default_factory=list)
    stream_end: str = ""    # "" while the stream is open

    @property
    def survived(self) -> bool:
        """True if the connection stayed READY (after first becoming READY) and the stream open."""
        ready_from = self.states.index("READY") if "READY" in self.states else len(self.states)
        return ready_from < len(self.states) and all(s == "READY" for s in self.states[ready_from:]) \
            and not self.stream_end


def _hold(name: str, endpoint: str, options: list[tuple[str, int]], seconds: float) -> ClientRecord:
    rec = ClientRecord(name)
    channel = grpc.insecure_channel(endpoint, options=options)
    channel.subscribe(lambda s: rec.states.append(s.name), try_to_connect=True)
    stub = health_pb2_grpc.HealthStub(channel)
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))

    def read() -> None:
        try:
            for _ in watch:   # SERVING once, then silence until the status changes
                pass
            rec.stream_end = "ended"
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED or not stopping.is_set():
                rec.stream_end = f"{exc.code().name}: {exc.details()}"
    stopping = threading.Event()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(seconds)
    stopping.set()
    watch.cancel()
    reader.join(5)
    channel.close()
    return rec


def keepalive_survival(endpoint: str, seconds: float, standard_ping_s: float = 30.0,
                       max_message_mb: int = 64) -> list[ClientRecord]:
    """Hold both clients' idle channels and streams on `endpoint` for `seconds` at once."""
    # as a Go or Java client with keepalive on pings: every `standard_ping_s`, with no call open,
    # without C core's default cap of 2 pings between data frames
    standard = [("grpc.keepalive_time_ms", int(standard_ping_s * 1000)), ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0)]
    clients = {"product": channel_options(max_message_mb), f"standard-{standard_ping_s:g}s": standard}
    out: list[ClientRecord] = []
    threads = [threading.Thread(target=lambda n=n, o=o: out.append(_hold(n, endpoint, o, seconds)))
               for n, o in clients.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(out, key=lambda r: r.name)


class _NoJobs:
    jobs: ClassVar[dict[str, object]] = {}


def main() -> None:
    """Serve an empty trainer on loopback and hold both clients on it; print what each saw."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--standard-ping-s", type=float, default=30)
    ap.add_argument("--old", action="store_true", help="grpc's default server enforcement (as before issue 11)")
    args = ap.parse_args()
    if args.old:   # the server options before issue 11: no ping enforcement settings
        grpc_options.server_options = lambda mb: [*channel_options(mb), ("grpc.so_reuseport", 0)]
        import swarmrl.node.grpc_server as gs
        gs.server_options = grpc_options.server_options
    server, port = serve(_NoJobs(), "127.0.0.1", 0, 64)  # type: ignore[arg-type]  # serves no job
    t0 = time.monotonic()
    records = keepalive_survival(f"127.0.0.1:{port}", args.seconds, args.standard_ping_s)
    for r in records:
        print(f"{r.name:14s} survived={r.survived} states={r.states} stream_end={r.stream_end or '-'}")
    print(f"held {time.monotonic() - t0:.0f} s; all survived: {all(r.survived for r in records)}")
    server.stop(1).wait()


if __name__ == "__main__":
    main()
