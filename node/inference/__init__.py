"""Inference backends behind one interface (`base.InferenceBackend`): `hf` (transformers + peft,
in-process) and `vllm` (vLLM's server in its own environment, `vllm.py`). `scoring` recomputes
sampling log-probs in one prefill (trainer and validator)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from swarmrl.node.inference.base import (
    DEFAULT_LORA_ALPHA,
    DEFAULT_LORA_RANK,
    InferenceBackend,
    LoraShape,
    SampledCompletion,
    Sampling,
)

__all__ = ["BACKENDS", "InferenceBackend", "LoraShape", "SampledCompletion", "Sampling", "build_backend"]

log = logging.getLogger(__name__)

BACKENDS = ("hf", "vllm")


def build_backend(
    kind: str, model_path: Path, *, dtype: torch.dtype | None = None, num_threads: int | None = None,
    vllm_url: str | None = None, vllm_log: Path | None = None, device: str = "auto", max_jobs: int = 2,
) -> InferenceBackend:
    """Load the prepared base model at `model_path` (see `node.models.base_model.prepare_base_model`) into
    backend `kind` ("hf" or "vllm"). dtype defaults to the model's manifest (bf16 Gemma, fp32
    tiny; `device.placement_dtype` of it on a GPU); num_threads, if given, sets torch's
    process-wide thread count (hf); device: "auto" | "cpu" | "cuda" | "cuda:N" (hf; see
    `device.resolve_device`).

    "vllm" starts vLLM's server from `.venv-vllm` as this process's child (log at `vllm_log`), or
    attaches to the operator's server at `vllm_url`; without vLLM's environment and without a URL
    it falls back to "hf" with a warning. max_jobs: the jobs whose adapters one vLLM engine batch
    carries (the server's `--max-loras` is one more, for the base model's zero adapter).
    Raises ValueError on an unknown backend kind or a model vLLM can't run, DeviceError (a
    ValueError) on a device this machine lacks; see
    `vllm_start.start_vllm_backend` for the vLLM server's errors.
    """
    if kind == "vllm":
        from swarmrl.node.inference.vllm_server import vllm_python

        if vllm_url is None and vllm_python() is None:
            log.warning("backend 'vllm' asked for, but vLLM's environment (.venv-vllm) is absent: falling back "
                        "to the transformers backend (run scripts/vllm_env.sh to set vLLM up)")
            kind = "hf"
        else:
            from swarmrl.node.inference.vllm_start import start_vllm_backend

            return start_vllm_backend(model_path, url=vllm_url, log_path=vllm_log, max_jobs=max_jobs)
    if kind == "hf":
        from swarmrl.node.inference.device import load_on_device
        from swarmrl.node.inference.hf import HFBackend
        from swarmrl.node.models.causal_lm import lora_config, manifest_dtype

        model, tokenizer = load_on_device(model_path, device, dtype=dtype, num_threads=num_threads)
        backend = HFBackend(model, tokenizer, lora_config(DEFAULT_LORA_RANK, DEFAULT_LORA_ALPHA))
        manifest = manifest_dtype(Path(model_path))
        backend.sampled_dtype = manifest if manifest != backend.dtype else None
        return backend
    raise ValueError(f"unknown inference backend {kind!r}; known: {BACKENDS}")
