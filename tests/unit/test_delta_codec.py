"""Quantised adapter deltas: exact replicas, error feedback, sizes and malformed payloads."""

import json

import pytest
import torch
import zstandard
from safetensors.torch import save as st_save

from swarmrl.protocol import adapter as ad
from swarmrl.protocol import delta_codec as dc


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"l.lora_A.weight": torch.randn(4, 50, generator=g), "l.lora_B.weight": torch.zeros(50, 4),
            "m.lora_A.weight": torch.randn(3, 7, generator=g)}


def _step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """An Adam-like update: about lr per element, some elements far smaller."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 1e-4 * torch.randn(v.shape, generator=g) ** 3 for k, v in state.items()}


@pytest.mark.parametrize("codec", dc.CODECS)
def test_replicas_stay_bit_identical_over_versions(codec):
    """Publisher (with error feedback) and two replicas decoding its payloads agree by hash at
    every version."""
    enc = dc.DeltaEncoder(codec)
    publisher = _state(0)
    replicas = [ad.clone_state(publisher), ad.clone_state(publisher)]
    for v in range(1, 9):
        payload, publisher = enc.encode(publisher, _step(publisher, v))
        replicas = [ad.apply_delta(r, dc.decode_delta(payload)) for r in replicas]
        assert {ad.adapter_hash(r) for r in replicas} == {ad.adapter_hash(publisher)}


def test_int4_error_is_bounded_and_fed_back():
    """One int4 delta is within half a step of its block's scale. The trainer steps from the
    state it adopted (new = adopted + step): with error feedback the adopted state stays close
    to the sum of all steps over many versions, without it the dropped parts add up."""
    x = torch.randn(1000) * 1e-3
    codes, scale = dc.quantize(x, "int4")
    err = (dc.dequantize(codes, scale, (1000,), "int4") - x).abs().reshape(-1)
    bound = scale.float().repeat_interleave(dc.BLOCK)[:1000] / 2 * 1.01
    assert (err <= bound).all()
    start, states = _state(1), {}
    for carry in (True, False):
        enc, s, ideal = dc.DeltaEncoder("int4"), ad.clone_state(start), ad.clone_state(start)
        for v in range(30):
            new = _step(s, 100 + v)
            ideal = {k: ideal[k] + (new[k] - s[k]) for k in s}
            _, s = enc.encode(s, new, carry=carry)
        states[carry] = max((s[k] - ideal[k]).abs().max().item() for k in s)
    assert states[True] < states[False] / 2


def test_zero_blocks_and_tiny_values_survive():
    x = torch.zeros(70)
    x[40] = 1e-30
    codes, scale = dc.quantize(x, "int4")
    y = dc.dequantize(codes, scale, (70,), "int4")
    assert y[:32].eq(0).all() and y[40] > 0


def test_int4_payload_is_about_seven_times_smaller_than_float32():
    delta = {"w": torch.randn(64, 1024) * 1e-4}
    f32, _ = dc.encode_delta(delta, "float32")
    i8, _ = dc.encode_delta(delta, "int8")
    i4, _ = dc.encode_delta(delta, "int4")
    assert len(i4) < len(f32) / 6 and len(i4) < len(i8) < len(f32) / 3


def test_float32_payload_is_the_plain_state_format():
    """float32 deltas are the pre-codec format, so stored ones still decode."""
    delta = _state(2)
    payload, sent = dc.encode_delta(delta, "float32")
    assert payload == ad.encode_state(delta)
    assert ad.adapter_hash(dc.decode_delta(payload)) == ad.adapter_hash(delta) == ad.adapter_hash(sent)


def _payload(tensors, meta) -> bytes:
    return zstandard.ZstdCompressor().compress(st_save(tensors, metadata=meta))


def _good() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    codes, scale = dc.quantize(torch.randn(40), "int4")
    return {"w": codes, "w.scale": scale}, {"codec": "int4", "block": "32", "shapes": json.dumps({"w": [40]})}


@pytest.mark.parametrize("break_it", [
    lambda t, m: m.update(codec="int3"),
    lambda t, m: m.update(block="64"),
    lambda t, m: m.update(shapes="{not json"),
    lambda t, m: m.update(shapes=json.dumps({"w": [-40]})),
    lambda t, m: m.update(shapes=json.dumps({"w": [65]})),
    lambda t, m: m.update(shapes=json.dumps({"w": [40], "v": [2]})),
    lambda t, m: t.pop("w.scale"),
    lambda t, m: t.update({"w.scale": torch.full((2,), float("nan"), dtype=torch.bfloat16)}),
    lambda t, m: t.update({"w.scale": torch.ones(2)}),
    lambda t, m: t.update({"w": t["w"].to(torch.int8)}),
    lambda t, m: t.update({"extra": torch.zeros(1)}),
])
def test_malformed_payloads_raise_delta_format_error(break_it):
    tensors, meta = _good()
    assert dc.decode_delta(_payload(tensors, meta))["w"].shape == (40,)
    break_it(tensors, meta)
    with pytest.raises(dc.DeltaFormatError):
        dc.decode_delta(_payload(tensors, meta))


def test_undecodable_payload_is_an_adapter_error():
    with pytest.raises(ad.AdapterError):
        dc.decode_delta(b"not zstd")
    with pytest.raises(ad.AdapterError):
        dc.DeltaEncoder("int4").encode({"w": torch.zeros(3)}, {"w": torch.tensor([0.0, float("inf"), 1.0])})


def test_unknown_codec_is_refused():
    with pytest.raises(ValueError):
        dc.DeltaEncoder("bf16")  # type: ignore[arg-type]


def test_job_spec_offers_exactly_the_codecs_with_int4_by_default():
    from typing import get_args

    from swarmrl.protocol.jobspec import JobSpec

    field = JobSpec.model_fields["delta_codec"]
    assert get_args(field.annotation) == dc.CODECS and field.default == dc.DEFAULT_CODEC == "int4"
