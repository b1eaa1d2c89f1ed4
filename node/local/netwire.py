"""A slow, lossy wire in user space: Ethernet frames between two interfaces, delayed and dropped.

Stands in for `tc qdisc add ... netem delay 80ms loss 1% rate 20mbit` where the kernel lacks
sch_netem (this workplace's does). It runs inside the test bed's hub namespace (node/local/netns.py)
between the two ends of one link: every frame that arrives on one interface leaves on the other
`delay_ms` later, unless it is dropped (probability `loss`), in both directions, in order. With
`rate_mbit` each direction is also a link of that rate: a frame is serialised once the frames
before it are (its bits over the rate), then delayed; a frame that would wait more than
`QUEUE_S` for the link is dropped (a full buffer), as a router's would be. The interfaces must
have their offloads off (no GSO/TSO super-frames, no partial checksums), which netns.py arranges.

    python -m swarmrl.node.local.netwire IF_A IF_B --delay-ms 80 --loss 0.01 [--rate-mbit 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4   # a frame this host sent (the relay's own writes, seen again): never forwarded
MAX_FRAME = 65536
QUEUE_S = 0.5   # a rate-limited direction's buffer, in seconds of the link's time


@dataclass
class WireStats:
    """Frames seen, forwarded and dropped in one direction."""

    seen: int = 0
    forwarded: int = 0
    dropped: int = 0


class Direction:
    """One direction of the wire: read frames from `src`, send them on `dst` after the delay."""

    def __init__(self, src: str, dst: str, delay_s: float, loss: float, rng: random.Random,
                 rate_bps: float = 0.0) -> None:
        self.src, self.dst, self.delay_s, self.loss, self.rng = src, dst, delay_s, loss, rng
        self.rate_bps, self.link_free = rate_bps, 0.0   # 0: no rate limit; when the link is next free
        self.rx = _packet_socket(src)
        self.tx = _packet_socket(dst)
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()
        self.stats = WireStats()

    def receive_forever(self) -> None:
        """Queue every frame that arrives on `src` (a constant delay keeps the queue in order)."""
        while True:
            frame, addr = self.rx.recvfrom(MAX_FRAME)
            if addr[2] == PACKET_OUTGOING:
                continue
            self.stats.seen += 1
            if self.rng.random() < self.loss:
                self.stats.dropped += 1
                continue
            now = time.monotonic()
            sent = now
            if self.rate_bps:
                start = max(now, self.link_free)
                if start - now > QUEUE_S:   # the buffer is full
                    self.stats.dropped += 1
                    continue
                sent = self.link_free = start + len(frame) * 8 / self.rate_bps
            with self.ready:
                self.queue.append((sent + self.delay_s, frame))
                self.ready.notify()

    def send_forever(self) -> None:
        """Send each queued frame on `dst` once its time has come."""
        while True:
            with self.ready:
                while not self.queue:
                    self.ready.wait()
                due, frame = self.queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                self.tx.send(frame)
                self.stats.forwarded += 1
            except OSError:   # a frame the link can't carry (too big): the wire loses it
                self.stats.dropped += 1


def _packet_socket(ifname: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.bind((ifname, 0))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    return s


def run_wire(if_a: str, if_b: str, delay_ms: float, loss: float, seed: int = 0,
             rate_mbit: float = 0.0) -> list[Direction]:
    """Start both directions in daemon threads; returns them (their `stats` count frames).
    rate_mbit: each direction's rate in Mbit/s (0: unlimited)."""
    if not 0 <= loss < 1 or delay_ms < 0 or rate_mbit < 0:
        raise ValueError(f"need 0 <= loss < 1, delay_ms >= 0 and rate_mbit >= 0 (got {loss}, {delay_ms}, {rate_mbit})")
    rng = random.Random(seed)
    bps = rate_mbit * 1e6
    dirs = [Direction(if_a, if_b, delay_ms / 1000, loss, rng, bps), Direction(if_b, if_a, delay_ms / 1000, loss, rng, bps)]
    for d in dirs:
        for fn in (d.receive_forever, d.send_forever):
            threading.Thread(target=fn, daemon=True, name=f"wire-{d.src}-{fn.__name__}").start()
    return dirs


def main(argv: list[str] | None = None) -> None:
    """Run the wire until SIGTERM / SIGINT, then print what it did."""
    p = argparse.ArgumentParser(prog="python -m swarmrl.node.local.netwire", description=__doc__.splitlines()[0])
    p.add_argument("if_a")
    p.add_argument("if_b")
    p.add_argument("--delay-ms", type=float, default=80.0, help="one-way delay, each direction (default 80)")
    p.add_argument("--loss", type=float, default=0.01, help="drop probability per frame, each direction (0.01)")
    p.add_argument("--rate-mbit", type=float, default=0.0, help="each direction's rate, Mbit/s (0: unlimited)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    dirs = run_wire(args.if_a, args.if_b, args.delay_ms, args.loss, args.seed, args.rate_mbit)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"netwire {args.if_a} <-> {args.if_b}: {args.delay_ms:g} ms, loss {args.loss:g}, "
          f"rate {args.rate_mbit:g} Mbit/s", flush=True)
    while not stop.wait(0.5):
        pass
    for d in dirs:
        print(f"{d.src} -> {d.dst}: {d.stats}", flush=True)


if __name__ == "__main__":
    main()
