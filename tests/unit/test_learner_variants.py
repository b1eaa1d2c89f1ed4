"""On the tiny model, the real learner (peft LoRA + AdamW + each loss variant) raises the reward
of a simple learnable task within a few dozen on-policy steps, sampling with the real backend.

Task: reward = share of completion tokens with an even id (about 1/2 at the start, so groups
have reward variance; a policy can push it to 1).
"""

from __future__ import annotations

import pytest
import torch

from swarmrl.node.inference import build_backend
from swarmrl.node.inference.base import Sampling
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.learner import Learner
from swarmrl.protocol.grpo import LOSS_VARIANTS
from swarmrl.protocol.pb import swarm_pb2 as pb

STEPS, PROMPTS, G, TOKENS, LR = 30, 4, 8, 4, 2e-2


def _reward(token_ids: list[int]) -> float:
    return sum(t % 2 == 0 for t in token_ids) / len(token_ids)


def _train(variant: str, cache) -> tuple[float, float]:
    torch.manual_seed(0)
    loss = {"variant": variant}
    if variant == "gspo":
        loss |= {"eps_low": 3e-4, "eps_high": 4e-4}
    spec = builtin_job("tiny", cache, loss=loss, learning_rate=LR, group_size=G,
                       sampling={"temperature": 1.0, "max_new_tokens": TOKENS, "stop": []})
    path = prepare_base_model("tiny", cache)
    learner = Learner(path, spec)
    backend = build_backend("hf", path)
    backend.add_slot("job", spec.lora)
    prompt = [learner.tokenizer.bos_token_id, *learner.tokenizer("1+2 =").input_ids[-4:]]
    rewards = []
    for step in range(STEPS):
        backend.set_adapter("job", learner.state())
        sampled = backend.generate([prompt] * PROMPTS, Sampling(n=G, max_new_tokens=TOKENS, seed=step), adapter="job")
        groups = []
        for i, comps in enumerate(sampled):
            g = pb.Group(prompt_index=i, prompt_token_ids=prompt)
            for c in comps:
                r = _reward(c.token_ids)
                g.completions.append(pb.Completion(token_ids=c.token_ids, logprobs=c.logprobs, reward=r,
                                                   rewards=[r], finish_reason=c.finish_reason, policy_version=step))
            groups.append(g)
        metrics = learner.step(groups, current_version=step)
        rewards.append(metrics["reward_mean"])
    return sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5


@pytest.mark.parametrize("variant", LOSS_VARIANTS)
def test_variant_raises_reward_on_tiny_model(variant, model_cache):
    first, last = _train(variant, model_cache)
    assert last > first + 0.1, (variant, first, last)
