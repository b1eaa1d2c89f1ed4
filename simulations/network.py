"""Links: latency by region pair, per-peer bandwidth, and an uplink that serves one byte at a time.

An uplink is modelled as a reservation book: a transfer of `size` bytes occupies the sender's
uplink for size / up_bps (after whatever it already promised), and the receiver's downlink for
size / down_bps; the transfer ends when both are done, plus the latency of the request and the
first byte. So a trainer serving a thousand workers at once delivers the last copy when its uplink
has pushed a thousand copies, as a fair-share TCP link would, without one event per packet.

A fetch fails, as the product's do, when it has not finished `timeout_s` after it was asked for
(the gRPC deadline, the gossip fetch's `wait_for`) or when the sender goes away first (its
session ends, the trainer dies). A failed fetch gives back the part of its reservation that was
not sent yet, so a slow or departed sender's queue never holds more than one timeout of work.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmrl.simulations.regions import one_way_s

MBIT = 1e6 / 8   # bytes per second in one megabit per second


@dataclass
class Uplink:
    """A peer's upload side: where it is, how fast it sends, and until when it is busy."""

    region: str
    up_bps: float
    busy_until: float = 0.0
    sent_bytes: int = 0

    def reserve(self, start: float, size: int) -> float:
        """Occupy the uplink for `size` bytes from `start` (or when free); returns when the last byte leaves."""
        self.busy_until = max(self.busy_until, start) + size / self.up_bps
        self.sent_bytes += size
        return self.busy_until

    def cancel(self, last_byte_s: float, at_s: float, size: int) -> int:
        """Give back what a transfer of `size` bytes whose last byte was due at `last_byte_s` (s)
        had not sent by `at_s` (s): later transfers move up. Returns the bytes it did send."""
        unsent_s = min(size / self.up_bps, max(0.0, last_byte_s - at_s))
        self.busy_until -= unsent_s
        unsent = int(unsent_s * self.up_bps)
        self.sent_bytes -= unsent
        return size - unsent


@dataclass(frozen=True)
class Fetch:
    """How a fetch ended: at `end_s` (s; delivered or failed), `ok`, and the bytes the sender sent."""

    end_s: float
    ok: bool
    sent_bytes: int


def fetch(src: Uplink, gone_s: float, dst_region: str, dst_down_bps: float, size: int, start: float,
          timeout_s: float) -> Fetch:
    """Ask `src` (whose owner goes away at `gone_s`, s) for `size` bytes at `start` (s), giving up
    `timeout_s` (s) after asking. Asking a sender already gone fails after one round trip."""
    lat = one_way_s(src.region, dst_region)
    if gone_s <= start:
        return Fetch(start + 2 * lat, False, 0)
    last_byte = src.reserve(start + lat, size)
    end = max(start + 2 * lat + size / dst_down_bps, last_byte + lat)
    fail = min(start + timeout_s, gone_s)
    if end <= fail:
        return Fetch(end, True, size)
    return Fetch(fail, False, src.cancel(last_byte, fail - lat, size))


def send_s(src_region: str, dst_region: str, up_bps: float, size: int) -> float:
    """A small message's time on an idle link (rollout batches, lease requests)."""
    return one_way_s(src_region, dst_region) + size / up_bps
