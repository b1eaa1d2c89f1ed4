"""Built-in rewards of data-set jobs: hand-computed values, parameter checks, pool round trip."""

from __future__ import annotations

import pickle

import pytest

from swarmrl.protocol.envs.rewards import (
    REWARDS,
    RewardConfigError,
    build_reward,
    normalize_text,
    parse_number,
    weighted_range,
)

P = ["q"]


def test_math_verify_equivalent_forms() -> None:
    f = build_reward("math_verify", {})
    comps = ["The answer is 72.", "72", "0.5", "11", "no idea"]
    golds = ["72", "72", "1/2", "10", "3"]
    assert f(P * 5, comps, answer=golds) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_exact_match_normalisation_options() -> None:
    f = build_reward("exact_match", {})
    assert f(P * 3, [" Paris! ", "paris  france", "PARIS"], answer=["paris", "Paris France", "Paris."]) == [1.0, 1.0, 1.0]
    strict = build_reward("exact_match", {"lowercase": False, "strip_punctuation": False})
    assert strict(P * 2, ["PARIS", "Paris"], answer=["Paris", "Paris"]) == [0.0, 1.0]
    first = build_reward("exact_match", {"first_line": True})
    assert first(P, ["Paris\nbecause ...", ], answer=["paris"]) == [1.0]
    assert normalize_text("  A,  b.\tC ") == "a b c"


def test_numeric_tolerance_and_pick() -> None:
    f = build_reward("numeric", {"tolerance": 0.01})
    assert f(P * 4, ["x = 3.005", "1,234", "none", "2 then 5"], answer=["3", "1234", "1", "5"]) == [1.0, 1.0, 0.0, 1.0]
    first = build_reward("numeric", {"pick": "first"})
    assert first(P, ["2 then 5"], answer=["5"]) == [0.0]
    rel = build_reward("numeric", {"rel_tolerance": 0.1})
    assert rel(P * 2, ["105", "111"], answer=["100", "100"]) == [1.0, 0.0]
    assert parse_number("cost -1.5e2 dollars") == -150.0


def test_regex_format_search_and_fullmatch() -> None:
    f = build_reward("regex_format", {"pattern": r"^\s*-?\d+\s*$"})
    assert f(P * 3, [" 42 ", "-7", "42 apples"]) == [1.0, 1.0, 0.0]
    full = build_reward("regex_format", {"pattern": "yes", "fullmatch": True, "ignore_case": True})
    assert full(P * 2, ["YES", "yes!"]) == [1.0, 0.0]


def test_json_schema() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    f = build_reward("json_schema", {"schema": schema})
    assert f(P * 4, ['{"n": 3}', '```json\n{"n": 3}\n```', '{"n": "3"}', "not json"]) == [1.0, 1.0, 0.0, 0.0]


def test_length_penalty() -> None:
    f = build_reward("length_penalty", {"max_chars": 4})
    assert f(P * 4, ["abcd", "abcdef", "a" * 8, "a" * 100]) == [0.0, -0.5, -1.0, -1.0]


@pytest.mark.parametrize(("name", "params", "message"), [
    ("math_verfy", {}, "unknown reward 'math_verfy'"),
    ("regex_format", {}, "missing parameter(s) pattern"),
    ("regex_format", {"pattern": "(unclosed"}, "bad pattern"),
    ("numeric", {"tolerence": 1}, "unknown parameter(s) tolerence"),
    ("numeric", {"pick": "middle"}, "pick must be"),
    ("json_schema", {"schema": {"type": "nonsense"}}, "bad schema"),
    ("length_penalty", {"max_chars": 0}, "max_chars must be"),
])
def test_bad_reward_configs(name: str, params: dict, message: str) -> None:
    with pytest.raises(RewardConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_reward(name, params)


def test_bound_reward_is_picklable_and_named() -> None:
    f = build_reward("regex_format", {"pattern": "a"})
    g = pickle.loads(pickle.dumps(f))
    assert g.__name__ == "regex_format" and g(P, ["a"]) == [1.0]


def test_weighted_range() -> None:
    assert weighted_range(["math_verify", "regex_format"], [1.0, 0.1]) == (0.0, 1.1)
    assert weighted_range(["length_penalty"], [0.5]) == (-0.5, 0.0)
    assert set(REWARDS) == {"math_verify", "exact_match", "numeric", "regex_format", "json_schema", "length_penalty"}


def test_grading_pool_runs_builtin_rewards_in_a_subprocess() -> None:
    from swarmrl.node.grading import GradingPool

    rewards = [{"name": "exact_match", "weight": 1.0}, {"name": "regex_format", "weight": 0.1, "pattern": r"^\d+$"}]
    with GradingPool("dataset:x", "x", timeout_s=20, rewards=rewards) as pool:
        grades = pool.grade(["q", "q"], ["5", "five"], [{"answer": "5"}, {"answer": "5"}])
    assert pool.reward_names == ("exact_match", "regex_format")
    assert [g.reward for g in grades] == [pytest.approx(1.1), 0.0]
