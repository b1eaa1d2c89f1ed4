"""A process's descendants, read from /proc, and how to end them all (Linux only).

A role's children are not all its own: hivemind's DHT runs in a forked process that starts the
go-libp2p daemon (p2pd), torch may start torch_shm_manager, the grading pool starts
interpreters. When the role ends, every one of them must end with it, including grandchildren
whose parent already died (a child subreaper adopts them, so they stay our descendants).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):  # not Linux
        return False


def become_subreaper() -> bool:
    """Adopt orphaned descendants (a p2pd whose DHT process died), so they can still be ended."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `sig` to this process when the thread that forked it exits. Call it
    only in a child forked from its parent's main thread."""
    return _prctl(PR_SET_PDEATHSIG, int(sig))


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a live process, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has ended: only its exit status is left)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def descendants(pid: int | None = None) -> list[int]:
    """Pids of the live descendants of `pid` (default: this process), parents before children."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None and st[0] not in ("Z", "X"):
                children.setdefault(st[1], []).append(int(entry.name))
    found, queue = [], list(children.get(root, []))
    while queue:
        p = queue.pop(0)
        found.append(p)
        queue.extend(children.get(p, []))
    return found


def _p2pd_socket(pid: int) -> Path | None:
    """The unix socket a p2pd daemon listens on (hivemind removes it only on a clean shutdown)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if not args or not args[0].endswith(b"p2pd"):
        return None
    for a in args:
        if a.startswith(b"-listen=/unix/"):
            return Path(a[len(b"-listen=/unix"):].decode(errors="replace"))
    return None


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_processes(pids: Iterable[int], grace_s: float = 1.0) -> list[int]:
    """SIGTERM `pids`, wait up to `grace_s`, SIGKILL the rest; returns the pids that were killed
    hard. Removes the sockets of the p2pd daemons among them."""
    pids = [p for p in pids if alive(p)]
    sockets = [s for s in map(_p2pd_socket, pids) if s is not None]
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    stubborn = [p for p in pids if alive(p)]
    _signal_all(stubborn, signal.SIGKILL)
    for s in sockets:
        s.unlink(missing_ok=True)
    return stubborn


def end_descendants(pid: int | None = None, grace_s: float = 1.0) -> list[int]:
    """End every descendant of `pid` (default: this process), adopted orphans included."""
    killed: list[int] = []
    for _ in range(3):  # a dying child's own children are adopted (or were missed): look again
        pids = descendants(pid)
        if not pids:
            break
        killed += end_processes(pids, grace_s)
    return killed
