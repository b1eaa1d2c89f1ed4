"""protocol/step_replay.py against the publisher's own encoder (protocol.delta_codec.DeltaEncoder):
a replayed step predicts the published version exactly, with error feedback carried across
versions and after a restart dropped it; a different step is far off."""

from __future__ import annotations

import pytest
import torch

from swarmrl.protocol import adapter as ad
from swarmrl.protocol import step_replay
from swarmrl.protocol.delta_codec import DeltaEncoder


def _state(seed: int, scale: float = 1.0) -> ad.State:
    g = torch.Generator().manual_seed(seed)
    return {"a.lora_A.weight": torch.randn(4, 64, generator=g) * scale, "a.lora_B.weight": torch.randn(64, 4, generator=g) * scale}


def _replay(prev: ad.State, steps: list[ad.State], published: list[ad.State], codec: str):
    """Mismatch of each published version against the replayed steps (as audit_replay does it:
    the step's change is the learner's new state minus the published previous one)."""
    out, residual = [], {}
    for moved, pub in zip(steps, published):
        step, _ = ad.make_delta(prev, ad.apply_delta(prev, moved))
        m, x = min(((step_replay.mismatch(p, pub, prev), x) for p, x in
                    (step_replay.predict(prev, step, r, codec) for r in (residual, {}))), key=lambda mx: mx[0])
        out.append(m)
        residual = step_replay.next_residual(x, prev, pub, codec)
        prev = pub
    return out


@pytest.mark.parametrize("codec", ["int4", "int8", "float32"])
def test_the_published_versions_are_predicted_exactly(codec) -> None:
    w0, enc = _state(0), DeltaEncoder(codec)
    steps = [_state(i + 1, 1e-3) for i in range(4)]
    published, w = [], w0
    for i, step in enumerate(steps):
        if i == 2:
            enc.reset()   # the trainer restarted: its residual is gone
        _, w = enc.encode(w, ad.apply_delta(w, step))
        published.append(w)
    assert _replay(w0, steps, published, codec) == [0.0] * 4


def test_another_step_is_far_off() -> None:
    w0, enc = _state(0), DeltaEncoder("int4")
    step, other = _state(1, 1e-3), _state(2, 1e-3)
    _, w1 = enc.encode(w0, ad.apply_delta(w0, step))
    assert _replay(w0, [other], [w1], "int4")[0] > 1.0
    half = {k: v * 0.5 for k, v in step.items()}   # the same direction, half the size (a group left out)
    assert _replay(w0, [half], [w1], "int4")[0] > 0.3 > step_replay.TOLERANCE


def test_no_move_is_no_mismatch_and_a_move_from_nothing_is_infinite() -> None:
    w0 = _state(0)
    zero = {k: torch.zeros_like(v) for k, v in w0.items()}
    assert step_replay.mismatch(w0, w0, w0) == 0.0
    assert step_replay.mismatch(ad.apply_delta(w0, _state(1, 1e-3)), w0, w0) == float("inf")
    assert step_replay.next_residual(zero, w0, w0, "float32") == {}
