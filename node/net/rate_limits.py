"""Per-peer and per-address rate limits on a trainer's lease requests and rollout submissions.

Token buckets: a key may spend `burst` calls at once and earns `per_s` a second back. A peer is
keyed by its verified peer id (checked after the signature, so nobody can spend another peer's
budget) and by its source address (checked before, so one address minting many keys still
shares one budget and pays for no signature checks past it). The bucket tables are bounded
(least recently used keys are forgotten, which only ever refills them). The clock is injected.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

from swarmrl.node.runtime.limits import Rate, RateLimits

Kind = Literal["lease", "submit"]
RATE_LIMITED_PEER = "rate_limited_peer"
RATE_LIMITED_ADDRESS = "rate_limited_address"


class TokenBuckets:
    """Token buckets of one `Rate`, one per key (thread-safe, bounded to `max_keys`)."""

    def __init__(self, rate: Rate, max_keys: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.max_keys, self.clock = rate, max_keys, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()   # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """Spend one token of `key`: 0.0 if it had one, else the seconds until it will."""
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.pop(key, (float(self.rate.burst), now))
            tokens = min(float(self.rate.burst), tokens + (now - at) * self.rate.per_s)
            wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate.per_s
            self._buckets[key] = (tokens - 1.0 if not wait else tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        return wait


class RateLimiter:
    """The trainer's buckets: lease and submit, per peer id and per source address."""

    def __init__(self, limits: RateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        n = limits.max_keys
        self._peer = {"lease": TokenBuckets(limits.lease_per_peer, n, clock),
                      "submit": TokenBuckets(limits.submit_per_peer, n, clock)}
        self._address = {"lease": TokenBuckets(limits.lease_per_address, n, clock),
                         "submit": TokenBuckets(limits.submit_per_address, n, clock)}

    def check_address(self, kind: Kind, address: str) -> tuple[str, float]:
        """("", 0) if `address` may make a `kind` call now, else (RATE_LIMITED_ADDRESS, retry after s)."""
        wait = self._address[kind].take(address)
        return (RATE_LIMITED_ADDRESS, wait) if wait else ("", 0.0)

    def check_peer(self, kind: Kind, peer_id: str) -> tuple[str, float]:
        """("", 0) if the (verified) peer may make a `kind` call now, else (RATE_LIMITED_PEER, retry after s)."""
        wait = self._peer[kind].take(peer_id)
        return (RATE_LIMITED_PEER, wait) if wait else ("", 0.0)


def retry_ms(wait_s: float) -> int:
    """A retry hint in whole milliseconds (at least 1)."""
    return max(1, math.ceil(wait_s * 1000))
