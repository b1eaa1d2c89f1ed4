"""Engine faults in the worker: a call to the inference backend that fails with `BackendError` (a
vLLM server that crashed or stopped answering) is retried after `backend.recover()`, waiting
2 s then 4 s; a third failure gives up on that call (`EngineFailed`: the worker skips that
lease and keeps serving, the trainer hands the prompts out again when the lease expires).

Request errors (ValueError, KeyError) are not engine faults and pass straight through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from swarmrl.node.inference.base import BackendError, InferenceBackend

log = logging.getLogger(__name__)

T = TypeVar("T")
RECOVERY_BACKOFF_S = (2.0, 4.0)   # waits before the 2nd and 3rd attempts; the 3rd failure gives up


class EngineFailed(RuntimeError):
    """The engine failed on every attempt of one call (`RECOVERY_BACKOFF_S`); the lease is skipped."""


def with_recovery(backend: InferenceBackend, call: Callable[[], T], *, what: str = "generate",
                  sleep: Callable[[float], object] = time.sleep,
                  backoff: tuple[float, ...] = RECOVERY_BACKOFF_S, on_fault: Callable[[], object] | None = None) -> T:
    """`call()`, retried after each `BackendError`: wait `backoff[i]`, `backend.recover()`, call
    again. `on_fault` runs at each fault (counting). Raises EngineFailed after `len(backoff) + 1`
    failed attempts (a failed recovery counts as the next attempt's failure)."""
    for attempt, wait in enumerate((*backoff, None), start=1):
        try:
            return call()
        except BackendError as exc:
            if on_fault is not None:
                on_fault()
            if wait is None:
                raise EngineFailed(f"{what}: the inference engine failed {attempt} times: {exc}") from exc
            log.warning("%s: inference engine failed (attempt %d): %s; recovering in %.0f s",
                        what, attempt, str(exc).splitlines()[0][:300], wait)
            sleep(wait)
            try:
                backend.recover()
            except BackendError as rexc:
                log.warning("%s: recovery failed: %s", what, str(rexc).splitlines()[0][:300])
    raise AssertionError("unreachable")   # the loop returns or raises
