"""Long-lived idle gRPC connections held against a real trainer server, to see whether keepalive
pings get them closed (issue 11). Shared by benchmarks/keepalive_soak.py (which prints what it
saw, or writes it as JSON) and the 10-minute soak test (tests/integration/test_grpc_keepalive.py,
which tests/conftest.py starts in the background as that benchmark at the start of the session).

Each client dials the server twice: one channel with no call at all (keepalive pings "without
calls") and one holding a health `Watch` stream, which speaks once (SERVING) and then stays
silent (pings "without data"). The clients:

- "product": our own channel options (`grpc_options.channel_options`: a ping every 30 s, with or
  without calls, no cap on pings without data);
- "standard-Ns": a gRPC user's typical keepalive configuration, a ping every N seconds with no
  call open and no cap on pings between data frames (as Go and Java clients do); N = 30 (the
  usual choice) and N = 10 (the floor our servers permit, so a server that enforced more would
  answer it with GOAWAY within half a minute).

A GOAWAY (e.g. "too_many_pings") drops the connection: the channel leaves READY and its stream
ends. grpc's C core also logs such a GOAWAY on stderr ("Received a GOAWAY with error code
ENHANCE_YOUR_CALM and debug data equal to "too_many_pings""), which the soak test checks too.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]  # no stubs installed

from swarmrl.node.net.grpc_options import channel_options
from swarmrl.node.runtime.limits import GrpcLimits

GOAWAY_MARKERS = ("GOAWAY", "too_many_pings")   # what grpc's C core logs on stderr when it gets one


@dataclass
class ChannelRecord:
    """What one channel saw: its connectivity states in order, and how its stream ended.

    kind: "idle" (no call ever) or "stream" (one health Watch held open); stream_end: "" while
    the stream was open when the hold ended (always "" for an idle channel).
    """

    client: str
    kind: str
    states: list[str] = field(default_factory=list)
    stream_end: str = ""

    @property
    def survived(self) -> bool:
        """True if the channel became READY and stayed READY to the end, with its stream open."""
        if "READY" not in self.states:
            return False
        ready_from = self.states.index("READY")
        return all(s == "READY" for s in self.states[ready_from:]) and not self.stream_end


@dataclass
class SoakResult:
    """One hold of every client's channels: how long it was asked to last, how long it did, and
    each channel's record."""

    seconds: float
    held_s: float
    records: list[ChannelRecord]

    @property
    def survived(self) -> bool:
        """Every channel survived, and the hold lasted the time asked."""
        return bool(self.records) and all(r.survived for r in self.records) and self.held_s >= self.seconds

    def to_json(self) -> str:
        """The result as JSON (`from_json` reads it back)."""
        return json.dumps({"seconds": self.seconds, "held_s": self.held_s, "survived": self.survived,
                           "records": [asdict(r) for r in self.records]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> SoakResult:
        """Parse `to_json`'s output (raises KeyError/ValueError on anything else)."""
        d: dict[str, Any] = json.loads(text)
        return cls(float(d["seconds"]), float(d["held_s"]), [ChannelRecord(**r) for r in d["records"]])


def client_options(standard_ping_s: tuple[float, ...] = (30.0, 10.0),
                   max_message_mb: int = 64) -> dict[str, list[tuple[str, int]]]:
    """Channel options per client name: "product", then one "standard-Ns" per ping interval."""
    clients = {"product": channel_options(max_message_mb)}
    for s in standard_ping_s:
        clients[f"standard-{s:g}s"] = [("grpc.keepalive_time_ms", int(s * 1000)),
                                       ("grpc.keepalive_permit_without_calls", 1),
                                       ("grpc.http2.max_pings_without_data", 0)]
    return clients


def _idle(client: str, endpoint: str, options: list[tuple[str, int]], done: threading.Event) -> ChannelRecord:
    rec = ChannelRecord(client, "idle")
    channel = grpc.insecure_channel(endpoint, options=options)
    channel.subscribe(lambda s: rec.states.append(s.name), try_to_connect=True)
    done.wait()
    channel.close()
    return rec


def _stream(client: str, endpoint: str, options: list[tuple[str, int]], done: threading.Event) -> ChannelRecord:
    rec = ChannelRecord(client, "stream")
    channel = grpc.insecure_channel(endpoint, options=options)
    channel.subscribe(lambda s: rec.states.append(s.name), try_to_connect=True)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))

    def read() -> None:
        try:
            for _ in watch:   # SERVING once, then silence until the status changes
                pass
            rec.stream_end = "ended"
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED or not done.is_set():
                rec.stream_end = f"{exc.code().name}: {exc.details()}"
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    done.wait()
    watch.cancel()
    reader.join(5)
    channel.close()
    return rec


def keepalive_survival(endpoint: str, seconds: float,
                       clients: dict[str, list[tuple[str, int]]] | None = None) -> list[ChannelRecord]:
    """Hold every client's idle channel and Watch stream on `endpoint` for `seconds`, all at once
    (clients: name -> channel options, default `client_options()`); records sorted by client, kind."""
    done = threading.Event()
    out: list[ChannelRecord] = []
    lock = threading.Lock()

    def run(hold: Any, name: str, options: list[tuple[str, int]]) -> None:
        rec = hold(name, endpoint, options, done)
        with lock:
            out.append(rec)
    threads = [threading.Thread(target=run, args=(hold, n, o), daemon=True)
               for n, o in (clients or client_options()).items() for hold in (_idle, _stream)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    done.set()
    for t in threads:
        t.join(10)
    return sorted(out, key=lambda r: (r.client, r.kind))


class _NoJobs:
    jobs: ClassVar[dict[str, object]] = {}


def soak(seconds: float, standard_ping_s: tuple[float, ...] = (30.0, 10.0)) -> SoakResult:
    """Serve an empty trainer (the real `serve`, loopback, any free port) and hold every client's
    channels on it for `seconds` (`keepalive_survival`).

    The server's stream deadline is set past the hold (default 600 s, which would end the Watch
    streams of a 600 s hold at the same moment): what is measured is keepalive, not the deadline.
    """
    from swarmrl.node.trainer.service import serve

    limits = GrpcLimits(stream_deadline_s=seconds + 120)
    server, port = serve(_NoJobs(), "127.0.0.1", 0, 64, limits=limits)  # type: ignore[arg-type]  # serves no job
    try:
        t0 = time.monotonic()
        records = keepalive_survival(f"127.0.0.1:{port}", seconds, client_options(standard_ping_s))
        return SoakResult(seconds, time.monotonic() - t0, records)
    finally:
        server.stop(1).wait()
