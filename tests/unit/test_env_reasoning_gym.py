"""reasoning-gym environments: prompts from (seed, index), the split, the reasoning format and what a
truncated completion earns, scoring in the grading pool, and one-line errors at submit time."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from swarmrl.node.runtime.config import describe_validation_error
from swarmrl.node.tasks.job_file import grader_for, load_job_file, reasoning_completion
from swarmrl.protocol.envs import HELDOUT_START, heldout_indices, job_environment
from swarmrl.protocol.envs.reasoning_format import parse_reasoning
from swarmrl.protocol.envs.rg_env import ReasoningGymEnv, RGTaskError, installed_version
from swarmrl.protocol.envs.rg_task import ReasoningGymTask
from swarmrl.protocol.jobspec import JobSpec

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "size": 400}


def _env(seed: int = 0, **table) -> ReasoningGymEnv:
    data = {"reasoning_gym": "chain_sum", "config": SMALL, **table}
    return ReasoningGymEnv(ReasoningGymTask.model_validate(data), seed)


def write_job(tmp: Path, env: str, extra: str = "") -> Path:
    job = tmp / "job.toml"
    job.write_text(f'base_model = "tiny"\nsteps = 2\nmax_prompt_tokens = 512\n{extra}\n[environment]\n{env}')
    return job


# ---- prompts ------------------------------------------------------------------------------------


def test_prompts_are_a_function_of_seed_and_index():
    a, b = _env(0), _env(0)
    idx = [0, 1, 7, 123456789, HELDOUT_START + 3]
    assert a.prompts(0, idx) == b.prompts(0, idx)
    assert [p.text for p in _env(1).prompts(1, idx)] != [p.text for p in a.prompts(0, idx)]
    p = a.prompt(0, 7)
    assert p.text.endswith("Answer: <think>") and p.response_prefix == "<think>"
    assert p.messages[-1] == ("user", a.entry(p.info["rg_task"], p.info["rg_row"])["question"])
    with pytest.raises(ValueError, match="seed 0, not 1"):
        a.prompt(1, 0)


def test_heldout_questions_never_appear_in_training():
    env = _env(0)   # 2 one-digit terms: ~200 distinct questions, so rows repeat questions often
    train = {p.messages[-1][1] for p in env.prompts(0, range(600))}
    held = {p.messages[-1][1] for p in env.prompts(0, heldout_indices(60))}
    assert held and train and not train & held
    share = len(held) / (len(held) + len(train))
    assert 0.02 < share < 0.3


def test_a_weighted_mix_draws_tasks_by_weight():
    task = ReasoningGymTask.model_validate({"reasoning_gym": [
        {"task": "chain_sum", "weight": 3.0, "config": SMALL},
        {"task": "leg_counting", "weight": 1.0, "config": {"min_animals": 1, "max_animals": 2}}]})
    env = ReasoningGymEnv(task, 5)
    counts = Counter(p.info["rg_task"] for p in env.prompts(5, range(400)))
    assert 0.65 < counts[0] / 400 < 0.85 and counts[1] > 0
    assert task.label == "chain_sum x3, leg_counting x1"


# ---- the reasoning format and truncation --------------------------------------------------------


@pytest.mark.parametrize(("completion", "complete", "answer"), [
    (" add 3 and 5 </think> <answer>8</answer>", True, "8"),
    (" add </think>\n<answer> 8 </answer>\n", True, "8"),
    (" add 3 and 5 </think> <answer>8", False, None),                 # truncated inside the answer
    (" the answer is <answer>8</answer> so", False, None),            # answer inside the thinking
    (" add </think> <answer>8</answer> and more text", False, None),  # text after the answer
    (" add </think> <answer>8</answer><answer>9</answer>", False, None),
    ("<think> x </think><answer>8</answer>", False, None),            # a second opening tag
    ("8", False, None),
])
def test_think_answer_format(completion, complete, answer):
    parsed = parse_reasoning(completion, "think_answer")
    assert parsed.complete is complete and parsed.answer == answer


def test_answer_format_and_unknown_format():
    assert parse_reasoning("3 + 5 is 8. <answer>8</answer>", "answer").answer == "8"
    assert not parse_reasoning("3 + 5 is 8. <answer>8", "answer").complete
    with pytest.raises(ValueError, match="unknown reasoning format"):
        parse_reasoning("x", "boxed")


def test_a_truncated_fragment_never_earns_full_reward():
    env = _env(0)
    p = env.prompt(0, 0)
    right = p.info["answer"]
    texts = [reasoning_completion("think_answer", right),                        # finished, right: 1.1
             f" {right} </think> <answer>{right}",                              # cut before </answer>: 0
             f" so {right}",                                                     # cut in the thinking: 0
             reasoning_completion("think_answer", str(int(right) + 1))]          # finished, wrong: 0.1
    totals = [env.total(r) for r in env.rewards([p] * 4, texts)]
    assert totals == [pytest.approx(1.1), 0.0, 0.0, pytest.approx(0.1)]


def test_a_scorer_that_raises_marks_that_completion_only(monkeypatch):
    env = _env(0)
    p = env.prompt(0, 0)
    real = env.datasets[0].score_answer

    def flaky(answer, entry):
        if answer == "boom":
            raise RuntimeError("scorer bug")
        return real(answer, entry)

    monkeypatch.setattr(env.datasets[0], "score_answer", flaky)
    rows = env.rewards([p] * 2, [reasoning_completion("think_answer", "boom"),
                                 reasoning_completion("think_answer", p.info["answer"])])
    assert math.isnan(rows[0][0]) and rows[1][0] == 1.0


# ---- the job file, the grading pool ---------------------------------------------------------------


def test_job_file_pins_version_and_reasoning_sampling(tmp_path, model_cache):
    loaded = load_job_file(write_job(tmp_path, 'reasoning_gym = "chain_sum"\nconfig = {min_terms = 2, max_digits = 1}\n'),
                           model_cache)
    spec = loaded.spec
    assert spec.reasoning_gym is not None and spec.reasoning_gym.rg_version == installed_version()
    assert spec.sampling.stop == ("</answer>",) and spec.sampling.max_new_tokens == 256
    assert spec.carries_task and spec.environment_id.startswith("reasoning_gym:")
    again = JobSpec.from_json(spec.canonical_json())   # the wire form sorts the config's keys
    assert again == spec and again.environment_id == spec.environment_id
    assert len(loaded.report.prompt_tokens) == 12


def test_grading_pool_scores_as_the_environment_does(tmp_path, model_cache):
    spec = load_job_file(write_job(tmp_path, 'reasoning_gym = "chain_sum"\nconfig = {max_digits = 1}\n'),
                         model_cache).spec
    env = job_environment(spec)
    prompts = env.prompts(spec.seed, range(3))
    texts = [reasoning_completion("think_answer", p.info["answer"]) for p in prompts]
    texts[1] = texts[1][:-len("</answer>")]            # truncated
    with grader_for(spec, 30.0) as pool:
        grades = pool.grade([p.text for p in prompts], texts, [p.info for p in prompts])
    assert [g.reward for g in grades] == [pytest.approx(1.1), 0.0, pytest.approx(1.1)]
    assert [g.reward for g in grades] == [env.total(r) for r in env.rewards(prompts, texts)]


BAD = [
    ("unknown task", 'reasoning_gym = "chain_sun"\n', ("environment.reasoning_gym[0].task: unknown reasoning-gym "
                                                      "task 'chain_sun' (did you mean 'chain_sum'?")),
    ("unknown field", 'reasoning_gym = "chain_sum"\nconfig = {max_term = 3}\n',
     "environment.reasoning_gym[0].config.max_term: chain_sum takes no field 'max_term' (did you mean 'max_terms'"),
    ("out of range", 'reasoning_gym = "chain_sum"\nconfig = {min_terms = 4, max_terms = 2}\n',
     "environment.reasoning_gym[0].config.min_terms: chain_sum refuses its configuration: max_terms must be >= min_terms"),
    ("seed", 'reasoning_gym = "chain_sum"\nconfig = {seed = 3}\n', ("environment.reasoning_gym[0].config.seed: set from "
                                                                    "the job seed")),
    ("other release", 'reasoning_gym = "chain_sum"\nrg_version = "0.0.1"\n',
     "environment.rg_version: the job pins reasoning-gym 0.0.1, this node has"),
    ("format", 'reasoning_gym = "chain_sum"\nreasoning_format = "boxed"\n', "reasoning_format"),
]


@pytest.mark.parametrize(("case", "env", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_tasks_fail_in_one_line_naming_the_field(tmp_path, model_cache, case, env, message):
    with pytest.raises(ValueError) as err:
        load_job_file(write_job(tmp_path, env), model_cache)
    text = str(err.value) if isinstance(err.value, RGTaskError) else describe_validation_error(err.value)
    assert message in text and "\n" not in text, str(err.value)


def test_submit_of_an_unknown_task_is_one_line_and_exit_2(tmp_path, model_cache):
    job = write_job(tmp_path, 'reasoning_gym = "chain_sun"\n')
    proc = subprocess.run([sys.executable, "-m", "swarmrl.node.cli.main", "submit", str(job), "--trainer",
                           "127.0.0.1:9", "--key", str(tmp_path / "k.key")], check=False, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "SWARMRL_CACHE": str(model_cache), "SWARMRL_TRACEBACK": ""})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "environment.reasoning_gym[0].task: unknown reasoning-gym task 'chain_sun'" in lines[0]


def test_the_validator_keeps_one_grader_per_reasoning_gym_seed(tmp_path, model_cache):
    """Two jobs on the same task table with different seeds build different data sets: the
    validator's regrade must not reuse the first job's grading pool for the second."""
    from types import SimpleNamespace

    from swarmrl.validator.reputation import Reputation
    from swarmrl.validator.seen import SeenStore
    from swarmrl.validator.validator import Validator

    job = write_job(tmp_path, 'reasoning_gym = "chain_sum"\nconfig = {max_digits = 2, size = 300}\n')
    specs = [load_job_file(job, model_cache, {"seed": s}).spec for s in (0, 1)]
    backend = SimpleNamespace(dtype="float32", sampled_dtype=None, vocab_size=320)
    v = Validator(backend, seen=SeenStore(":memory:"), reputation=Reputation(":memory:"),   # type: ignore[arg-type]
                  sampling_key=b"k" * 32)
    try:
        pools = [v._grader(s) for s in specs]
        assert pools[0] is not pools[1] and v._grader(specs[0]) is pools[0]
        for spec, pool in zip(specs, pools, strict=True):
            p = job_environment(spec).prompt(spec.seed, 3)
            grade = pool.grade([p.text], [reasoning_completion("think_answer", p.info["answer"])], [p.info])[0]
            assert grade.reward == pytest.approx(1.1)
    finally:
        v.close()
