"""A hand-made two-turn episode: its masks, loss and KL pinned to exact values (model tokens only),
and why the trainer must score the stored ids instead of re-tokenizing the episode's text."""

from __future__ import annotations

import math

import pytest
import torch

from swarmrl.protocol.grpo import LossConfig, policy_loss
from swarmrl.protocol.grpo.traces import model_mask_T, model_token_counts_B, pad_masks_BT

# Episode 0: [m m e e e m] (two model turns around one environment reply); completion 1: [m m] single-turn.
MASK0 = [1, 1, 0, 0, 0, 1]
OLD = [[-0.5, -1.0, 0.0, 0.0, 0.0, -0.25], [-0.7, -0.1, 0.0, 0.0, 0.0, 0.0]]
NEW = [[-0.4, -1.0, math.nan, 9.0, -50.0, -0.25], [-0.7, -0.2, 0.0, 0.0, 0.0, 0.0]]   # env positions: anything
ADV = [0.5, -0.5]


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    mask_BT = pad_masks_BT([model_mask_T(MASK0, 6), model_mask_T([], 2)])
    return torch.tensor(NEW), torch.tensor(OLD), torch.tensor(ADV), mask_BT


def test_masks_keep_model_tokens_only() -> None:
    assert model_mask_T(MASK0, 6) == [True, True, False, False, False, True]
    assert model_mask_T([], 3) == [True, True, True]
    assert model_mask_T(MASK0, 6, keep=False) == [False] * 6
    with pytest.raises(ValueError):
        model_mask_T(MASK0, 5)
    _, _, _, mask_BT = _batch()
    assert mask_BT.tolist() == [[True, True, False, False, False, True], [True, True, False, False, False, False]]
    assert model_token_counts_B(mask_BT).tolist() == [3, 2]


def test_losses_of_the_two_turn_episode_are_exact() -> None:
    new, old, adv, mask_BT = _batch()
    r = math.exp(0.1)          # token 0 of the episode: ratio e^0.1 (inside both clip ranges)
    r1 = math.exp(-0.1)        # token 1 of the single-turn completion
    episode = [-0.5 * r, -0.5, -0.5]            # -r * A per model token, A = 0.5
    single = [0.5, 0.5 * r1]                    # -r * A, A = -0.5
    dapo, _ = policy_loss(new, old, adv, mask_BT, LossConfig(variant="dapo"), max_new_tokens=6)
    assert dapo.item() == pytest.approx((sum(episode) + sum(single)) / 5, abs=1e-6)
    grpo, m = policy_loss(new, old, adv, mask_BT, LossConfig(variant="grpo"), max_new_tokens=6)
    assert grpo.item() == pytest.approx((sum(episode) / 3 + sum(single) / 2) / 2, abs=1e-6)
    assert m["tokens"] == 5.0
    dr, _ = policy_loss(new, old, adv, mask_BT, LossConfig(variant="dr_grpo"), max_new_tokens=6)
    assert dr.item() == pytest.approx((sum(episode) + sum(single)) / (6 * 2), abs=1e-6)


def test_kl_and_gradients_skip_environment_tokens() -> None:
    new, old, adv, mask_BT = _batch()
    new = new.clone().requires_grad_(True)
    ref = torch.tensor(NEW).nan_to_num(0.0)
    ref[0, 0] = -0.5   # one model token differs from the reference: k3 = e^-0.1 + 0.1 - 1
    ref[0, 3] = 40.0   # an environment token far from anything: must not count
    loss, m = policy_loss(new, old, adv, mask_BT, LossConfig(variant="dapo", kl_beta=0.1), max_new_tokens=6,
                          ref_logprobs_BT=ref)
    assert m["kl"] == pytest.approx((math.exp(-0.1) + 0.1 - 1) / 5, abs=1e-7)
    loss.backward()
    assert new.grad is not None
    assert new.grad[0, 2:5].abs().sum().item() == 0.0 and new.grad[0, 0].item() != 0.0


def test_retokenizing_an_episode_gives_other_ids_than_its_trace(model_cache) -> None:
    """The tiny model's tokenizer merges across a turn boundary: re-encoding the decoded text of
    a model turn followed by an environment reply does not give the stored ids back."""
    from transformers import AutoTokenizer

    from swarmrl.node.models.base_model import find_base_model
    from swarmrl.node.tasks.episode_play import encode_observation

    tok = AutoTokenizer.from_pretrained(find_base_model("tiny", model_cache))
    model_turn = encode_observation(tok, "<calc>12*3</calc> ")   # what the model sampled (ending in a space) ...
    reply = encode_observation(tok, "= 36")                      # ... and what the environment answered
    trace = model_turn + reply
    again = encode_observation(tok, tok.decode(trace))
    assert tok.decode(again) == tok.decode(trace)
    assert again != trace
