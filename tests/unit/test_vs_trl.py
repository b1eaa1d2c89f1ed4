"""benchmarks/vs_trl.py's pure parts: the JobSpec -> GRPOConfig mapping, the prompt and stop
token matching on the tiny tokenizer, and the checkpoint / target / spread arithmetic."""

from __future__ import annotations

import math

import pytest

from benchmarks.vs_trl import TRL_LOSS, mismatches, stop_token_ids, trl_prompt_text, trl_settings
from benchmarks.vs_trl_figures import accuracy_at, ratio, ratio_bound, spread, time_to_target
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.models.causal_lm import load_causal_lm, render_prompt
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.protocol.envs import get_environment


def test_settings_map_every_matched_field(model_cache) -> None:
    spec = builtin_job("tiny", model_cache, seed=3, steps=7, loss={"variant": "dapo", "mask_truncated": True})
    kw, rows = trl_settings(spec)
    assert kw["num_generations"] == spec.group_size
    assert kw["per_device_train_batch_size"] == spec.group_size * spec.batch_groups
    assert (kw["gradient_accumulation_steps"], kw["steps_per_generation"], kw["num_iterations"]) == (1, 1, 1)
    assert (kw["max_steps"], kw["seed"], kw["learning_rate"]) == (7, 3, spec.learning_rate)
    assert kw["lr_scheduler_type"] == "constant" and kw["adam_beta2"] == 0.99 and not kw["shuffle_dataset"]
    assert kw["max_completion_length"] == spec.sampling.max_new_tokens
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (spec.sampling.temperature, spec.sampling.top_p, 0)
    assert kw["loss_type"] == "dapo" and kw["epsilon"] == 0.2 and kw["epsilon_high"] == 0.28
    assert kw["scale_rewards"] == "none" and kw["mask_truncated_completions"] and kw["beta"] == 0.0
    assert kw["disable_dropout"] and not kw["gradient_checkpointing"] and not kw["bf16"]
    assert {r.setting for r in rows} >= {"stop strings", "asynchrony", "zero-variance groups", "LoRA dropout"}


def test_settings_for_other_variants_and_the_grpo_config(model_cache) -> None:
    from trl import GRPOConfig

    for variant in TRL_LOSS:
        spec = builtin_job("tiny", model_cache, loss={"variant": variant, "advantage_scale": "std", "tis_cap": 2.0})
        kw, rows = trl_settings(spec)
        assert kw["importance_sampling_level"] == ("sequence" if variant == "gspo" else "token")
        assert kw["scale_rewards"] == "group" and any(r.setting == "TIS cap" for r in rows)
        config = GRPOConfig(output_dir="/tmp/unused-vs-trl", **kw)
        assert config.loss_type == TRL_LOSS[variant] and config.num_generations == spec.group_size
        assert not config.bf16 and not config.gradient_checkpointing
    with pytest.raises(ValueError):
        trl_settings(builtin_job("tiny", model_cache, loss={"variant": "dr_grpo", "loss_constant": 100}))
    assert all(m.how for m in mismatches(builtin_job("tiny", model_cache)))


def test_prompts_and_stops_match_the_swarm_on_the_tiny_tokenizer(model_cache) -> None:
    _, tokenizer = load_causal_lm(prepare_base_model("tiny", model_cache))
    env = get_environment("arithmetic", "1")
    for p in env.prompts(0, range(5)):
        ids = render_prompt(tokenizer, p)
        assert list(tokenizer(trl_prompt_text(tokenizer, p.text, ids))["input_ids"]) == ids
    stops = stop_token_ids(tokenizer, ("\n",))
    assert stops and all("\n" in tokenizer.decode([i]) for i in stops)
    assert tokenizer.convert_tokens_to_ids(tokenizer.tokenize("a")[0]) not in stops
    assert stop_token_ids(tokenizer, ()) == []


def test_checkpoints_targets_and_spread() -> None:
    curve = [(0.0, 0.5), (300.0, 0.55), (620.0, 0.7), (900.0, 0.65)]
    assert accuracy_at(curve, 300) == 0.55 and accuracy_at(curve, 600) == 0.55 and accuracy_at(curve, 5000) == 0.65
    assert math.isnan(accuracy_at(curve[1:], 10))
    # the swarm's copy for checkpoint 600 is made a poll later, at 600.18 s: it counts at 600, not one later
    assert accuracy_at([(0.0, 0.5), (600.18, 0.7)], 600) == 0.7 and accuracy_at([(0.0, 0.5), (600.3, 0.7)], 600) == 0.5
    assert ratio_bound({"time_to_target_s": 150.0}, {"time_to_target_s": None, "wall_s": 750.0}) == 0.2
    assert ratio_bound({"time_to_target_s": 150.0}, {"time_to_target_s": 300.0, "wall_s": 750.0}) is None
    assert time_to_target(curve, 0.6) == 620.0 and time_to_target(curve, 0.9) is None
    assert time_to_target(curve, 0.5) == 0.0
    assert ratio(300.0, 600.0) == 0.5 and ratio(None, 600.0) is None and ratio(300.0, None) is None
    s = spread([1.0, 2.0, None, 3.0, math.nan])
    assert s == {"n": 3, "mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0}
    assert spread([None])["mean"] is None and spread([4.0])["std"] == 0.0
