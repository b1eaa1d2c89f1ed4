"""Process-level helpers shared by every role: threads, logging, signals, ready files, the
key lock and a bounded exit.

Every role process ends within `SHUTDOWN_GRACE_S` (+ about a second) of SIGTERM / SIGINT, in any
state, and takes its children with it:
- before the role is serving (its first ready file), a signal ends it at once: its children are
  ended and it exits (128 + signal) from the handler, without unwinding a half-made start (a DHT
  still booting, a model loading: at a load of 8 on 2 cores their teardown could outlast the
  grace period); nothing a role accepts or writes before serving needs a clean stop (a start-up's
  files are written atomically, as they must be to survive a SIGKILL);
- once serving, a signal sets the stop event and the main loop winds down;
- either way a watchdog, armed by the signal (seen even while the main thread is stuck in C),
  ends the children and exits hard when the grace period runs out; a second signal does so at once;
- behind it a backstop that needs no Python thread (faulthandler's C watchdog, armed with it): if
  the process still runs `BACKSTOP_S` later (a C call holding the GIL at shutdown, e.g. a native
  library's teardown), it writes every thread's stack to stderr and exits (1); the children that
  carry a parent-death signal (the DHT process, vLLM's server) follow;
- when the interpreter exits (normally or on an error), the DHT is shut down (`join_swarm`
  registers that) and every remaining descendant (DHT process, p2pd, torch_shm_manager, grading interpreters) is ended;
- a role whose run returned ends with `exit_process`: the interpreter's Python-level exit (join
  the non-daemon threads, run the atexit handlers, flush) and then `os._exit`, skipping the C-level
  teardown of torch, gRPC and the loaded modules, which frees only memory and, under load (a
  nice'd worker on 2 busy cores), once outlasted the backstop and turned a finished worker's exit 0
  into faulthandler's exit 1.
"""

from __future__ import annotations

import atexit
import faulthandler
import fcntl
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from swarmrl.node.runtime import procs
from swarmrl.node.runtime.logjson import apply_log_format, set_log_context

if TYPE_CHECKING:
    from swarmrl.protocol.identity import Identity

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 6.0
"""Seconds from the first SIGTERM / SIGINT to a hard exit if the clean shutdown has not finished."""
CHILD_GRACE_S = 1.0
"""Seconds a child gets between SIGTERM and SIGKILL when the role ends its children."""
HARD_EXIT_CHILD_GRACE_S = 0.5
"""The same, when the watchdog exits hard (up to three rounds: children's children are adopted)."""
BACKSTOP_S = 3.0
"""Seconds after the watchdog's deadline at which the GIL-free backstop ends the process."""
EXIT_BOUND_S = SHUTDOWN_GRACE_S + BACKSTOP_S
"""The longest a role runs after its first SIGTERM / SIGINT, whatever it is doing (seconds)."""
DIE_WITH_PARENT = "SWARMRL_DIE_WITH_PARENT"
"""Environment variable: the pid of a parent (`swarmrl up`) whose death should stop this role."""


class StartupError(ValueError):
    """A role could not start (key in use, port taken, unreachable peers): one line for the person."""


class _Lifecycle:
    """This process's stop event, whether it serves yet, its key locks and its watchdog."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.serving = False
        self.exiting = False
        self.installed = False
        self.signals = 0
        self.lock_fds: list[int] = []
        self.watchdog: threading.Timer | None = None
        self.backstop_armed = False
        self.guard = threading.Lock()


_life = _Lifecycle()


def set_threads(n: int) -> None:
    """Pin torch and BLAS thread pools to `n` (several torch processes share 2 cores)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass


def setup_logging(role: str) -> None:
    """Configure the root logger for role `role`: level from $SWARMRL_LOG (default INFO), each line
    prefixed with the time and role (JSON with SWARMRL_LOG_FORMAT=json); chatty libraries
    (hivemind, grpc, ...) at WARNING or quieter."""
    level = os.environ.get("SWARMRL_LOG", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    apply_log_format(role)   # SWARMRL_LOG_FORMAT=json: one JSON object per line (node/runtime/logjson.py)
    for noisy in ("hivemind", "grpc", "urllib3", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def stop_event() -> threading.Event:
    """The process's stop event, set on SIGTERM / SIGINT; installs the handlers and the exit
    guards (see the module docstring) on the first call. Call it from the main thread, first."""
    if not _life.installed:
        _life.installed = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _on_signal)
        _watch_signals_from_a_thread()
        procs.become_subreaper()
        _stop_when_parent_dies()
        atexit.register(_end_children)
        # before the interpreter joins non-daemon threads; CPython-private, so typeshed lacks it
        threading._register_atexit(_exiting)  # type: ignore[attr-defined]
    return _life.stop


def _stop_when_parent_dies() -> None:
    """Under `swarmrl up`: SIGTERM this role when up dies, even by SIGKILL (roles run in their own
    sessions, so nothing else would reach them)."""
    parent = os.environ.pop(DIE_WITH_PARENT, None)   # popped: our own children must not inherit it
    if parent is not None and procs.die_with_parent(signal.SIGTERM) and os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)   # it died before we asked


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    """The Python-level handler (main thread): stop, or end start-up now; a second signal: exit now."""
    _life.signals += 1
    _arm_watchdog(128 + signum)
    _life.stop.set()
    if _life.signals > 1:
        _hard_exit(128 + signum, "second signal")
    if not (_life.serving or _life.exiting):
        _hard_exit(128 + signum, f"{signal.Signals(signum).name} during start-up")


def _watch_signals_from_a_thread() -> None:
    """Arm the watchdog from a thread as soon as a signal arrives, even while the main thread is
    stuck in C code and cannot run the Python-level handler."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def watch() -> None:
        while data := os.read(r, 64):
            _arm_watchdog(128 + data[0])

    threading.Thread(target=watch, name="signal-watch", daemon=True).start()


def _exiting() -> None:
    """The interpreter is exiting: bound the join of non-daemon threads and the atexit handlers."""
    _life.exiting = True
    _arm_watchdog(1)


def exit_process(code: int) -> None:
    """End a role process whose run has returned, with exit status `code`, once everything that
    matters is done: the non-daemon threads joined (this arms the exit watchdog), the atexit
    handlers run (the DHT shut down, logging flushed, every descendant ended) and stdout / stderr
    flushed. What is skipped is only the interpreter's C-level teardown (module and object
    finalisation: memory). Returns at once, doing nothing, in a process that never installed the
    role lifecycle (`stop_event`): a command run in-process (tests, `--dry-run`) exits as usual."""
    if not _life.installed:
        return
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx runs first (calls _exiting)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe or stream: nothing left to write to
            pass
    os._exit(code)


def _arm_watchdog(code: int) -> None:
    if not _life.backstop_armed:   # outside the guard: the thread holding it may never run again
        faulthandler.dump_traceback_later(EXIT_BOUND_S, exit=True)   # the backstop: a C thread, no GIL
        _life.backstop_armed = True   # after the call: two callers at once only re-arm it a moment later
    if not _life.guard.acquire(blocking=False):  # being armed right now (perhaps by the code a signal interrupted)
        return
    try:
        if _life.watchdog is None:
            _life.watchdog = threading.Timer(SHUTDOWN_GRACE_S, _hard_exit, (code, "shutdown took too long"))
            _life.watchdog.daemon = True
            _life.watchdog.start()
    finally:
        _life.guard.release()


def _hard_exit(code: int, why: str) -> None:
    os.write(2, f"{why}: ending child processes and exiting ({code})\n".encode())
    procs.end_descendants(grace_s=HARD_EXIT_CHILD_GRACE_S)
    os._exit(code)


def _end_children() -> None:
    """At interpreter exit: end every descendant still running (the DHT and its p2pd included)."""
    procs.end_descendants(grace_s=CHILD_GRACE_S)


def lock_key(key: Path) -> None:
    """Hold an OS lock on `<key>.lock` for this process's life: one key, one running peer.

    Raises:
        StartupError: another process holds the key.
    """
    path = key.with_name(key.name + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise StartupError(f"key {key} is in use by another process" + (f" (pid {holder})" if holder else "")
                           + ": one key runs one peer") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _life.lock_fds.append(fd)


def _close_locks_in_child() -> None:
    """A forked child (the DHT process) must not keep the parent's key lock alive."""
    for fd in _life.lock_fds:
        os.close(fd)
    _life.lock_fds.clear()


os.register_at_fork(after_in_child=_close_locks_in_child)


def start_role(role: str, key: Path, threads: int) -> tuple[threading.Event, Identity]:
    """The common start of a role process: signal handling first, logging, thread pools and the
    peer's identity (locked). Returns (stop event, identity); the role joins the swarm next
    (`swarmrl.node.swarm.dht.join_swarm`).

    Raises:
        StartupError: the key is in use.
    """
    from swarmrl.protocol.identity import Identity

    stop = stop_event()
    setup_logging(role)
    lock_key(key)
    set_threads(threads)
    identity = Identity.load_or_create(key)
    set_log_context(peer_id=identity.peer_id)
    return stop, identity


def write_ready(path: Path | None, info: dict[str, Any]) -> None:
    """Atomically write a JSON ready file (orchestrators wait for it). The first call also marks
    the process as serving: from then on a signal stops the main loop instead of aborting start-up."""
    _life.serving = True
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)
