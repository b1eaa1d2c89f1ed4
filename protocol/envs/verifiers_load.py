"""Load a `verifiers` environment module as a swarmrl environment: `VerifiersEnv` for a one-turn
environment, `VerifiersEpisodeEnv` for a multi-turn one.

Loading keeps the process's SIGINT/SIGTERM handlers: verifiers' `Environment.__post_init__` would
install its own (teardown, then exit 143), and fail on any thread but the main one.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from swarmrl.protocol.envs.verifiers_adapter import VerifiersEnv
from swarmrl.protocol.envs.verifiers_multiturn import VerifiersEpisodeEnv
from swarmrl.protocol.envs.verifiers_replay import verifiers_module


class _NoSignalHandlers:
    """The `signal` module as verifiers' `Environment` sees it while loading: `signal()` installs
    nothing (it would replace the node's SIGINT/SIGTERM handlers with verifiers' teardown-and-exit,
    and raises off the main thread); everything else is the real module's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(signal, name)

    @staticmethod
    def signal(signum: int, handler: Any) -> None:
        """Install nothing."""


_LOADING = threading.Lock()


@contextlib.contextmanager
def _no_signal_handlers(vf: Any) -> Iterator[None]:
    """While loading, verifiers' environment module installs no signal handler (any thread)."""
    module: Any = sys.modules[vf.Environment.__module__]
    with _LOADING:
        real = module.signal
        module.signal = _NoSignalHandlers()
        try:
            yield
        finally:
            module.signal = real


def adapt_verifiers(module: Any, **kwargs: Any) -> VerifiersEnv:
    """`module.load_environment(**kwargs)` adapted.

    Raises:
        ValueError: the module has no `load_environment`, verifiers is not installed, or what it
            returns is not a verifiers `MultiTurnEnv` (a v1 environment, say).
    """
    load = getattr(module, "load_environment", None)
    if load is None:
        raise ValueError(f"{getattr(module, '__name__', module)!r} is neither an Environment nor has load_environment()")
    name = str(getattr(module, "__name__", "verifiers")).rsplit(".", 1)[-1]
    vf = verifiers_module()
    with _no_signal_handlers(vf):
        vf_env = load(**kwargs)
    if not isinstance(vf_env, vf.MultiTurnEnv):   # ValueError: what every loader caller handles
        raise ValueError(  # noqa: TRY004
            f"{name}.load_environment() returned a {type(vf_env).__module__}.{type(vf_env).__name__}, "
            "not a verifiers MultiTurnEnv (the classic API; v1 environments are not supported)")
    version = str(getattr(module, "__version__", "0"))
    if vf_env.max_turns == 1:
        return VerifiersEnv(vf_env, name, version)
    return VerifiersEpisodeEnv(vf_env, name, version)
