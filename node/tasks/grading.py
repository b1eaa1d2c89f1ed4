"""Grading completions with an environment's reward functions in sandboxed worker processes.

Legend: N = completions in a `grade` call, F = reward functions of the environment.

Each worker is a fresh Python interpreter (never a fork of the node, so it holds none of the
node's keys, model or memory), started with a minimal environment. It loads the environment by
name and version and then runs one reward-function call at a time on texts it receives. Messages
both ways are length-prefixed JSON over private pipes (the parent never unpickles what a worker
sends). Each call grades one completion (or, for an environment with group-level rewards, whose
rows carry a `group` column, the rows of one group together), so the wall-clock limit measures
that call's own grading, from the moment a worker takes it, never its wait behind others in a
queue or a chunk; a worker that overruns it or dies is killed and replaced while the other
workers go on. A reward function that raises, overruns, returns something other than a list of
the call's length, or returns a non-finite / non-numeric value yields a recorded failure for that
call's rows only (reward None, error set), never a zero.

Reward functions follow TRL's convention: `f(prompts=[...], completions=[...], **columns) ->
list[float | None]`, where each column is one info key transposed across the batch.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import os
import subprocess
import sys
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Self

from swarmrl.protocol.envs.base import Grade, total_reward

MAX_MESSAGE_BYTES = 64 << 20
START_TIMEOUT_S = 60.0
_ENV_PASSTHROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SYSTEMROOT")
_CALL_KINDS = ("ok", "exception", "not_a_list")  # what a worker may answer to a call
Task = tuple[int, tuple[int, ...]]  # (reward function, the rows of one call: a completion, or a group's)
_CHILD = "import sys; from swarmrl.node.tasks.grading import _child_main; _child_main(int(sys.argv[1]), int(sys.argv[2]))"


class GradingError(RuntimeError):
    """The environment could not be loaded in a worker, or the pool is closed."""


class GradingPool:
    """Runs an environment's reward functions in `processes` sandboxed worker processes.

    env_name, env_version: the installed environment to load (`swarmrl.protocol.envs`); a
        version that doesn't match the installed one is refused.
    timeout_s: wall-clock limit of one reward function grading one completion, or one group's
        rows where a `group` column is given (counted from the moment a worker takes the call:
        time waiting for a free worker is not counted).
    processes: worker processes; each call grades one completion (a reward function sees a batch
        of one) or one group's rows, and calls spread over the processes in parallel.
    rewards: a data-set job's `[{name, weight, **params}]` built-in rewards, loaded instead of an
        environment (env_name and env_version then only label the pool).
    env_factory: "module:attr" naming an environment object (or a zero-argument callable
        returning one) to load instead of the named one; for tests and local experiments.
    task: a reasoning-gym job's `{"environment": task table, "seed": job seed}`: the environment
        is built from it (`protocol.envs.rg_env`) instead of the named one.
    `failures` counts failures by kind: "timeout", "crash", "exception", "not_a_list",
    "wrong_length" (per call, so per completion and reward function), "non_finite",
    "non_numeric" (per value).
    Raises GradingError when the environment can't be loaded. Use as a context manager or call
    `close()`.
    """

    def __init__(
        self,
        env_name: str,
        env_version: str,
        *,
        timeout_s: float = 10.0,
        processes: int = 1,
        env_factory: str | None = None,
        rewards: list[dict[str, Any]] | None = None,
        task: dict[str, Any] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.timeout_s = float(timeout_s)
        self.failures: Counter[str] = Counter()
        self._spec = {"env_name": env_name, "env_version": env_version, "env_factory": env_factory,
                      "rewards": rewards, "task": task}
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _close_all, self._workers)
        self._workers.append(_Worker.start(self._spec))
        self.reward_names: tuple[str, ...] = self._workers[0].names
        self.reward_weights: tuple[float, ...] = self._workers[0].weights
        try:
            for _ in range(processes - 1):
                self._workers.append(self._spawn())
        except BaseException:
            self.close()
            raise

    def grade(self, prompts: Sequence[str], completions: Sequence[str], infos: Sequence[dict[str, Any]]) -> list[Grade]:
        """Grade `completions[i]` (answering `prompts[i]`, with `infos[i]` as extra columns).

        Returns one Grade per completion. Raises ValueError on mismatched lengths, infos with
        differing keys, keys named "prompts"/"completions", or non-JSON values; GradingError
        if the pool is closed.
        """
        columns = _transpose(prompts, completions, infos)
        if not self._workers:
            raise GradingError("grading pool is closed")
        n = len(completions)
        if n == 0:
            return []
        values: list[list[float | None]] = [[None] * n for _ in self.reward_names]  # [F][N]
        errors: list[list[str]] = [[] for _ in range(n)]
        tasks = deque((f, rows) for rows in _call_rows(n, columns.get("group")) for f in range(len(self.reward_names)))
        for (f, rows), outcome in self._run(tasks, list(prompts), list(completions), columns):
            self._record(f, rows, outcome, values, errors)
        return [self._grade_one(i, values, errors[i]) for i in range(n)]

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        self._finalizer()
        self._workers.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self) -> _Worker:
        worker = _Worker.start(self._spec)
        if self._workers and (worker.names, worker.weights) != (self.reward_names, self.reward_weights):
            worker.kill()
            raise GradingError("a respawned worker loaded a different environment")
        return worker

    def _run(
        self, tasks: deque[Task], prompts: list[str], completions: list[str], columns: dict[str, list[Any]]
    ) -> Iterator[tuple[Task, tuple[str, Any]]]:
        """Dispatch (function, rows) tasks to idle workers; yield (task, outcome) as they end.

        outcome is ("ok", values) or (kind, message) for a failed call.
        """
        idle, busy = list(self._workers), dict[_Worker, tuple[Task, float]]()  # worker -> (task, deadline)
        while tasks or busy:
            while idle and tasks:
                f, rows = task = tasks.popleft()
                worker = idle.pop()
                request = {"func": f, "prompts": [prompts[i] for i in rows], "completions": [completions[i] for i in rows],
                           "kwargs": {k: [v[i] for i in rows] for k, v in columns.items()}}
                try:
                    worker.send(request)
                except OSError:  # it died while idle
                    idle.append(self._replace(worker))
                    yield task, ("crash", "grading worker died between calls")
                    continue
                busy[worker] = (task, time.monotonic() + self.timeout_s)
            if not busy:
                continue
            next_deadline = min(deadline for _, deadline in busy.values())
            ready = wait([w.conn_in for w in busy], timeout=max(0.0, next_deadline - time.monotonic()))
            for worker in list(busy):
                task, deadline = busy[worker]
                if worker.conn_in in ready or worker.conn_in.poll(0):
                    outcome = worker.receive()
                elif time.monotonic() >= deadline:
                    outcome = ("timeout", f"timeout after {self.timeout_s}s")
                else:
                    continue
                del busy[worker]
                if outcome[0] in ("timeout", "crash"):
                    idle.append(self._replace(worker))
                else:
                    idle.append(worker)
                yield task, outcome

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = self._spawn()
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    def _record(self, f: int, rows: tuple[int, ...], outcome: tuple[str, Any], values: list[list[float | None]],
                errors: list[list[str]]) -> None:
        name = self.reward_names[f]
        kind, payload = outcome
        if kind == "ok" and (not isinstance(payload, list) or len(payload) != len(rows)):
            got = len(payload) if isinstance(payload, list) else type(payload).__name__
            kind, payload = "wrong_length", f"wrong length: got {got}, want {len(rows)}"
        if kind != "ok":
            self.failures[kind] += 1
            for i in rows:
                errors[i].append(f"{name}: {payload}")
            return
        for i, v in zip(rows, payload, strict=True):
            value, kind, error = _check_value(v)
            values[f][i] = value
            if error:
                self.failures[kind] += 1
                errors[i].append(f"{name}: {error}")

    def _grade_one(self, i: int, values: list[list[float | None]], errors: list[str]) -> Grade:
        rewards = tuple(values[f][i] for f in range(len(self.reward_names)))
        if errors:
            return Grade(reward=None, rewards=rewards, error="; ".join(errors))
        return Grade(reward=total_reward(rewards, self.reward_weights), rewards=rewards, error="")


def _call_rows(n: int, groups: list[Any] | None) -> list[tuple[int, ...]]:
    """The rows of each call: one per row, or, given a `group` column, the rows of each group
    value together (in order of first appearance), so a group-level reward sees its whole group."""
    if groups is None:
        return [(i,) for i in range(n)]
    by_group: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(json.dumps(g, sort_keys=True), []).append(i)
    return [tuple(rows) for rows in by_group.values()]


def _check_value(v: Any) -> tuple[float | None, str, str]:
    """(value, failure kind, error) for one value a worker sent ("" error when fine)."""
    if v is None:
        return None, "", ""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if math.isfinite(v):
            return float(v), "", ""
        return None, "non_finite", f"non-finite value: {v}"
    shown = v.get("bad", "?") if isinstance(v, dict) else repr(v)
    return None, "non_numeric", f"non-numeric value: {str(shown)[:80]}"


def _transpose(
    prompts: Sequence[str], completions: Sequence[str], infos: Sequence[dict[str, Any]]
) -> dict[str, list[Any]]:
    """TRL-style columns from per-completion info dicts: [{"answer": 1}, ...] -> {"answer": [1, ...]}."""
    if not len(prompts) == len(completions) == len(infos):
        raise ValueError(f"{len(prompts)} prompts, {len(completions)} completions, {len(infos)} infos")
    if any(not isinstance(t, str) for t in (*prompts, *completions)):
        raise ValueError("prompts and completions must be strings")
    keys = set(infos[0]) if infos else set()
    if any(set(info) != keys for info in infos):
        raise ValueError("every info dict must have the same keys")
    if keys & {"prompts", "completions"}:
        raise ValueError("info keys 'prompts' and 'completions' are reserved")
    columns = {k: [info[k] for info in infos] for k in sorted(keys)}
    try:
        json.dumps(columns, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"info values must be JSON data: {e}") from e
    return columns


class _Worker:
    """Parent-side handle of one worker process and its two pipes."""

    def __init__(self, proc: subprocess.Popen[bytes], conn_in: Connection, conn_out: Connection) -> None:
        self.proc, self.conn_in, self.conn_out = proc, conn_in, conn_out
        self.names: tuple[str, ...] = ()
        self.weights: tuple[float, ...] = ()

    @classmethod
    def start(cls, spec: dict[str, Any]) -> _Worker:
        """Start a worker, send it the environment spec and wait for its reward functions."""
        child_read, parent_write = os.pipe()
        parent_read, child_write = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(child_read), str(child_write)],
                pass_fds=(child_read, child_write), stdin=subprocess.DEVNULL, stdout=2,
                env=_child_env(), close_fds=True,
            )
        finally:
            os.close(child_read)
            os.close(child_write)
        worker = cls(proc, Connection(parent_read, writable=False), Connection(parent_write, readable=False))
        worker.send(spec)
        if not worker.conn_in.poll(START_TIMEOUT_S):
            worker.kill()
            raise GradingError(f"grading worker did not start within {START_TIMEOUT_S}s")
        kind, hello = worker.receive()
        if kind != "ok" or not _valid_hello(hello):
            worker.kill()
            raise GradingError(f"could not load environment {spec}: {hello}")
        worker.names, worker.weights = tuple(hello["names"]), tuple(float(w) for w in hello["weights"])
        return worker

    def send(self, message: dict[str, Any]) -> None:
        self.conn_out.send_bytes(json.dumps(message).encode())

    def receive(self) -> tuple[str, Any]:
        """("ok", payload) or (failure kind, message); a dead or garbled worker is a "crash"."""
        try:
            message = json.loads(self.conn_in.recv_bytes(MAX_MESSAGE_BYTES))
        except (EOFError, OSError, ValueError) as e:
            try:
                code = self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                code = None  # a garbled message from a live worker; the caller kills it
            return "crash", f"grading worker died (exit code {code}): {type(e).__name__}"
        if not isinstance(message, dict) or message.get("kind") not in (*_CALL_KINDS, "error"):
            return "crash", "grading worker sent a malformed message"
        return message["kind"], message.get("payload")

    def kill(self) -> None:
        for conn in (self.conn_in, self.conn_out):
            conn.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _valid_hello(hello: Any) -> bool:
    if not isinstance(hello, dict):
        return False
    names, weights = hello.get("names"), hello.get("weights")
    return (
        isinstance(names, list) and isinstance(weights, list) and len(names) == len(weights) > 0
        and all(isinstance(x, str) for x in names)
        and all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights)
    )


def _close_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.conn_out.close()  # EOF: the worker's loop ends
    for worker in workers:
        try:
            worker.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
        worker.kill()


def _child_env() -> dict[str, str]:
    """A minimal environment for a worker: no inherited variables beyond these."""
    env = {k: os.environ[k] for k in _ENV_PASSTHROUGH if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


# ---- worker process side ----

def _child_main(read_fd: int, write_fd: int) -> None:
    """Worker loop: load the environment named by the first message, then answer calls until EOF."""
    conn_in, conn_out = Connection(read_fd, writable=False), Connection(write_fd, readable=False)

    def reply(kind: str, payload: Any) -> None:
        conn_out.send_bytes(json.dumps({"kind": kind, "payload": payload}).encode())

    try:
        spec = json.loads(conn_in.recv_bytes())
        env = (_BuiltinRewards(spec["rewards"]) if spec.get("rewards")
               else _task_environment(spec["task"]) if spec.get("task")
               else _load_environment(spec["env_name"], spec["env_version"], spec["env_factory"]))
        funcs = list(env.reward_funcs)
        weights = list(env.reward_weights) if getattr(env, "reward_weights", None) is not None else [1.0] * len(funcs)
        names = [getattr(f, "__name__", f"reward_{i}") for i, f in enumerate(funcs)]
        reply("ok", {"names": names, "weights": [float(w) for w in weights]})
    except Exception as e:  # noqa: BLE001 - any load failure is reported to the parent
        reply("error", f"{type(e).__name__}: {e}")
        return
    while True:
        try:
            request = json.loads(conn_in.recv_bytes())
        except EOFError:
            return
        reply(*_call(funcs[request["func"]], request))


def _call(func: Any, request: dict[str, Any]) -> tuple[str, Any]:
    try:
        result = func(prompts=request["prompts"], completions=request["completions"], **request["kwargs"])
    except Exception as e:  # noqa: BLE001 - a reward function's failure is a recorded grade failure
        return "exception", f"{type(e).__name__}: {e}"[:500]
    if not isinstance(result, (list, tuple)):
        return "not_a_list", f"returned {type(result).__name__}, not a list"
    return "ok", [_plain(v) for v in result]


def _plain(v: Any) -> Any:
    """A JSON-safe form of one returned value: None, a float, or {"bad": description}."""
    if v is None:
        return None
    if isinstance(v, numbers.Real):
        return float(v)
    return {"bad": f"{type(v).__name__} {v!r}"[:80]}


class _BuiltinRewards:
    """A data-set job's reward functions: built-in rewards named with their weights and
    parameters (`protocol.envs.rewards`); no environment code is loaded."""

    def __init__(self, rewards: list[dict[str, Any]]) -> None:
        from swarmrl.protocol.envs.dataset import RewardSpec

        specs = [RewardSpec.model_validate(r) for r in rewards]
        self.reward_funcs = [r.build() for r in specs]
        self.reward_weights = [float(r.weight) for r in specs]


def _task_environment(task: dict[str, Any]) -> Any:
    """A reasoning-gym job's environment, built from its task table and seed (as every node builds it)."""
    from swarmrl.protocol.envs.rg_env import ReasoningGymEnv
    from swarmrl.protocol.envs.rg_task import ReasoningGymTask

    return ReasoningGymEnv(ReasoningGymTask.model_validate(task["environment"]), int(task["seed"]))


def _load_environment(name: str, version: str, factory: str | None) -> Any:
    if factory is not None:
        module_name, _, attr = factory.partition(":")
        obj = getattr(importlib.import_module(module_name), attr)
        return obj() if callable(obj) and not hasattr(obj, "reward_funcs") else obj
    from swarmrl.protocol.envs import get_environment

    env = get_environment(name, version)
    installed = getattr(env, "version", None)
    if installed is not None and str(installed) != version:
        raise ValueError(f"environment {name} is version {installed}, not {version}")
    return env
