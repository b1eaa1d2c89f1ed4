"""A trainer call that ended with a status, whatever carried it: `CallRefused`.

The trainer's transport-free handlers (`node.trainer.calls`) refuse a call by raising
`CallRefused` with a gRPC status code, details and an optional retry hint. The gRPC service turns
it into `context.abort` (with the hint in `retry-after-ms` trailing metadata); an in-process
caller (`node.local.inprocess`) gets the exception itself. It is a `grpc.RpcError` and a
`grpc.Call`, so callers handle it as they handle a call that failed on the wire, and
`grpc_retry.call_with_backoff` retries it (RESOURCE_EXHAUSTED, UNAVAILABLE) honouring its hint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from swarmrl.node.net.grpc_guard import RETRY_AFTER_KEY


def code_name(exc: grpc.RpcError) -> str:
    """The name of a failed call's status code (e.g. "UNAVAILABLE"), "error" when it carries none
    (an `RpcError` that is not a `grpc.Call`)."""
    return exc.code().name if hasattr(exc, "code") else "error"


class EndedCall(grpc.RpcError, grpc.Call):  # type: ignore[misc]  # grpc's classes are untyped
    """The parts of `grpc.Call` that are the same for every call that is over: nothing to cancel,
    no time left, no callbacks, no initial metadata. Subclasses say its code, details and
    trailing metadata."""

    def code(self) -> grpc.StatusCode:
        """The call's status code."""
        raise NotImplementedError

    def details(self) -> str:
        """The call's status details."""
        raise NotImplementedError

    def trailing_metadata(self) -> Any:
        """The call's trailing metadata."""
        return ()

    def initial_metadata(self) -> Any:
        """None was received: the call is over."""
        return ()

    def is_active(self) -> bool:
        """Never: the call is over."""
        return False

    def time_remaining(self) -> float | None:
        """None: the call is over."""
        return None

    def cancel(self) -> bool:
        """Nothing to cancel: the call is over."""
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Not added: the call is over."""
        return False

    def __str__(self) -> str:
        return f"{self.code().name}: {self.details()}"


class CallRefused(EndedCall):
    """A trainer refused a call: `code` (e.g. NOT_FOUND, OUT_OF_RANGE, RESOURCE_EXHAUSTED),
    `details` (why, for a person), `retry_after_ms` (the server's retry hint, or None)."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_ms: int | None = None) -> None:
        self._code, self._details, self.retry_after_ms = code, details, retry_after_ms
        super().__init__(str(self))

    def code(self) -> grpc.StatusCode:
        """The refusal's status code."""
        return self._code

    def details(self) -> str:
        """Why the call was refused."""
        return self._details

    def trailing_metadata(self) -> Any:
        """The retry hint as gRPC carries it (`retry-after-ms`), if there is one."""
        return ((RETRY_AFTER_KEY, str(self.retry_after_ms)),) if self.retry_after_ms is not None else ()

    def abort(self, context: grpc.ServicerContext) -> None:
        """End a gRPC call with this refusal (raises, as `context.abort` does)."""
        context.set_trailing_metadata(self.trailing_metadata())
        context.abort(self._code, self._details)
