"""Links: latency by region pair, per-peer bandwidth, and an uplink that serves one byte at a time.

An uplink is modelled as a reservation book: a transfer of `size` bytes occupies the sender's
uplink for size / up_bps, in the first free stretch that long from when it is asked for, and the
receiver's downlink for size / down_bps; the transfer ends when both are done, plus the latency of
the request and the first byte. So a trainer serving a thousand workers at once delivers the last
copy when its uplink has pushed a thousand copies, as a fair-share TCP link would, without one
event per packet. The book keeps its busy stretches in time order (merged when they touch), so a
reservation made early for a late time (a retry computed ahead of the clock) does not delay a
request made afterwards for an earlier time: that one takes the free stretch before it.

A fetch fails, as the product's do, when it has not finished `timeout_s` after it was asked for
(the gRPC deadline, the gossip fetch's `wait_for`) or when the sender goes away first (its
session ends, the trainer dies). A failed fetch gives back the part of its reservation that was
not sent yet, so a slow or departed sender's queue never holds more than one timeout of work.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from swarmrl.simulations.regions import one_way_s

MBIT = 1e6 / 8   # bytes per second in one megabit per second
_EPS = 1e-9      # s: stretches closer than this touch


@dataclass
class Uplink:
    """A peer's upload side: where it is, how fast it sends, and the stretches it is busy."""

    region: str
    up_bps: float
    sent_bytes: int = 0
    starts: list[float] = field(default_factory=list, repr=False)   # busy stretches, disjoint, in time order
    ends: list[float] = field(default_factory=list, repr=False)

    @property
    def busy_until(self) -> float:
        """When the last booked byte leaves (0.0: nothing booked)."""
        return self.ends[-1] if self.ends else 0.0

    def forget_before(self, t: float) -> None:
        """Drop the stretches that end before `t` (s): no request starts earlier (the clock)."""
        k = bisect_right(self.ends, t)
        if k:
            del self.starts[:k], self.ends[:k]

    def reserve(self, start: float, size: int) -> float:
        """Occupy the uplink for `size` bytes in its first free stretch long enough from `start`
        (s); returns when the last byte leaves."""
        dur = size / self.up_bps
        starts, ends = self.starts, self.ends
        i, t = bisect_right(ends, start), start
        while i < len(starts) and starts[i] < t + dur - _EPS:
            t = max(t, ends[i])
            i += 1
        end = t + dur
        left = i > 0 and ends[i - 1] >= t - _EPS
        right = i < len(starts) and starts[i] <= end + _EPS
        if left and right:
            ends[i - 1] = ends[i]
            del starts[i], ends[i]
        elif left:
            ends[i - 1] = end
        elif right:
            starts[i] = t
        else:
            starts.insert(i, t)
            ends.insert(i, end)
        self.sent_bytes += size
        return end

    def cancel(self, last_byte_s: float, at_s: float, size: int) -> int:
        """Give back what a transfer of `size` bytes whose last byte was due at `last_byte_s` (s)
        had not sent by `at_s` (s): that stretch is free for later requests. Returns the bytes it
        did send."""
        dur = size / self.up_bps
        unsent_s = min(dur, max(0.0, last_byte_s - at_s))
        if unsent_s > 0:
            self._free(last_byte_s - unsent_s, last_byte_s)
        unsent = int(unsent_s * self.up_bps)
        self.sent_bytes -= unsent
        return size - unsent

    def _free(self, a: float, b: float) -> None:
        """Mark [a, b] (s), part of one busy stretch, free."""
        k = bisect_left(self.ends, b - _EPS)
        assert k < len(self.ends) and self.starts[k] <= a + _EPS, (a, b)
        s, e = self.starts[k], self.ends[k]
        pieces = [(x, y) for x, y in ((s, a), (b, e)) if y - x > _EPS]
        self.starts[k:k + 1] = [x for x, _ in pieces]
        self.ends[k:k + 1] = [y for _, y in pieces]


@dataclass(frozen=True)
class Fetch:
    """How a fetch ended: at `end_s` (s; delivered or failed), `ok`, the bytes the sender sent,
    and how long its first byte waited on the sender's uplink after the request arrived (s)."""

    end_s: float
    ok: bool
    sent_bytes: int
    queued_s: float = 0.0


def fetch(src: Uplink, gone_s: float, dst_region: str, dst_down_bps: float, size: int, start: float,
          timeout_s: float) -> Fetch:
    """Ask `src` (whose owner goes away at `gone_s`, s) for `size` bytes at `start` (s), giving up
    `timeout_s` (s) after asking. Asking a sender already gone fails after one round trip."""
    lat = one_way_s(src.region, dst_region)
    if gone_s <= start:
        return Fetch(start + 2 * lat, False, 0)
    last_byte = src.reserve(start + lat, size)
    queued = last_byte - size / src.up_bps - (start + lat)
    end = max(start + 2 * lat + size / dst_down_bps, last_byte + lat)
    fail = min(start + timeout_s, gone_s)
    if end <= fail:
        return Fetch(end, True, size, queued)
    return Fetch(fail, False, src.cancel(last_byte, fail - lat, size), queued)


def send_s(src_region: str, dst_region: str, up_bps: float, size: int) -> float:
    """A small message's time on an idle link (rollout batches, lease requests)."""
    return one_way_s(src_region, dst_region) + size / up_bps
