"""Adapter deltas on the wire: block-quantised (int4 / int8) or exact float32, then zstd.

Legend: `x_N` a flattened delta tensor, `codes_N` its integer codes, `scale_K` one scale per
block of `BLOCK` values (K = ceil(N / BLOCK)), `q` the codes' bound (7 for int4, 127 for int8).

Quantisation (symmetric absmax per block, round to nearest, in the style of QLoRA's blockwise
quantisation, arXiv:2305.14314, section 3): `scale = bf16(max|x| / q)`, `codes = clamp(round(x /
scale), -q, q)`; dequantised values are `codes * scale`, one correctly rounded float32 product
per value. Replicas stay exact: the publisher adopts `old + dequantised` as its new state
(`encode_delta` returns it), and every peer computes the same float32 products and sums from the
same bytes, so all of them hold bit-identical adapters (checked by `adapter_hash`). The
quantisation error of one version is not lost: `DeltaEncoder` carries it into the next
version's delta (error feedback, as in 1-bit SGD / EF-SGD, arXiv:1901.09847).

Payload: zstd-compressed safetensors. A quantised payload holds, per adapter tensor NAME, the
tensor NAME (uint8: two int4 codes per byte, low nibble first, stored as code + 8; or int8 codes)
and `NAME.scale` (bf16, K values), and metadata `codec`, `block` and `shapes` (JSON: NAME ->
shape). A float32 payload is `adapter.encode_state(delta)` itself (no metadata), as before this
codec existed, so stored float32 deltas still decode. Scales are bf16 (float32's range, so no
block underflows to zero; their precision does not matter, since the codes are taken against the
stored scale).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Literal, get_args

import torch

from swarmrl.protocol import adapter as ad

DeltaCodec = Literal["int4", "int8", "float32"]
CODECS: tuple[DeltaCodec, ...] = get_args(DeltaCodec)
DEFAULT_CODEC: DeltaCodec = "int4"
BLOCK = 32
_BOUND = {"int4": 7, "int8": 127}
_SCALE = ".scale"


class DeltaFormatError(ad.AdapterError):
    """A delta payload that does not follow its codec's format (rejected, never applied)."""


def header_codec(codec: DeltaCodec) -> str:
    """What a delta's signed `AdapterUpdate.codec` says, e.g. "int4-b32+safetensors+zstd"."""
    return ad.CODEC if codec == "float32" else f"{codec}-b{BLOCK}+{ad.CODEC}"


# ---- quantise / dequantise one tensor

def _blocks(x: torch.Tensor) -> torch.Tensor:
    """Flatten `x` (float32) and zero-pad it to whole blocks: [K, BLOCK]."""
    x_N = x.detach().reshape(-1).to(torch.float32)
    pad = (-x_N.numel()) % BLOCK
    return torch.nn.functional.pad(x_N, (0, pad)).reshape(-1, BLOCK)


def quantize(x: torch.Tensor, codec: DeltaCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_K) of one tensor: codes packed uint8 for int4, int8 for int8."""
    q = _BOUND[codec]
    x_KB = _blocks(x)
    if not torch.isfinite(x_KB).all():
        raise ad.AdapterError("cannot quantise a delta holding non-finite values")
    scale_K = (x_KB.abs().amax(dim=1) / q).to(torch.bfloat16)
    s_K1 = scale_K.to(torch.float32).unsqueeze(1)
    codes_KB = torch.where(s_K1 > 0, torch.round(x_KB / torch.where(s_K1 > 0, s_K1, 1.0)), 0.0).clamp(-q, q)
    codes_N = codes_KB.reshape(-1).to(torch.int8)
    if codec == "int8":
        return codes_N, scale_K
    nibbles = (codes_N + 8).to(torch.uint8).reshape(-1, 2)   # BLOCK is even: whole pairs
    return (nibbles[:, 0] | (nibbles[:, 1] << 4)).contiguous(), scale_K


def dequantize(codes: torch.Tensor, scale_K: torch.Tensor, shape: tuple[int, ...], codec: DeltaCodec) -> torch.Tensor:
    """float32 tensor of `shape` from codes and scales (what every replica adds).

    Raises:
        DeltaFormatError: dtypes or sizes that don't fit `shape`, or non-finite scales.
    """
    numel = math.prod(shape)
    blocks = -(-numel // BLOCK)
    want = torch.uint8 if codec == "int4" else torch.int8
    per_value = 2 if codec == "int4" else 1
    if codes.dtype != want or codes.dim() != 1 or codes.numel() * per_value != blocks * BLOCK:
        raise DeltaFormatError(f"{codec} codes: {codes.dtype} x {codes.numel()} do not fit shape {shape}")
    if scale_K.dtype != torch.bfloat16 or scale_K.shape != (blocks,) or not torch.isfinite(scale_K).all():
        raise DeltaFormatError(f"scales: {scale_K.dtype} {tuple(scale_K.shape)}, expected {blocks} finite bf16")
    if codec == "int4":
        lo, hi = (codes & 0xF).to(torch.int16) - 8, (codes >> 4).to(torch.int16) - 8
        codes = torch.stack([lo, hi], dim=1).reshape(-1)
    codes_KB = codes.to(torch.float32).reshape(blocks, BLOCK)
    x_KB = codes_KB * scale_K.to(torch.float32).unsqueeze(1)
    return x_KB.reshape(-1)[:numel].reshape(shape).contiguous()


# ---- whole deltas

def encode_delta(delta: Mapping[str, torch.Tensor], codec: DeltaCodec) -> tuple[bytes, ad.State]:
    """(payload, dequantised delta): the bytes to publish and the float32 delta every replica
    will decode from them (the publisher adds this one, not `delta`)."""
    if codec == "float32":
        exact = ad.clone_state(delta)
        return ad.encode_state(exact), exact
    tensors: dict[str, torch.Tensor] = {}
    out: ad.State = {}
    for name in sorted(delta):
        if name.endswith(_SCALE):
            raise ad.AdapterError(f"tensor name {name!r} clashes with the codec's scale names")
        codes, scale_K = quantize(delta[name], codec)
        tensors[name], tensors[name + _SCALE] = codes, scale_K
        out[name] = dequantize(codes, scale_K, tuple(delta[name].shape), codec)
    shapes = {k: list(v.shape) for k, v in delta.items()}
    meta = {"codec": codec, "block": str(BLOCK), "shapes": json.dumps(shapes, sort_keys=True)}
    return ad.encode_tensors(tensors, meta), out


def decode_delta(payload: bytes, *, max_bytes: int = ad.MAX_STATE_BYTES) -> ad.State:
    """The float32 delta a payload carries (any codec; see the module docstring).

    Raises:
        ad.AdapterError: not zstd/safetensors (or too large);
        DeltaFormatError: a quantised payload that breaks its format.
    """
    tensors, meta = ad.load_tensors(payload, max_bytes=max_bytes)
    if "codec" not in meta:
        return ad.check_float32(tensors)
    codec, shapes = _parse_meta(meta)
    if set(tensors) != set(shapes) | {k + _SCALE for k in shapes}:
        raise DeltaFormatError("tensors do not match the declared shapes (one codes and one scale tensor per name)")
    return {k: dequantize(tensors[k], tensors[k + _SCALE], shape, codec) for k, shape in shapes.items()}


def _parse_meta(meta: Mapping[str, str]) -> tuple[DeltaCodec, dict[str, tuple[int, ...]]]:
    codec = meta.get("codec")
    if codec not in _BOUND:
        raise DeltaFormatError(f"unknown delta codec {codec!r}")
    if meta.get("block") != str(BLOCK):
        raise DeltaFormatError(f"block size {meta.get('block')!r}, expected {BLOCK}")
    try:
        raw = json.loads(meta.get("shapes", ""))
    except ValueError as exc:
        raise DeltaFormatError(f"shapes are not JSON: {exc}") from exc
    if not isinstance(raw, dict) or not all(
            isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)
            for s in raw.values()):
        raise DeltaFormatError("shapes must map names to lists of non-negative integers")
    return codec, {str(k): tuple(s) for k, s in raw.items()}  # type: ignore[return-value]


class DeltaEncoder:
    """The publisher's side: encodes each version's delta and, while it publishes alone, carries
    what quantisation left out into the next one (error feedback), so small updates accumulate
    instead of vanishing.

    `residual` is in-memory only: a restarted trainer starts again from zero. Trainers that
    average gradients must publish bit-identical deltas, and a residual is state a cotrainer
    that joined later does not hold, so with cotrainers the publisher passes `carry=False`
    (no residual is added or kept), and `reset` when it adopts versions it did not publish.
    """

    def __init__(self, codec: DeltaCodec = DEFAULT_CODEC) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown delta codec {codec!r} (one of {CODECS})")
        self.codec = codec
        self.residual: ad.State = {}

    def encode(self, old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *,
               carry: bool = True) -> tuple[bytes, ad.State]:
        """(payload, exact_new): the delta new - old (+ the carried residual) encoded, and
        old + its dequantised value: the state every replica reconstructs, for the publisher
        to adopt."""
        delta, _ = ad.make_delta(old, new)
        if carry and self.residual.keys() == delta.keys():
            delta = {k: delta[k] + self.residual[k] for k in delta}
        payload, sent = encode_delta(delta, self.codec)
        self.residual = {k: delta[k] - sent[k] for k in delta} if carry and self.codec != "float32" else {}
        return payload, ad.apply_delta(old, sent)

    def reset(self) -> None:
        """Forget the residual (the head was replaced by state this encoder did not publish)."""
        self.residual = {}
