"""`swarmrl eval` and the held-out figure at the end of `swarmrl up` run one code path
(node/evaluation/heldout.py): on the same adapter they score the same prompts alike, and both
record the score in the adapter's model card."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from swarmrl.node.evaluation.heldout import heldout_of_job, run_eval
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.models.card import write_model_card
from swarmrl.node.submitter.client import export_peft
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.learner import Learner
from swarmrl.protocol.jobspec import JobSpec

N = 24
ROOT = Path(__file__).resolve().parents[2]


def _adapter(spec: JobSpec, tmp_path: Path, model_cache: Path) -> Path:
    """A PEFT adapter folder for `spec`'s LoRA, its weights moved off the initial ones (B = 0 would
    be the base model itself), with a swarmrl model card."""
    torch.manual_seed(0)
    state = Learner(prepare_base_model("tiny", model_cache), spec).state()
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}
    adapter = export_peft(state, spec, tmp_path / "adapter")
    write_model_card(adapter, spec, "job", 4, [])
    return adapter


def test_eval_and_up_score_an_adapter_alike(tmp_path, model_cache) -> None:
    spec = builtin_job("tiny", model_cache, steps=4)
    adapter = _adapter(spec, tmp_path, model_cache)
    base_u, tuned_u = heldout_of_job(adapter, spec, n=N, cache_dir=model_cache)
    card = json.loads((adapter / "swarmrl.json").read_text())
    assert card["heldout"] == {"base_accuracy": base_u.accuracy, "adapter_accuracy": tuned_u.accuracy, "n": N}
    base_e, tuned_e = run_eval(adapter, n=N, cache_dir=model_cache)
    assert base_u.reward_mean != tuned_u.reward_mean   # the adapter is what it scores (tiny: accuracy 0 both)
    assert (base_e, tuned_e) == (base_u, tuned_u) and tuned_u.n == N


def test_an_episode_job_is_scored_alike_by_eval_and_up(tmp_path, model_cache) -> None:
    """A multi-turn job (calculator): both score the solve rate of greedy episodes."""
    from swarmrl.node.tasks.job_file import load_job_file

    job = ROOT / "tests" / "fixtures" / "jobs" / "calculator_tiny.toml"
    loaded = load_job_file(job, model_cache, base_model="tiny")
    adapter = _adapter(loaded.spec, tmp_path, model_cache)
    base_u, tuned_u = heldout_of_job(adapter, loaded.spec, loaded.dataset, n=4, cache_dir=model_cache)
    base_e, tuned_e = run_eval(adapter, n=4, cache_dir=model_cache, job_file=job)
    assert (base_e, tuned_e) == (base_u, tuned_u) and tuned_u.n == 4
