"""Inference backends behind one interface (`base.InferenceBackend`): `hf` (transformers + peft,
CPU) here; a vLLM backend implements the same interface. `scoring` recomputes sampling
log-probs in one prefill (trainer and validator)."""

from __future__ import annotations

from pathlib import Path

import torch

from swarmrl.node.inference.base import InferenceBackend, LoraShape, SampledCompletion, Sampling

__all__ = ["BACKENDS", "InferenceBackend", "LoraShape", "SampledCompletion", "Sampling", "build_backend"]

BACKENDS = ("hf",)
DEFAULT_LORA_RANK, DEFAULT_LORA_ALPHA = 16, 32  # shape of slots made by set_adapter without add_slot


def build_backend(
    kind: str, model_path: Path, *, dtype: torch.dtype | None = None, num_threads: int | None = None
) -> InferenceBackend:
    """Load the prepared base model at `model_path` (see `node.models.prepare_base_model`) into
    backend `kind` ("hf"). dtype defaults to the model's manifest (bf16 Gemma, fp32 tiny);
    num_threads, if given, sets torch's process-wide thread count.

    Raises ValueError on an unknown or unavailable backend kind.
    """
    if kind == "hf":
        from swarmrl.node.causal_lm import load_causal_lm, lora_config
        from swarmrl.node.inference.hf import HFBackend

        model, tokenizer = load_causal_lm(model_path, dtype=dtype, num_threads=num_threads)
        return HFBackend(model, tokenizer, lora_config(DEFAULT_LORA_RANK, DEFAULT_LORA_ALPHA))
    if kind == "vllm":
        raise ValueError("the vllm backend is not implemented yet; use backend='hf'")
    raise ValueError(f"unknown inference backend {kind!r}; known: {BACKENDS}")
