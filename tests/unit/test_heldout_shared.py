"""`swarmrl eval` and the held-out figure at the end of `swarmrl up` run one code path
(node/evaluation/heldout.py): on the same adapter they score the same prompts alike, and both
record the score in the adapter's model card."""

from __future__ import annotations

import json

import torch

from swarmrl.node.evaluation.heldout import heldout_of_job, run_eval
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.models.card import write_model_card
from swarmrl.node.submitter.client import export_peft
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.learner import Learner

N = 24


def test_eval_and_up_score_an_adapter_alike(tmp_path, model_cache) -> None:
    torch.manual_seed(0)
    spec = builtin_job("tiny", model_cache, steps=4)
    state = Learner(prepare_base_model("tiny", model_cache), spec).state()
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}   # not the base model's identity
    adapter = export_peft(state, spec, tmp_path / "adapter")
    write_model_card(adapter, spec, "job", 4, [])
    base_u, tuned_u = heldout_of_job(adapter, spec, n=N, cache_dir=model_cache)
    card = json.loads((adapter / "swarmrl.json").read_text())
    assert card["heldout"] == {"base_accuracy": base_u.accuracy, "adapter_accuracy": tuned_u.accuracy, "n": N}
    base_e, tuned_e = run_eval(adapter, n=N, cache_dir=model_cache)
    assert base_u.reward_mean != tuned_u.reward_mean   # the adapter is what it scores (tiny: accuracy 0 both)
    assert (base_e, tuned_e) == (base_u, tuned_u) and tuned_u.n == N
