"""Installed environments, pinned by (name, version), and the held-out split helper.

Environments are found through the entry-point group `swarmrl.environments` (the built-in
`arithmetic` registers there too, in pyproject.toml); an entry point names an `Environment`
subclass, or a `verifiers`-style module whose `load_environment()` is adapted
(`protocol.envs.verifiers_adapter`). `ENVIRONMENTS` holds the built-ins, so a source checkout
that was never installed still finds them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any

from swarmrl.protocol.envs.arithmetic import ArithmeticEnv
from swarmrl.protocol.envs.base import (
    HELDOUT_START,
    Environment,
    PromptSpec,
    RewardFunc,
    grade,
    reward_kwargs,
    total_reward,
)
from swarmrl.protocol.envs.calculator import CalculatorEnv
from swarmrl.protocol.envs.wordle import WordleEnv

# name -> version -> environment class
ENVIRONMENTS: dict[str, dict[str, type[Environment]]] = {
    ArithmeticEnv.name: {ArithmeticEnv.version: ArithmeticEnv},
    CalculatorEnv.name: {CalculatorEnv.version: CalculatorEnv},
    WordleEnv.name: {WordleEnv.version: WordleEnv},
}

__all__ = [
    "ENVIRONMENTS",
    "HELDOUT_START",
    "Environment",
    "PromptSpec",
    "RewardFunc",
    "get_environment",
    "grade",
    "heldout_indices",
    "heldout_prompts",
    "installed_environments",
    "job_environment",
    "reward_kwargs",
    "total_reward",
]


ENTRY_POINT_GROUP = "swarmrl.environments"


@dataclass(frozen=True)
class InstalledEnv:
    """One installed environment as announced: name, version, and the hash of its package files."""

    name: str
    version: str
    package: str
    package_sha256: str
    entry_point: str


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _load_entry(ep: importlib.metadata.EntryPoint) -> type[Environment] | Any:
    obj = ep.load()
    if isinstance(obj, type) and issubclass(obj, Environment):
        return obj
    from swarmrl.protocol.envs.verifiers_load import adapt_verifiers

    return adapt_verifiers(obj)


def package_sha256(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    """(distribution name, sha256 over its RECORD lines): the installed package's identity.

    The RECORD file lists every installed file with its own sha256, so equal RECORDs mean equal
    code; a distribution without one (a source checkout) hashes its name and version.
    """
    dist = ep.dist
    if dist is None:
        return "", hashlib.sha256(ep.value.encode()).hexdigest()
    record = dist.read_text("RECORD") or f"{dist.metadata['Name']}=={dist.version}"
    lines = sorted(line for line in record.splitlines() if line and not line.split(",")[0].endswith(".pyc"))
    return str(dist.metadata["Name"]), hashlib.sha256("\n".join(lines).encode()).hexdigest()


def installed_environments() -> list[InstalledEnv]:
    """Every environment this machine can run (entry points, then built-ins not registered)."""
    out = []
    eps = _entry_points()
    for name, ep in sorted(eps.items()):
        try:
            env = _instantiate(_load_entry(ep))
        except Exception:  # noqa: BLE001, S112 - a broken package must not hide the others
            continue
        package, sha = package_sha256(ep)
        out.append(InstalledEnv(name, str(env.version), package, sha, ep.value))
    for name, versions in sorted(ENVIRONMENTS.items()):
        if name not in eps:
            for version in sorted(versions):
                out.append(InstalledEnv(name, version, "swarmrl", "", f"{versions[version].__module__}"))
    return out


def _instantiate(obj: Any) -> Environment:
    env: Environment = obj() if isinstance(obj, type) else obj
    return env


def get_environment(name: str, version: str | None = None) -> Environment:
    """The installed environment `name` at `version` (default: its newest version).

    Raises:
        ValueError: unknown name or version (the message lists the known ones).
    """
    versions = ENVIRONMENTS.get(name)
    if versions is None:
        ep = _entry_points().get(name)
        if ep is None:
            known = sorted(set(ENVIRONMENTS) | set(_entry_points()))
            raise ValueError(f"environment {name!r} is not installed here; installed: {known}")
        env = _instantiate(_load_entry(ep))
        if version is not None and str(env.version) != version:
            raise ValueError(f"environment {name!r} is version {env.version} here, not {version}")
        return env
    if version is None:
        version = max(versions, key=lambda v: (len(v), v))
    if version not in versions:
        raise ValueError(f"unknown version {version!r} of environment {name!r}; known: {sorted(versions)}")
    return versions[version]()


def heldout_indices(n: int) -> range:
    """The first `n` held-out indices: [HELDOUT_START, HELDOUT_START + n).

    Raises:
        ValueError: negative n.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return range(HELDOUT_START, HELDOUT_START + n)


def heldout_prompts(env: Environment, n: int, seed: int) -> list[PromptSpec]:
    """`n` evaluation prompts, from indices training never uses (>= HELDOUT_START).

    Environments draw held-out indices from problems that training indices never produce (for
    `arithmetic`: a fixed hash split of the problems), so evaluation never sees a training prompt.

    Raises:
        ValueError: negative n or seed.
    """
    return env.prompts(seed, heldout_indices(n))


def job_environment(spec: Any, dataset: bytes | None = None) -> Environment:
    """The environment of a `JobSpec`: its data-set task over `dataset` (the file's bytes), its
    reasoning-gym tasks, or the installed environment it names.

    Raises:
        ValueError: a data-set job without its bytes (or with other bytes), an environment that
            is not installed here, reasoning-gym tasks that can't be built (`RGTaskError`).
    """
    from swarmrl.protocol.envs.dataset import DatasetEnv

    rg = getattr(spec, "reasoning_gym", None)
    if rg is not None:
        from swarmrl.protocol.envs.rg_env import ReasoningGymEnv

        return ReasoningGymEnv(rg, spec.seed)
    task = spec.dataset
    if task is None:
        return get_environment(spec.environment, spec.env_version)
    if dataset is None:
        raise ValueError(f"job's data set {task.dataset} ({task.dataset_sha256[:12]}) is not available here")
    return DatasetEnv(task, dataset, spec.seed)
