"""LoRA dropout never enters the scores: the learner scores the loss's log-probs with dropout off,
as the sampler and the validator do, so an on-policy importance ratio is exactly 1 (fp32, tiny).

At version 0 LoRA B is zero and dropout on the A path changes nothing, so the check is made
after one update.
"""

from __future__ import annotations

import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.learner import Learner, build_step_batch
from swarmrl.protocol.pb import swarm_pb2 as pb

G, TOKENS = 4, 5


def _groups(learner: Learner, version: int, rewards: list[float]) -> list[pb.Group]:
    """Two groups of G random completions whose sampling log-probs are the learner's own (the
    on-policy case: behaviour policy == current policy)."""
    gen = torch.Generator().manual_seed(version)
    groups = []
    for i in range(2):
        prompt = [learner.tokenizer.bos_token_id, 5 + i, 6 + i, 7]
        g = pb.Group(prompt_index=i, prompt_token_ids=prompt)
        for r in rewards:
            ids = torch.randint(10, 100, (TOKENS,), generator=gen).tolist()
            g.completions.append(pb.Completion(token_ids=ids, logprobs=[0.0] * TOKENS, reward=r, rewards=[r],
                                               finish_reason="length", policy_version=version))
        groups.append(g)
    batch = build_step_batch(groups, learner.spec, version)
    with torch.no_grad():
        logprobs_BT, _ = learner.completion_logprobs(batch)
    completions = [c for g in groups for c in g.completions]
    for c, row in zip(completions, logprobs_BT.tolist()):
        c.logprobs[:] = row[:TOKENS]
    return groups


def test_on_policy_ratio_is_one_with_lora_dropout(model_cache) -> None:
    torch.manual_seed(0)
    spec = builtin_job("tiny", model_cache, group_size=G, learning_rate=5e-2, lora={"dropout": 0.1},
                       sampling={"temperature": 1.0, "max_new_tokens": TOKENS, "stop": []},
                       loss={"variant": "grpo", "drop_zero_variance_groups": False, "mask_truncated": False})
    learner = Learner(prepare_base_model("tiny", model_cache), spec)
    assert all(p.dtype == torch.float32 for p in learner.params)
    first = learner.step(_groups(learner, 0, [0.0, 1.0, 0.0, 1.0]), current_version=0)
    assert first is not None and first["stepped"] == 1.0
    assert any(float(p.abs().max()) > 0 for n, p in learner.model.named_parameters() if "lora_B" in n)
    second = learner.step(_groups(learner, 1, [1.0, 0.0, 0.0, 1.0]), current_version=1)
    assert second is not None
    assert abs(second["ratio_mean"] - 1.0) < 1e-5, second["ratio_mean"]
