"""Client side of an overloaded server: retry a call refused with RESOURCE_EXHAUSTED (a bound or
rate limit, `node.grpc_guard`, `node.rate_limits`) or UNAVAILABLE (no connection) after a backoff
with jitter, honouring the server's retry hint, so refused peers don't all come back at once.

Only calls that are safe to repeat go through here: a lease request (a refused one granted
nothing) and a rollout submission (a refused one admitted nothing; a resend of one that was
admitted after all comes back as `replay`, never as a second admission).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from swarmrl.node.grpc_guard import retry_after_ms

T = TypeVar("T")
RETRYABLE = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: attempt k waits the server's hint (if any) plus
    uniform(0, min(max_s, base_s * 2**k)) seconds; `attempts` calls in all."""

    attempts: int = 4
    base_s: float = 0.25
    max_s: float = 4.0

    def delay(self, attempt: int, hint_s: float, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `attempt` (0-based)."""
        cap = min(self.max_s, self.base_s * 2 ** attempt)
        return max(0.0, hint_s) + (rng or random).uniform(0.0, cap)


def call_with_backoff(call: Callable[[], T], backoff: Backoff = Backoff(), *,
                      sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None) -> T:
    """`call()`, retried on RESOURCE_EXHAUSTED / UNAVAILABLE per `backoff`; any other error, or
    the last attempt's, is raised (grpc.RpcError)."""
    for attempt in range(backoff.attempts):
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() not in RETRYABLE or attempt == backoff.attempts - 1:
                raise
            hint = retry_after_ms(exc) if isinstance(exc, grpc.Call) else None
            sleep(backoff.delay(attempt, (hint or 0) / 1000, rng))
    raise AssertionError("unreachable")   # pragma: no cover - the loop returns or raises
