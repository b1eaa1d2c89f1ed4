"""Bounds on a gRPC server's streaming calls: how many at once (in total, per peer, per source
address), for how long, and how long one may sit idle (`node.runtime.limits.GrpcLimits`).

A stream over a bound is refused at once with RESOURCE_EXHAUSTED and a retry hint in its
trailing metadata (`retry-after-ms`), so it never waits for a thread. A stream past its deadline
ends with DEADLINE_EXCEEDED at its next message; one that is stuck (a downloader that stopped
reading, an uploader that stopped sending) is cancelled by the reaper thread, which frees the
thread that served it. Unary calls pass untouched: they are short, and rate limits
(`node.net.rate_limits`) bound how often a peer may make them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from swarmrl.node.runtime.limits import GrpcLimits

log = logging.getLogger(__name__)
RETRY_AFTER_KEY = "retry-after-ms"   # trailing metadata of a refusal: wait this long before retrying
PEER_KEY = "swarmrl-peer"            # metadata a client may send: the peer id it speaks for
Clock = Callable[[], float]


def source_address(peer: str) -> str:
    """The source address part of grpc's `context.peer()` ("ipv4:1.2.3.4:5" -> "1.2.3.4"); an
    IPv6 address is cut to its /64, the block one host usually holds."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        host = rest.rsplit(":", 1)[0].strip("[]")
        return ":".join(host.split(":")[:4]) + "::/64"
    return peer


def retry_after_ms(call: grpc.Call) -> int | None:
    """The retry hint (ms) in a refused call's trailing metadata, or None."""
    for key, value in call.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0, int(value))
            except ValueError:
                return None
    return None


@dataclass(eq=False)   # identity-hashed: one entry per live stream
class _Stream:
    method: str
    peer: str
    address: str
    context: grpc.ServicerContext
    started: float
    last: float
    may_idle: bool
    ended: str = field(default="")   # why the reaper ended it ("" while it runs)


STREAM_REFUSALS = ("total", "per_peer", "per_address")
"""The bounds a stream can be refused over (`StreamGuard.refused` keys)."""
STREAM_ENDINGS = ("deadline", "idle")
"""Why the reaper ends a stream (`StreamGuard.reaped` keys)."""


class StreamGuard(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc's interceptor base is untyped
    """A server interceptor that admits, times and reaps streaming calls (see the module doc)."""

    def __init__(self, limits: GrpcLimits, clock: Clock = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self._lock = threading.Lock()
        self._streams: set[_Stream] = set()   # identity-hashed: one entry per live stream
        self.refused: Counter[str] = Counter()   # reason -> streams refused
        self.reaped: Counter[str] = Counter()    # "deadline" | "idle" -> streams ended by the reaper
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="grpc-reaper", daemon=True)
        self._reaper.start()

    # ---- grpc.ServerInterceptor
    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        """Wrap the handler of a streaming method; pass unary handlers through."""
        handler = continuation(details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        method = details.method
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_stream_stream(method, handler.stream_stream),
                handler.request_deserializer, handler.response_serializer)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_stream_unary(method, handler.stream_unary),
                handler.request_deserializer, handler.response_serializer)
        return grpc.unary_stream_rpc_method_handler(
            self._wrap_unary_stream(method, handler.unary_stream),
            handler.request_deserializer, handler.response_serializer)

    def _wrap_unary_stream(self, method: str, behavior: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def guarded(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            stream = self._admit(method, context, _claimed_peer(context))
            try:
                yield from self._timed_responses(stream, behavior(request, context))
            finally:
                self._release(stream)
        return guarded

    def _wrap_stream_unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            stream = self._admit(method, context, _claimed_peer(context))
            try:
                return behavior(self._timed_requests(stream, requests), context)
            finally:
                self._release(stream)
        return guarded

    def _wrap_stream_stream(self, method: str, behavior: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def guarded(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            stream = self._admit(method, context, _claimed_peer(context))
            try:
                yield from self._timed_responses(stream, behavior(self._timed_requests(stream, requests), context))
            finally:
                self._release(stream)
        return guarded

    # ---- admission and release
    def _admit(self, method: str, context: grpc.ServicerContext, claimed: str) -> _Stream:
        """Count the stream in, or refuse it at once (aborts the call: RESOURCE_EXHAUSTED)."""
        address = source_address(context.peer())
        peer = claimed   # "": a caller naming no peer is bounded per address only
        now = self.clock()
        with self._lock:
            reason = self._over_bound(peer, address)
            if not reason:
                stream = _Stream(method, peer, address, context, now, now,
                                 may_idle=method in self.limits.idle_exempt)
                self._streams.add(stream)
                return stream
            self.refused[reason] += 1
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(int(self.limits.retry_after_s * 1000))),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many streams ({reason}); retry later")
        raise AssertionError("context.abort returned")   # pragma: no cover - abort raises

    def _over_bound(self, peer: str, address: str) -> str:
        lim = self.limits
        if len(self._streams) >= lim.max_streams:
            return "total"
        if peer and sum(s.peer == peer for s in self._streams) >= lim.max_streams_per_peer:
            return "per_peer"
        if sum(s.address == address for s in self._streams) >= lim.max_streams_per_address:
            return "per_address"
        return ""

    def _release(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def active(self) -> int:
        """Streams being served now."""
        with self._lock:
            return len(self._streams)

    # ---- timing
    def _touch(self, stream: _Stream) -> None:
        """A message went through: the stream is not idle; past its deadline it ends here."""
        now = self.clock()
        stream.last = now
        if now - stream.started > self.limits.stream_deadline_s:
            stream.context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"stream deadline {self.limits.stream_deadline_s:g} s passed")

    def _timed_responses(self, stream: _Stream, responses: Iterator[Any]) -> Iterator[Any]:
        for response in responses:
            self._touch(stream)
            yield response   # returns once grpc sent it: a reader that stops reading blocks here

    def _timed_requests(self, stream: _Stream, requests: Iterator[Any]) -> Iterator[Any]:
        for request in requests:   # blocks while the sender is silent
            self._touch(stream)
            yield request

    def overdue(self) -> list[tuple[_Stream, str]]:
        """Streams past their deadline, or idle (no message either way) past the idle bound."""
        now, lim = self.clock(), self.limits
        with self._lock:
            streams = list(self._streams)
        out = []
        for s in streams:
            if now - s.started > lim.stream_deadline_s:
                out.append((s, "deadline"))
            elif not s.may_idle and now - s.last > lim.stream_idle_s:
                out.append((s, "idle"))
        return out

    def reap(self) -> int:
        """Cancel every overdue stream (frees the thread blocked on it); returns how many."""
        n = 0
        for stream, why in self.overdue():
            if stream.ended:
                continue
            stream.ended = why
            self.reaped[why] += 1
            log.info("ending %s stream of %s (%s): %s", stream.method, stream.peer or "-", stream.address, why)
            stream.context.cancel()
            n += 1
        return n

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.limits.reap_every_s):
            try:
                self.reap()
            except Exception:
                log.exception("stream reaper failed")

    def close(self) -> None:
        """Stop the reaper thread."""
        self._stop.set()


def _claimed_peer(context: grpc.ServicerContext) -> str:
    """The peer id a caller claims in its `swarmrl-peer` metadata ("" if none). Unauthenticated:
    it spreads one address's streams fairly over its peers; the per-address bound caps the sum."""
    for key, value in context.invocation_metadata() or ():
        if key == PEER_KEY and isinstance(value, str):
            return value[:128]
    return ""


def peer_metadata(peer_id: str) -> tuple[tuple[str, str]]:
    """Call metadata naming the peer a client speaks for (see `_claimed_peer`)."""
    return ((PEER_KEY, peer_id),)
