"""LoRA adapter states: canonical hashing, snapshots and exact deltas.

Legend: a *state* maps peft's adapter tensor names (what `adapter_model.safetensors` holds, as
`peft.get_peft_model_state_dict` returns them) to float32 tensors.

Exactness: a delta is `new - old` (float32, elementwise). The publisher adopts `old + delta` as
its new state (`make_delta` returns it), and IEEE-754 addition is correctly rounded and
elementwise, so every peer that applies the delta to the same `old` gets bit-identical tensors
(checked by `adapter_hash`), on any machine. Payloads are safetensors bytes compressed with zstd
(lossless). Snapshots are float32 states; a delta may also be block-quantised
(`delta_codec.py`), and exactness holds the same way: the publisher adopts `old + dequantised`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import torch
import zstandard
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

CODEC = "safetensors+zstd"
ZSTD_LEVEL = 3
MAX_STATE_BYTES = 1 << 30  # decompressed payloads above 1 GiB are refused (decompression bombs)

State = dict[str, torch.Tensor]


class AdapterError(ValueError):
    """A payload, delta or state does not match what its header or peer promised."""


def adapter_hash(state: Mapping[str, torch.Tensor]) -> bytes:
    """32-byte sha256 over (name, dtype, shape, raw bytes) of every tensor, sorted by name."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(name.encode() + b"\x00" + str(t.dtype).encode() + b"\x00")
        h.update(",".join(map(str, t.shape)).encode() + b"\x00")
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def clone_state(state: Mapping[str, torch.Tensor]) -> State:
    """Detached float32 CPU copies of every tensor."""
    return {k: v.detach().to("cpu", torch.float32).clone().contiguous() for k, v in state.items()}


def encode_tensors(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """safetensors bytes of `tensors` (any dtype) with optional string metadata, zstd-compressed."""
    raw = st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=dict(metadata or {}) or None)
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)


def encode_state(state: Mapping[str, torch.Tensor]) -> bytes:
    """Serialize a state (snapshot or float32 delta) to compressed bytes (codec `CODEC`)."""
    return encode_tensors(state)


def load_tensors(payload: bytes, *, max_bytes: int = MAX_STATE_BYTES) -> tuple[State, dict[str, str]]:
    """Inverse of `encode_tensors`: (tensors of any dtype, metadata).

    Raises:
        AdapterError: not zstd/safetensors, or larger than `max_bytes` once decompressed.
    """
    try:
        with zstandard.ZstdDecompressor().stream_reader(payload) as reader:
            raw = reader.read(max_bytes + 1)
        if len(raw) > max_bytes:
            raise AdapterError(f"adapter payload decompresses to more than {max_bytes} bytes")
        tensors = st_load(raw)
        header_len = int.from_bytes(raw[:8], "little")
        meta = json.loads(raw[8:8 + header_len]).get("__metadata__") or {}
    except (zstandard.ZstdError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"undecodable adapter payload: {exc}") from exc
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise AdapterError("adapter payload metadata must map strings to strings")
    return tensors, meta


def check_float32(state: State) -> State:
    """`state` itself when every tensor is float32.

    Raises:
        AdapterError: a tensor of another dtype.
    """
    for name, t in state.items():
        if t.dtype != torch.float32:
            raise AdapterError(f"tensor {name} has dtype {t.dtype}, expected float32")
    return state


def decode_state(payload: bytes, *, max_bytes: int = MAX_STATE_BYTES) -> State:
    """Inverse of `encode_state` (snapshots; deltas are `delta_codec.decode_delta`'s).

    Raises:
        AdapterError: not zstd/safetensors, larger than `max_bytes` once decompressed, or a
            tensor that is not float32.
    """
    return check_float32(load_tensors(payload, max_bytes=max_bytes)[0])


def payload_sha256(payload: bytes) -> bytes:
    """Content address of a payload (32 bytes)."""
    return hashlib.sha256(payload).digest()


def _check_same_layout(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    if set(a) != set(b):
        missing, extra = sorted(set(a) - set(b))[:3], sorted(set(b) - set(a))[:3]
        raise AdapterError(f"tensor names differ (missing {missing}, unexpected {extra})")
    for k in a:
        if a[k].shape != b[k].shape:
            raise AdapterError(f"tensor {k}: shape {tuple(b[k].shape)} != {tuple(a[k].shape)}")


def make_delta(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> tuple[State, State]:
    """Return (delta, exact_new): delta = new - old and exact_new = old + delta (float32).

    The publisher must adopt `exact_new` as its state: it is what every peer reconstructs.
    """
    _check_same_layout(old, new)
    delta = {k: (new[k].detach().float() - old[k].float()).contiguous() for k in old}
    return delta, apply_delta(old, delta)


def apply_delta(old: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> State:
    """old + delta, elementwise float32.

    Raises:
        AdapterError: the names/shapes differ or the delta holds non-finite values.
    """
    _check_same_layout(old, delta)
    for k, d in delta.items():
        if not torch.isfinite(d).all():
            raise AdapterError(f"delta tensor {k} holds non-finite values")
    return {k: (old[k].float() + delta[k]).contiguous() for k in old}
