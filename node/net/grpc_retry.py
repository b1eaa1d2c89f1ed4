"""Client side of an overloaded server: retry a call refused with RESOURCE_EXHAUSTED (a bound or
rate limit, `node.net.grpc_guard`, `node.net.rate_limits`) or UNAVAILABLE (no connection) after a backoff
with jitter, honouring the server's retry hint, so refused peers don't all come back at once.

Only calls that are safe to repeat go through here: a lease request (a refused one granted
nothing), a rollout submission (a refused one admitted nothing; a resend of one that was
admitted after all comes back as `replay`, never as a second admission), a job submission (the
same signed job is the same job id), a verdict report (a validator re-reports a batch it could
not report anyway), and reads (status, admitted batches, adapter and data-set downloads). A
download is retried only while it is being opened: once a message came through, a failure is
the caller's (it may already hold part of what was sent).

Every client of ours goes through here: workers, validators, cotrainers, `swarmrl
submit/status/fetch` and `swarmrl dashboard`. A client with a signing identity also names
itself in `swarmrl-peer` metadata (`grpc_guard.peer_metadata`), so the server bounds its streams
per peer rather than lumping it with everyone behind its address.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any, TypeVar

import grpc

from swarmrl.node.net.call_status import EndedCall
from swarmrl.node.net.grpc_guard import retry_after_ms

T = TypeVar("T")
RETRYABLE = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: attempt k waits the server's hint (if any, at most
    `max_hint_s`: a server can't park its clients for good) plus uniform(0, min(max_s,
    base_s * 2**k)) seconds; `attempts` calls in all."""

    attempts: int = 4
    base_s: float = 0.25
    max_s: float = 4.0
    max_hint_s: float = 30.0

    def delay(self, attempt: int, hint_s: float, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `attempt` (0-based)."""
        cap = min(self.max_s, self.base_s * 2 ** attempt)
        return min(max(0.0, hint_s), self.max_hint_s) + (rng or random).uniform(0.0, cap)


class GaveUp(EndedCall):
    """A call still refused (overloaded: RESOURCE_EXHAUSTED) or unreachable (UNAVAILABLE) after
    every attempt its backoff allows. A grpc.RpcError and grpc.Call with the last refusal's code,
    details and metadata, so callers that handle a failed call handle this one too; its message
    says how many attempts were made over how long."""

    def __init__(self, last: grpc.RpcError, attempts: int, waited_s: float) -> None:
        self.last, self.attempts, self.waited_s = last, attempts, waited_s
        super().__init__(str(self))

    def code(self) -> grpc.StatusCode:
        """The last refusal's status code."""
        return self.last.code() if isinstance(self.last, grpc.Call) else grpc.StatusCode.UNKNOWN

    def details(self) -> str:
        """The last refusal's details, with the attempts made."""
        last = self.last.details() if isinstance(self.last, grpc.Call) else str(self.last)
        return f"{last} (gave up after {self.attempts} attempts over {self.waited_s:.1f} s)"

    def trailing_metadata(self) -> Any:
        """The last refusal's trailing metadata (its retry hint, if any)."""
        return self.last.trailing_metadata() if isinstance(self.last, grpc.Call) else ()

    def initial_metadata(self) -> Any:
        """The last refusal's initial metadata."""
        return self.last.initial_metadata() if isinstance(self.last, grpc.Call) else ()


def call_with_backoff(call: Callable[[], T], backoff: Backoff = Backoff(), *,
                      sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None) -> T:
    """`call()`, retried on RESOURCE_EXHAUSTED / UNAVAILABLE per `backoff`; any other error is
    raised as it came (grpc.RpcError); the last attempt's refusal is raised as `GaveUp`."""
    waited = 0.0
    for attempt in range(backoff.attempts):
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() not in RETRYABLE:
                raise
            if attempt == backoff.attempts - 1:
                raise GaveUp(exc, backoff.attempts, waited) from exc
            hint = retry_after_ms(exc) if isinstance(exc, grpc.Call) else None
            delay = backoff.delay(attempt, (hint or 0) / 1000, rng)
            sleep(delay)
            waited += delay
    raise AssertionError("unreachable")   # pragma: no cover - the loop returns or raises


def stream_with_backoff(open_stream: Callable[[], Iterable[T]], backoff: Backoff = Backoff(), *,
                        sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None) -> Iterator[T]:
    """The messages of a server stream, its opening retried as `call_with_backoff` retries a call:
    `open_stream()` starts the call, and a refusal before its first message (or before it ended
    with none) opens it again. A failure after the first message is raised as it came. Lazy: the
    call starts when the first message is asked for; a stream left unfinished is cancelled (a
    generator, as an in-process stream is, is closed)."""
    def opened() -> tuple[Iterable[T], Iterator[T]]:
        stream = open_stream()
        it = iter(stream)
        try:
            first = next(it)
        except StopIteration:
            return stream, iter(())
        return stream, chain([first], it)

    stream, messages = call_with_backoff(opened, backoff, sleep=sleep, rng=rng)
    try:
        yield from messages
    finally:
        if isinstance(stream, grpc.RpcContext):
            stream.cancel()   # a no-op once the call ended; frees the server's thread otherwise
        elif isinstance(stream, Generator):
            stream.close()    # an in-process stream (`node.local.inprocess`): ends the trainer's generator
