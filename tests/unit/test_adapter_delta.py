"""Adapter hashing, exact deltas and payload encoding."""

import pytest
import torch

from swarmrl.protocol import adapter as ad


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"l.lora_A.weight": torch.randn(4, 16, generator=g), "l.lora_B.weight": torch.randn(16, 4, generator=g)}


def test_hash_depends_on_names_values_and_shapes():
    s = _state(0)
    assert ad.adapter_hash(s) == ad.adapter_hash({k: v.clone() for k, v in s.items()})
    assert ad.adapter_hash(s) != ad.adapter_hash(_state(1))
    renamed = {("x" + k): v for k, v in s.items()}
    assert ad.adapter_hash(s) != ad.adapter_hash(renamed)
    reshaped = {k: v.reshape(-1) for k, v in s.items()}
    assert ad.adapter_hash(s) != ad.adapter_hash(reshaped)


def test_delta_chain_reconstructs_bit_identical_state():
    """A replica applying the encoded deltas ends with the publisher's exact tensors."""
    publisher = _state(0)
    replica = ad.clone_state(publisher)
    for step in range(20):
        target = {k: v + 1e-3 * torch.randn_like(v) * (step + 1) for k, v in publisher.items()}
        delta, publisher = ad.make_delta(publisher, target)
        replica = ad.apply_delta(replica, ad.decode_state(ad.encode_state(delta)))
        assert ad.adapter_hash(replica) == ad.adapter_hash(publisher)


def test_apply_delta_rejects_layout_mismatch_and_nonfinite():
    s = _state(0)
    with pytest.raises(ad.AdapterError, match="names"):
        ad.apply_delta(s, {"other": torch.zeros(1)})
    with pytest.raises(ad.AdapterError, match="shape"):
        ad.apply_delta(s, {k: torch.zeros(2) for k in s})
    bad = {k: torch.zeros_like(v) for k, v in s.items()}
    bad["l.lora_A.weight"][0, 0] = float("nan")
    with pytest.raises(ad.AdapterError, match="non-finite"):
        ad.apply_delta(s, bad)


def test_decode_rejects_garbage_and_bombs():
    with pytest.raises(ad.AdapterError):
        ad.decode_state(b"not zstd")
    payload = ad.encode_state({"big": torch.zeros(1 << 16)})
    with pytest.raises(ad.AdapterError):
        ad.decode_state(payload, max_bytes=1024)
