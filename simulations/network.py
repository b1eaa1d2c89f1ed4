"""Links: latency by region pair, per-peer bandwidth, and an uplink that serves one byte at a time.

An uplink is modelled as a reservation book: a transfer of `size` bytes occupies the sender's
uplink for size / up_bps (after whatever it already promised), and the receiver's downlink for
size / down_bps; the transfer ends when both are done, plus the latency of the request and the
first byte. So a trainer serving a thousand workers at once delivers the last copy when its uplink
has pushed a thousand copies, as a fair-share TCP link would, without one event per packet.
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


def transfer_end(src: Uplink, dst_region: str, dst_down_bps: float, size: int, start: float) -> float:
    """When `size` bytes asked for at `start` have arrived from `src` (request + first byte + bytes)."""
    lat = one_way_s(src.region, dst_region)
    sent = src.reserve(start + lat, size)
    return max(start + 2 * lat + size / dst_down_bps, sent + lat)


def send_s(src_region: str, dst_region: str, up_bps: float, size: int) -> float:
    """A small message's time on an idle link (rollout batches, lease requests)."""
    return one_way_s(src_region, dst_region) + size / up_bps
