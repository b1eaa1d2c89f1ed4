"""Device placement (node/inference/device.py): settings, dtype choice, the CPU path; the CUDA
paths run where a GPU is (skipped here, saying why)."""

from __future__ import annotations

import pytest
import torch

from swarmrl.node.inference import device
from swarmrl.node.inference.device import DeviceError, load_on_device, placement_dtype, resolve_device
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.runtime.config import ConfigError, TrainerConfig, ValidatorConfig, WorkerConfig, load_config

CUDA = torch.cuda.is_available()


def test_cpu_and_auto_resolve_without_a_gpu() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if CUDA else torch.device("cpu"))


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CPU", "", "cuda:0:1"])
def test_unknown_settings_are_refused(name: str) -> None:
    with pytest.raises(DeviceError, match="is not one of"):
        resolve_device(name)


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_config_error(name: str) -> None:
    with pytest.raises(DeviceError, match="CUDA is not available"):
        resolve_device(name)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_index_past_the_last_gpu_is_refused() -> None:
    with pytest.raises(DeviceError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_dtype_bf16_kept_where_supported_fp16_refused_for_gemma3(monkeypatch) -> None:
    monkeypatch.setattr(device, "cpu_bf16_native", lambda: True)
    cpu = torch.device("cpu")
    assert placement_dtype(cpu, torch.bfloat16, "gemma3_text") == torch.bfloat16
    assert placement_dtype(cpu, torch.float32, "llama") == torch.float32
    assert placement_dtype(cpu, torch.float16, "llama") == torch.float16
    with pytest.raises(DeviceError, match="float16 overflows"):
        placement_dtype(cpu, torch.float16, "gemma3_text")


def test_bf16_on_a_gpu_without_bf16_is_upcast_to_fp32(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert placement_dtype(torch.device("cuda", 0), torch.bfloat16, "gemma3_text") == torch.float32


def test_bf16_on_a_cpu_without_bf16_instructions_is_upcast_to_fp32(monkeypatch) -> None:
    """torch emulates bf16 on such a CPU (4.4x slower sampling for Gemma 270M on an AVX2 EPYC)."""
    monkeypatch.setattr(device, "cpu_bf16_native", lambda: False)
    assert placement_dtype(torch.device("cpu"), torch.bfloat16, "gemma3_text") == torch.float32
    assert placement_dtype(torch.device("cpu"), torch.float32, "llama") == torch.float32


@pytest.mark.parametrize(("cpuinfo", "native"), [
    ("model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n", False),               # AVX2 only
    ("flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni\n", False),                          # AVX-512, no BF16
    ("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n", True),                  # Sapphire Rapids
    ("processor\t: 0\nFeatures\t: fp asimd evtstrm aes sha2 bf16 i8mm\n", True),           # Arm Neoverse V1
    ("Features\t: fp asimd evtstrm aes\n", False),
    ("", False),
])
def test_cpu_bf16_native_reads_the_cpus_flags(cpuinfo: str, native: bool) -> None:
    assert device.cpu_bf16_native(cpuinfo) is native


def test_load_on_cpu_keeps_the_manifest_dtype(model_cache) -> None:
    model, tokenizer = load_on_device(prepare_base_model("tiny", model_cache), "cpu")
    assert next(model.parameters()).device.type == "cpu" and model.dtype == torch.float32
    assert tokenizer.padding_side == "left"


@pytest.mark.parametrize("cls", [TrainerConfig, WorkerConfig, ValidatorConfig])
def test_roles_take_a_device_setting(cls) -> None:
    assert cls().device == "auto"
    assert load_config(cls, None, ["device=cuda:1"]).device == "cuda:1"
    with pytest.raises(ConfigError, match="device"):
        load_config(cls, None, ["device=gpu0"])
