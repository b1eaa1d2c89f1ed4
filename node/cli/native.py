"""Environment defaults for the native code a command loads (gRPC core, torch under hivemind), set
by `node.cli.main.main` before anything imports grpc or hivemind."""

from __future__ import annotations

import os
import signal
import threading

NATIVE_DEFAULTS = {"GRPC_VERBOSITY": "NONE", "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_descriptor"}
"""Environment defaults for native code, set before grpc and hivemind are imported; a value in the
user's environment wins, and the roles `swarmrl up` starts inherit them.

GRPC_VERBOSITY=NONE keeps gRPC core's C++ log lines (`E... add_port.cc:83] Failed to add port ...`)
out of a person's terminal: every failure we expect is already one line of ours
(GRPC_VERBOSITY=ERROR or DEBUG, GRPC_TRACE=... to debug).

HIVEMIND_MEMORY_SHARING_STRATEGY=file_descriptor: hivemind's default, torch's file_system
strategy, starts a torch_shm_manager process that a role's exit ends before the interpreter frees
hivemind's shared MPFuture buffers; the last free then wrote to the dead manager's socket, and
torch's allocator died in C++ (`terminate called after throwing an instance of
'std::system_error' what(): Broken pipe`, SIGABRT) at the end of every validator run, leaving its
/dev/shm/torch_* files behind. file_descriptor shares through unlinked shm files held by fds
(hivemind's DHT and averager are forked: they inherit them): no manager, nothing left in /dev/shm."""


def apply_native_defaults() -> None:
    """Apply NATIVE_DEFAULTS where the environment sets nothing (before grpc and hivemind are
    imported: commands import them lazily), and give SIGINT Python's Ctrl-C handler."""
    for var, value in NATIVE_DEFAULTS.items():
        os.environ.setdefault(var, value)
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C raises KeyboardInterrupt even when a parent started us with SIGINT ignored (a
        # background job of a non-interactive shell, as CI runners do): Python keeps SIG_IGN then.
        signal.signal(signal.SIGINT, signal.default_int_handler)
