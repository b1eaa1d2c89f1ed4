"""Device placement for every role that runs a torch model (worker HF backend, trainer learner,
validator): `device = "auto" | "cuda" | "cuda:N" | "cpu"` in the role's config.

CUDA is touched only when the setting asks for it ("auto" asks `torch.cuda.is_available()`, which
is False and cheap on a machine without a GPU), so every test passes on a CPU-only machine.

Dtype: the model's manifest dtype (bf16 Gemma, fp32 tiny) where the device computes it natively.
Elsewhere a bf16 model is upcast to float32, never cast to float16: float16 overflows Gemma 3's
activations (its residual stream exceeds 65504), the logits turn into NaN and a worker would sign
NaN log-probs. An explicit float16 request for a Gemma 3 model is refused. Natively: a GPU from
Ampere on; a CPU with bf16 instructions (x86 AVX512-BF16 or AMX, Arm BF16). torch emulates bf16 on
other CPUs: on an AVX2-only AMD EPYC, Gemma 270M sampled 16 completions over 399-token prompts at
2.0 tokens/s in bf16 and 8.6 in float32 (4.4x, one thread). The validator's log-prob tolerance
stays that of the manifest dtype (workers elsewhere sample in it): `validator.Validator`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEVICE_HELP = '"auto" (the first CUDA GPU if there is one, else the CPU), "cuda", "cuda:N" or "cpu"'
FP16_UNSAFE = ("gemma3", "gemma3_text", "gemma2")   # model_type values whose activations overflow float16


class DeviceError(ValueError):
    """A device setting this machine can't honour (a configuration error)."""


def check_device_name(name: str) -> str:
    """`name` if it is syntactically a device setting (no torch.cuda call). Raises DeviceError."""
    text = name.strip()
    if text in ("auto", "cpu", "cuda"):
        return text
    if text.startswith("cuda:") and text[5:].isdigit():
        return text
    raise DeviceError(f"device {name!r} is not one of {DEVICE_HELP}")


def resolve_device(name: str = "auto") -> torch.device:
    """The torch device for setting `name`.

    "cpu": the CPU (CUDA is never touched). "auto": cuda:0 if CUDA is available, else the CPU.
    "cuda" / "cuda:N": that GPU. Raises DeviceError on an unknown setting, or "cuda[:N]" on a
    machine without CUDA or without GPU N.
    """
    text = check_device_name(name)
    if text == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if text == "auto":
        return torch.device("cuda", 0) if available else torch.device("cpu")
    if not available:
        raise DeviceError(f"device {name!r}: CUDA is not available on this machine (use 'cpu' or 'auto')")
    index = int(text[5:]) if ":" in text else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"device {name!r}: this machine has {count} CUDA device(s)")
    return torch.device("cuda", index)


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")   # /proc/cpuinfo: x86 flags, Arm features


def cpu_bf16_native(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bfloat16 instructions (`BF16_CPU_FLAGS` among /proc/cpuinfo's
    flags / features; `cpuinfo`: that file's text, for tests). False where the file can't be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    words = {w for line in cpuinfo.splitlines() if line.lower().startswith(("flags", "features"))
             for w in line.split(":", 1)[-1].split()}
    return any(flag in words for flag in BF16_CPU_FLAGS)


def bf16_supported(device: torch.device) -> bool:
    """Whether `device` computes in bfloat16 natively (a GPU from Ampere on; a CPU with
    `cpu_bf16_native`)."""
    if device.type != "cuda":
        return cpu_bf16_native()
    return bool(torch.cuda.is_bf16_supported())


def placement_dtype(device: torch.device, preferred: torch.dtype, model_type: str = "") -> torch.dtype:
    """The dtype to load a model in on `device`, given its `preferred` (manifest) dtype.

    bfloat16 stays bfloat16 where supported, else becomes float32 (never float16, see the module
    docstring). float16 on a model whose activations overflow it (Gemma 2/3) is refused with a
    DeviceError. Every other dtype is kept.
    """
    if preferred == torch.float16 and model_type in FP16_UNSAFE:
        raise DeviceError(f"float16 overflows {model_type} activations (NaN logits): load it in bfloat16 or float32")
    if preferred == torch.bfloat16 and not bf16_supported(device):
        log.warning("%s has no native bfloat16: loading the model in float32 (float16 would overflow Gemma 3)", device)
        return torch.float32
    return preferred


def load_on_device(
    path: Path, device: str = "auto", *, dtype: torch.dtype | None = None, num_threads: int | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`causal_lm.load_causal_lm` on the resolved `device`, in `placement_dtype` of the manifest's
    dtype (or `dtype`). Returns (model, tokenizer). Raises DeviceError as `resolve_device` and
    `placement_dtype` do."""
    from transformers import AutoConfig

    from swarmrl.node.models.causal_lm import load_causal_lm, manifest_dtype

    where = resolve_device(device)
    wanted = dtype or manifest_dtype(Path(path))
    model_type = str(getattr(AutoConfig.from_pretrained(path), "model_type", ""))
    model, tokenizer = load_causal_lm(path, dtype=placement_dtype(where, wanted, model_type), num_threads=num_threads)
    if where.type != "cpu":
        cast(Any, model).to(where)
        log.info("model %s on %s (%s)", Path(path).name, where, model.dtype)
    return model, tokenizer
