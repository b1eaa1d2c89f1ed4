"""Shared fixtures: a tiny base model in a per-run cache, and hivemind socket cleanup; the
10-minute keepalive soak, started in the background at the start of the session."""

from __future__ import annotations

import atexit
import fcntl
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # 2 shared cores: oversubscribed torch threads crawl

import torch

torch.set_num_threads(1)

# Tests send SIGINT to processes they start, as Ctrl-C in a terminal would. A suite started as a
# background job of a non-interactive shell (`make test &`, nohup) inherits SIGINT *ignored*, and
# every child would inherit that too and never see the signal; a handler here (not SIG_IGN) is
# reset to the default at each child's exec, so children get the terminal's behaviour.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


class SignalLeak(UserWarning):
    """A test left SIGINT / SIGTERM with another disposition than it found (restored for it)."""


@pytest.fixture(autouse=True)
def _signal_dispositions(request: pytest.FixtureRequest):
    """Restore SIGINT and SIGTERM after every test, warning (SignalLeak) if one changed them: a
    leaked SIG_IGN is inherited by every process a later test starts, so its Ctrl-C is lost."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in before.items():
        now = signal.getsignal(sig)
        if now is not handler:
            warnings.warn(SignalLeak(f"{request.node.nodeid} left {sig.name} as {now!r}; restored"), stacklevel=1)
            signal.signal(sig, handler)


@pytest.fixture(scope="session")
def model_cache() -> Path:
    """The cache folder holding the prepared tiny model (built once per cache)."""
    from swarmrl.node.models.base_model import default_cache_dir, prepare_base_model

    cache = default_cache_dir()
    prepare_base_model("tiny", cache)
    return cache


# hivemind's p2p daemons call back into their clients through unix sockets named
# /tmp/hivemind-p2pclient-*.sock, which a killed process leaves behind. They are removed once, by
# the controller at the very end of the run: an xdist worker that removed the sockets made during
# its own session when it finished cut the callbacks of the processes the other worker still ran
# (a restarted trainer's state downloads and averaging rounds all failed with "Connection lost").
_HIVEMIND_SOCKETS = "/tmp/hivemind-p2pclient-*.sock"
_SOCKETS_BEFORE = pytest.StashKey[set[str]]()


def _unlink_new_hivemind_sockets(before: set[str]) -> None:
    for path in set(glob.glob(_HIVEMIND_SOCKETS)) - before:
        try:
            os.unlink(path)
        except OSError:
            pass


# ---- the keepalive soak (issue 11): ten minutes of idle connections, run beside the suite
# A test marked `keepalive_soak` (tests/integration/test_grpc_keepalive.py) judges a soak that
# runs for SOAK_S seconds in a subprocess (benchmarks/keepalive_soak.py: a real server and
# clients on 127.0.0.1, almost all idle waiting). It is started once collection has settled
# which tests run, only if that test is among them; the test is moved to the end of the run, so
# it waits only for whatever of the ten minutes the rest of the suite did not take.
# Under pytest-xdist every worker collects, so the soak lives in a folder named after the run's
# controller (the pytest process itself without xdist): the first collector to make the folder
# starts the soak there, and the test, on whichever worker it runs, waits on that folder's files.
# The soak is in its own process group, exits by itself once the controller is gone, and the
# controller kills it at session end whatever happened (and at exit).
SOAK_S = float(os.environ.get("SWARMRL_KEEPALIVE_SOAK_S", "600"))   # shorter only to check the mechanism


def _controller_pid(config: pytest.Config) -> int:
    """The run's controlling pytest process: xdist workers are its direct children."""
    return os.getppid() if hasattr(config, "workerinput") else os.getpid()


class KeepaliveSoak:
    """The background soak of one test run: its folder (result, stderr, pid) and, in the process
    that started it, its Popen."""

    def __init__(self, seconds: float, controller_pid: int) -> None:
        self.seconds = seconds
        self.dir = Path(tempfile.gettempdir()) / f"swarmrl-soak-{controller_pid}"
        self.result, self.stderr, self.pid_file = self.dir / "result.json", self.dir / "stderr.log", self.dir / "pid"
        self.proc: subprocess.Popen[bytes] | None = None
        self.controller_pid = controller_pid

    def start_once(self) -> None:
        """Start the soak unless another collector of this run already did (mkdir decides)."""
        try:
            self.dir.mkdir()
        except FileExistsError:
            return
        root = Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
        with open(self.dir / "stdout.log", "wb") as out, open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.keepalive_soak", "--seconds", str(self.seconds),
                 "--json", str(self.result), "--parent-pid", str(self.controller_pid)],
                cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        tmp = self.pid_file.with_suffix(".tmp")
        tmp.write_text(str(self.proc.pid))
        tmp.replace(self.pid_file)

    def _pid(self, timeout_s: float = 60.0) -> int:
        deadline = time.monotonic() + timeout_s
        while not self.pid_file.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no keepalive soak started in {self.dir}")
            time.sleep(0.2)
        return int(self.pid_file.read_text())

    def wait(self, timeout: float) -> int:
        """The soak's exit code (0 when another process started it and it left its result);
        raises subprocess.TimeoutExpired after `timeout` seconds."""
        if self.proc is not None:
            return self.proc.wait(timeout=timeout)
        pid, deadline = self._pid(), time.monotonic() + timeout
        from swarmrl.node.runtime import procs

        while procs.alive(pid):   # a zombie child of another xdist worker counts as ended
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["keepalive_soak", str(pid)], timeout)
            time.sleep(1.0)
        return 0 if self.result.exists() else 1

    def close(self) -> None:
        """Kill the soak's whole process group (if it still runs) and remove its folder."""
        if self.pid_file.exists():
            try:
                os.killpg(int(self.pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, PermissionError, ValueError):
                pass
        if self.proc is not None:
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_soak: KeepaliveSoak | None = None
_CONTROLLER_SOAK = pytest.StashKey[KeepaliveSoak]()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):   # the controller cleans up whoever started it
        config.stash[_SOCKETS_BEFORE] = set(glob.glob(_HIVEMIND_SOCKETS))
        soak = KeepaliveSoak(SOAK_S, os.getpid())
        shutil.rmtree(soak.dir, ignore_errors=True)   # a folder of a killed run whose pid we reuse
        atexit.register(soak.close)
        config.stash[_CONTROLLER_SOAK] = soak


@pytest.hookimpl(trylast=True)   # after -m / -k / --deselect have removed what won't run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    global _soak
    _make_vllm_env_if_needed(config, items)
    soaks = [i for i in items if i.get_closest_marker("keepalive_soak")]
    if not soaks or config.option.collectonly:
        return
    items[:] = [i for i in items if i not in soaks] + soaks
    if _soak is None:
        _soak = KeepaliveSoak(SOAK_S, _controller_pid(config))
        _soak.start_once()


# ---- vLLM's environment (issue 28): made only when a test that will run needs it
# Tests marked `needs_vllm` run vLLM's server from .venv-vllm (3.4 GB, ~2 min to make, once). It is
# made only once -m / -k have chosen what runs, so `-m "not slow"` (which runs none of them) never
# pays for it; where it can't be made they skip, saying why. scripts/run_tests.sh runs the suite in a
# private network namespace (only loopback up) where pip can't reach the registry, so it first asks
# a collection pass (SWARMRL_VLLM_NEED_FILE) whether any selected test needs vLLM and makes the
# environment outside; `pytest` run directly makes it here. SWARMRL_VLLM_ENV=skip never makes it.


def _make_vllm_env_if_needed(config: pytest.Config, items: list[pytest.Item]) -> None:
    from swarmrl.node.inference.vllm_server import vllm_python

    needing = [i for i in items if i.get_closest_marker("needs_vllm")]
    if config.option.collectonly:
        if need_file := os.environ.get("SWARMRL_VLLM_NEED_FILE"):
            Path(need_file).write_text(str(len(needing)))
        return
    if not needing or vllm_python() is not None:
        return
    lock = Path(__file__).resolve().parent.parent / ".cache" / "vllm_env.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:   # xdist workers collect side by side: one of them makes it
        fcntl.flock(held, fcntl.LOCK_EX)
        reason = None if vllm_python() is not None else _make_vllm_env(len(needing))
    for item in needing if reason else ():
        item.add_marker(pytest.mark.skip(reason=reason))


def _make_vllm_env(n_tests: int) -> str | None:
    """Run scripts/vllm_env.sh; None once .venv-vllm serves, else why the tests skip."""
    from swarmrl.node.inference.vllm_server import vllm_python

    absent = "vLLM's environment (.venv-vllm) is absent"
    if os.environ.get("SWARMRL_VLLM_ENV") == "skip":
        return f"{absent} and SWARMRL_VLLM_ENV=skip"
    if os.environ.get("SWARMRL_TEST_NETNS") == "private":
        return f"{absent}: scripts/run_tests.sh could not make it (its output says why)"
    root = Path(__file__).resolve().parent.parent
    log = root / ".cache" / "vllm_env.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.write(f"\nconftest: making .venv-vllm (~2 min, once) for the {n_tests} tests that need it; log: {log}\n")
    with open(log, "wb") as out:
        try:
            code = subprocess.run(["bash", str(root / "scripts" / "vllm_env.sh")], check=False, cwd=root, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=1800).returncode
        except subprocess.TimeoutExpired:
            code = -1
    if code == 0 and vllm_python() is not None:
        return None
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
    return f"{absent} and could not be made (scripts/vllm_env.sh exit {code}: {tail[0][:200]})"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if (soak := session.config.stash.get(_CONTROLLER_SOAK, None)) is not None:
        soak.close()
    if (before := session.config.stash.get(_SOCKETS_BEFORE, None)) is not None:   # the controller, last
        _unlink_new_hivemind_sockets(before)


@pytest.fixture
def keepalive_soak() -> KeepaliveSoak:
    """The soak started for this session (a test using it must be marked `keepalive_soak`)."""
    assert _soak is not None, "the keepalive soak was not started: mark the test `keepalive_soak`"
    return _soak


VF_GUESS = Path(__file__).resolve().parent / "fixtures" / "vf_guess"


@pytest.fixture(scope="session")
def vf_guess_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/fixtures/vf_guess (a verifiers MultiTurnEnv package) pip-installed into a folder that
    is put first on sys.path and PYTHONPATH (so child processes find its entry point too);
    skips when the `verifiers` package is not installed (the `swarmrl[verifiers]` extra)."""
    import importlib.util
    import shutil
    import subprocess
    import sys

    if importlib.util.find_spec("verifiers") is None:
        pytest.skip("the verifiers package is not installed (pip install 'swarmrl[verifiers]')")
    src, site = tmp_path_factory.mktemp("vf_guess_src") / "vf_guess", tmp_path_factory.mktemp("vf_guess_site")
    shutil.copytree(VF_GUESS, src)   # the build leaves build/ and egg-info beside the sources
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(src)], check=True, capture_output=True, timeout=300)
    sys.path.insert(0, str(site))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), old) if p)
    yield site
    sys.path.remove(str(site))
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old
