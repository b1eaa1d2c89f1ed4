"""The `arithmetic` environment: deterministic prompts, the answer parser, TRL-style rewards, splits."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys

import pytest

from swarmrl.protocol.envs import (
    ENVIRONMENTS,
    HELDOUT_START,
    PromptSpec,
    get_environment,
    heldout_prompts,
    total_reward,
)
from swarmrl.protocol.envs.arithmetic import (
    FAMILIES,
    FEW_SHOT,
    ArithmeticEnv,
    apply_op,
    correctness_reward,
    format_reward,
    is_heldout_problem,
    parse_answer,
)

ENV = get_environment("arithmetic", "1")


def _question(spec: PromptSpec) -> str:
    return spec.text.rsplit("\n", 1)[-1].removesuffix(" =")


def test_registry() -> None:
    assert isinstance(ENV, ArithmeticEnv) and (ENV.name, ENV.version) == ("arithmetic", "1")
    assert isinstance(get_environment("arithmetic"), ArithmeticEnv)
    assert "arithmetic" in ENVIRONMENTS
    with pytest.raises(ValueError, match="arithmetic"):
        get_environment("chess")
    with pytest.raises(ValueError, match="version"):
        get_environment("arithmetic", "99")


def test_prompts_are_deterministic_per_seed_and_index() -> None:
    first = ENV.prompts(7, range(100))
    assert first == ENV.prompts(7, range(100)) == [ArithmeticEnv().prompt(7, i) for i in range(100)]
    assert len({s.text for s in first}) > 40  # indices give different problems
    assert [s.text for s in first] != [s.text for s in ENV.prompts(8, range(100))]
    assert [s.index for s in first] == list(range(100))


def test_prompt_format_and_answer() -> None:
    for spec in ENV.prompts(3, range(300)):
        assert spec.text.endswith(" =") and spec.text.count("\n") == len(FEW_SHOT)
        question = _question(spec)
        op = next(c for c in "+-*" if c in question)
        a, b = map(int, question.split(op))
        assert (a, op, b) not in FEW_SHOT
        assert spec.info["answer"] == apply_op(a, op, b) >= 0
        assert spec.info["family"] in FAMILIES


def test_bad_seed_or_index() -> None:
    for seed, index in ((-1, 0), (0, -1), (0, 2**63), (0, 1.5)):
        with pytest.raises(ValueError):
            ENV.prompt(seed, index)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (" 7\n", 7),
        ("7", 7),
        (" 3+4 = 7\n", 7),  # echoed question: the answer after '=' counts, not the operand
        ("3+4 = 7", 7),
        (" -3\n", -3),
        (" 5-8 = -3", -3),
        (" 12 then\n", 12),
        (" 14.\n", 14),
        (" 30\n31 = 40", 30),  # only the first line is read
        ("\n 7", None),
        (" seven\n", None),
        ("", None),
        (" = \n", None),
        (" " + "9" * 19, None),
    ],
)
def test_parse_answer(completion: str, expected: int | None) -> None:
    assert parse_answer(completion) == expected


def test_reward_functions_follow_trl_signature() -> None:
    prompts = ["p"] * 5
    completions = [" 7\n", " 3+4 = 7", " 8\n", "garbage", " -2"]
    answer = [7, 7, 7, 7, -2]
    assert correctness_reward(prompts, completions, answer=answer, family=["x"] * 5) == [
        1.0,
        1.0,
        0.0,
        0.0,
        1.0,
    ]
    assert format_reward(prompts, completions, answer=answer) == [1.0, 1.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError):
        correctness_reward(prompts, completions[:3], answer=answer)


def test_env_rewards_and_total() -> None:
    spec = ENV.prompt(0, 0)
    right, wrong = f" {spec.info['answer']}\n", " nope\n"
    rows = ENV.rewards([spec, spec], [right, wrong])
    assert rows == [[1.0, 1.0], [0.0, 0.0]]
    totals = [ENV.total(r) for r in rows]
    assert totals[0] == pytest.approx(1.1) and totals[1] == 0.0
    assert all(ENV.reward_range[0] <= t <= ENV.reward_range[1] for t in totals)
    with pytest.raises(ValueError):
        ENV.rewards([spec], [right, wrong])


def test_total_reward_trl_semantics() -> None:
    assert total_reward([1.0, 0.5], [1.0, 0.1]) == pytest.approx(1.05)
    assert total_reward([None, 0.5], [1.0, 0.1]) == pytest.approx(0.05)
    assert total_reward([math.nan, 1.0], [1.0, 2.0]) == pytest.approx(2.0)
    assert total_reward([None, None], [1.0, 0.1]) is None
    with pytest.raises(ValueError):
        total_reward([1.0], [1.0, 0.1])
    with pytest.raises(ValueError):
        total_reward([math.inf, 0.0], [1.0, 0.1])


def test_heldout_is_disjoint_from_training() -> None:
    held = heldout_prompts(ENV, 300, seed=5)
    assert all(s.index >= HELDOUT_START for s in held)
    train = ENV.prompts(5, range(3000))
    assert {_question(s) for s in held}.isdisjoint({_question(s) for s in train})
    assert len({_question(s) for s in held}) > 20


def test_every_family_has_problems_in_both_splits() -> None:
    for _, op, range_a, range_b in FAMILIES.values():
        splits = {is_heldout_problem(a, op, b) for a in range_a for b in range_b if op != "-" or b <= a}
        assert splits == {True, False}


def test_env_and_reward_funcs_pickle() -> None:
    for func in ENV.reward_funcs:
        assert pickle.loads(pickle.dumps(func)) is func
    assert pickle.loads(pickle.dumps(ENV)).prompt(1, 2) == ENV.prompt(1, 2)
    assert len(ENV.reward_funcs) == len(ENV.reward_weights)


def test_envs_do_not_import_torch() -> None:
    code = "import sys, swarmrl.protocol.envs; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
