"""Building a gRPC server that holds up: a thread pool sized to the stream bounds, the stream
guard (`node.net.grpc_guard`), keepalive enforcement that matches our clients (`node.net.grpc_options`),
health and reflection, and a shutdown with a bound.

`GuardedServer.stop(grace)` refuses new calls, lets calls in flight finish for `grace` seconds,
then cancels them; the pool's threads are daemon threads, so a handler blocked for good (on a
lock, a disk, a peer) cannot keep the process from exiting once its main thread returns.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health  # type: ignore[import-untyped]  # no stubs installed

from swarmrl.node.net.grpc_guard import StreamGuard
from swarmrl.node.net.grpc_options import server_options
from swarmrl.node.net.grpc_standard import add_standard_services
from swarmrl.node.runtime.lifecycle import StartupError
from swarmrl.node.runtime.limits import GrpcLimits
from swarmrl.node.runtime.ports import port_taken

log = logging.getLogger(__name__)
_Task = tuple[futures.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonThreadPool(futures.Executor):
    """A fixed-size pool of daemon threads (grpcio only calls `submit`). Unlike
    ThreadPoolExecutor, whose threads the interpreter joins at exit, a thread stuck in a handler
    does not hold the process."""

    def __init__(self, max_workers: int, name: str = "grpc") -> None:
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(max_workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        """Queue `fn(*args, **kwargs)`; returns its future."""
        future: futures.Future[Any] = futures.Future()
        self._tasks.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args, kwargs = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the future, as ThreadPoolExecutor does
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Let every thread finish its task and end (joins them if `wait`; a blocked one is left)."""
        for _ in self._threads:
            self._tasks.put(None)
        if wait:
            for t in self._threads:
                t.join()


class GuardedServer:
    """A started gRPC server with its guard, health servicer and pool (see `build_server`)."""

    def __init__(self, server: grpc.Server, pool: DaemonThreadPool, guard: StreamGuard,
                 healthy: health.HealthServicer) -> None:
        self.server, self.pool, self.guard, self.health = server, pool, guard, healthy

    def stop(self, grace: float | None) -> threading.Event:
        """Stop within a bound: health says NOT_SERVING, new calls are refused, calls in flight
        get `grace` seconds (None: none) and are then cancelled. Returns an event set once grpc
        is done or the bound (grace + 1 s) has passed, whichever is first; handlers still
        blocked after that are abandoned on daemon threads."""
        self.health.enter_graceful_shutdown()
        done = self.server.stop(grace)
        bounded = threading.Event()

        def finish() -> None:
            if not done.wait((grace or 0) + 1.0):
                log.warning("gRPC server: handlers still running %.1f s after stop; abandoning them", (grace or 0) + 1)
            self.guard.close()
            self.pool.shutdown(wait=False)
            bounded.set()
        threading.Thread(target=finish, name="grpc-stop", daemon=True).start()
        return bounded

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Block until the server stops (or `timeout`); grpc's own wait."""
        return bool(self.server.wait_for_termination(timeout))


def build_server(host: str, port: int, *, max_message_mb: int, limits: GrpcLimits,
                 services: list[str], add_servicers: Callable[[grpc.Server], None],
                 credentials: grpc.ServerCredentials | None = None) -> tuple[GuardedServer, int]:
    """Start a guarded gRPC server on host:port (0 = any free port); returns (server, bound port).

    services: the full names of what `add_servicers` registers (health and reflection list
    them); credentials: TLS, or None for plaintext. Raises StartupError if the port can't be bound.
    """
    pool = DaemonThreadPool(limits.threads)
    guard = StreamGuard(limits)
    server = grpc.server(pool, interceptors=[guard], options=server_options(max_message_mb),
                         maximum_concurrent_rpcs=limits.max_concurrent_rpcs)
    add_servicers(server)
    healthy = add_standard_services(server, services)
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises "Failed to bind" where older versions returned 0
        bound = 0
    if bound == 0:
        guard.close()
        pool.shutdown(wait=False)
        raise StartupError(port_taken("gRPC", address, "grpc_port"))
    server.start()
    return GuardedServer(server, pool, guard, healthy), bound
