"""Built-in jobs: the defaults `swarmrl up` and `swarmrl submit` start from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swarmrl.node.models.base_model import (
    base_model_sha256,
    find_base_model,
    is_builtin_model,
    resolve_model_name,
)
from swarmrl.node.models.recipes import GEMMA, SMOLLM2, TINY
from swarmrl.protocol.jobspec import JobSpec

# Per base model: chosen so a tiny run takes seconds per step and a Gemma run shows learning
# within 30 minutes on 2 CPU cores (see the README for the measured curve).
DEFAULTS: dict[str, dict[str, Any]] = {
    TINY: {
        "name": "arithmetic-tiny", "group_size": 4, "batch_groups": 4, "prompts_per_lease": 2, "steps": 5,
        "learning_rate": 1e-3, "lora": {"rank": 8, "alpha": 16},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "stop": ["\n"]},
        "max_async_level": 2, "lease_ttl_s": 60.0,
    },
    GEMMA: {
        "name": "arithmetic-gemma", "group_size": 8, "batch_groups": 8, "prompts_per_lease": 2, "steps": 60,
        "learning_rate": 1e-4, "lora": {"rank": 16, "alpha": 32},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "stop": ["\n"]},
        "max_async_level": 2, "lease_ttl_s": 300.0,
    },
    SMOLLM2: {   # Gemma's hyper-parameters; reasoning jobs set their own lengths (docs/REASONING.md)
        "name": "arithmetic-smollm2", "group_size": 8, "batch_groups": 8, "prompts_per_lease": 2, "steps": 60,
        "learning_rate": 1e-4, "lora": {"rank": 16, "alpha": 32},
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "stop": ["\n"]},
        "max_async_level": 2, "lease_ttl_s": 300.0,
    },
}


def builtin_job(model: str, cache_dir: Path | None = None, **overrides: Any) -> JobSpec:
    """The built-in `arithmetic` job on `model` (a built-in name, a model folder or a cached hub
    id; other models take Gemma's hyper-parameters), with field overrides.

    The base model is prepared (cached) or found to pin its sha256 in the spec.
    """
    name = resolve_model_name(model) if is_builtin_model(model) else model
    path = find_base_model(name, cache_dir)
    data = {**DEFAULTS.get(name, {**DEFAULTS[GEMMA], "name": "job"}), "base_model": name,
            "base_model_sha256": base_model_sha256(path), "environment": "arithmetic", "env_version": "1"}
    _merge(data, {k: v for k, v in overrides.items() if v is not None})
    return JobSpec.model_validate(data)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> None:
    """Deep-merge `over` into `base` (nested tables override field by field)."""
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = dict(base[key])
            _merge(base[key], value)
        else:
            base[key] = value
