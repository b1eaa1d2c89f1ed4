"""The child processes of a local swarm: start roles as OS processes, watch them, stop them.

Each role (`swarmrl <role> -o key=value ...`) runs in its own session (process group) with its
log under `work/logs/<name>.log`; `node/local/up.py` drives a whole swarm through this.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from swarmrl.node.runtime.lifecycle import DIE_WITH_PARENT, EXIT_BOUND_S

SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
"""What `signal.signal` takes and returns: a function of (signal number, frame), SIG_IGN or SIG_DFL."""

STOP_S = EXIT_BOUND_S + 1.0
"""Seconds the roles get to exit after SIGTERM before their process groups are killed: each role
bounds its own exit at EXIT_BOUND_S, so waiting longer would only delay the kill."""


class SwarmFailed(RuntimeError):
    """A process of the local swarm died or the job did not finish in time."""


class LocalSwarm:
    """The child processes of one local swarm, with their logs under `work/logs`."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        (work / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, name: str, role: str, overrides: list[str], threads: int = 1, nice: int = 0) -> None:
        """Start `swarmrl <role>` with config overrides; `nice` lowers its CPU priority (the
        trainer is the bottleneck on a shared CPU: workers and validators yield to it)."""
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", DIE_WITH_PARENT: str(os.getpid())}
        args = [*(["nice", "-n", str(nice)] if nice else []), sys.executable, "-m", "swarmrl.node.cli.main", role]
        prefix, placed = self.place(name, role)
        args = [*prefix, *args]
        for o in [*overrides, *placed]:
            args += ["-o", o]
        with open(self.work / "logs" / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                start_new_session=True)

    def place(self, name: str, role: str) -> tuple[list[str], list[str]]:
        """Where role process `name` runs: (command prefix, extra config overrides). Here: on
        this machine's loopback as configured; node/local/netns.py's swarm puts roles in namespaces."""
        return [], []

    def check_alive(self, names: list[str] | None = None) -> None:
        """Raise SwarmFailed (with the tail of its log) if one of `names` (default: every role)
        has exited."""
        for name in names or list(self.procs):
            p = self.procs[name]
            if p.poll() is not None:
                raise SwarmFailed(f"{name} exited with code {p.returncode}:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 30) -> str:
        """The last `lines` lines of role `name`'s log."""
        text = (self.work / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_ready(self, name: str, path: Path, timeout_s: float = 180) -> dict[str, Any]:
        """Wait until role `name` writes its ready file `path` (JSON: endpoint, maddrs, ...) and
        return it, polling every 0.2 s.

        Raises:
            SwarmFailed: the role exited, or wrote nothing within `timeout_s` seconds.
        """
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            self.check_alive([name])
            if time.monotonic() > deadline:
                raise SwarmFailed(f"{name} not ready after {timeout_s:.0f}s:\n{self.tail(name)}")
            time.sleep(0.2)
        ready: dict[str, Any] = json.loads(path.read_text())
        return ready

    def stop(self, name: str, timeout_s: float = STOP_S) -> int | None:
        """SIGTERM one role; after `timeout_s`, or once it exits, kill what is left of its
        process group (each role runs in its own session)."""
        return self._stop([name], timeout_s)[name]

    def stop_all(self, timeout_s: float = STOP_S) -> None:
        """Stop every role at once (each exits within EXIT_BOUND_S of SIGTERM); a second Ctrl-C can't
        interrupt this and leave processes behind."""
        with signal_handler(signal.SIGINT, signal.SIG_IGN):
            self._stop(list(self.procs), timeout_s)

    def _stop(self, names: list[str], timeout_s: float) -> dict[str, int | None]:
        for name in names:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name in names:
            p = self.procs[name]
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)   # the role if it hangs, and any straggler of its group
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
        return {n: self.procs[n].returncode for n in names}


@contextlib.contextmanager
def signal_handler(sig: int, handler: SignalHandler) -> Iterator[None]:
    """Install `handler` for `sig` while the block runs (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(sig, handler)
    try:
        yield
    finally:
        signal.signal(sig, previous)
