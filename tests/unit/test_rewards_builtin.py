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


MATH_CASES = [   # (gold, completion, reward): the inputs and their neighbours, checked by hand
    ("2, 5", "5", 0.0),                          # issue 25: a partial answer to a non-LaTeX gold set
    ("2, 5", "2, 5", 1.0),
    ("2, 5", "5, 2", 1.0),                       # a set: order-free
    ("2, 5", "The answer is 2 and 5.", 1.0),
    ("2, 5", "\\boxed{5}", 0.0),
    ("2, 5", "\\boxed{2, 5}", 1.0),
    ("$2, 5$", "5", 0.0),                        # the LaTeX gold, as before
    ("$2, 5$", "2, 5", 1.0),
    ("{2, 5}", "5", 0.0),
    ("2 and 5", "5", 0.0),
    ("x=2, x=5", "x = 2 or x = 5", 1.0),
    ("x=2, x=5", "5", 0.0),
    ("(1, 2)", "2", 0.0),                        # an interval (or a pair) is not its end
    ("2\\pi", "2", 0.0),                         # read whole, not as its leading 2
    ("5", "1, 2, 3, 4, 5", 0.0),                 # a list of candidates is not its last one
    ("5", "2, 5", 0.0),
    ("5", "First 2, then 5", 1.0),               # prose: the last expression, as math-verify reads it
    ("72", "Therefore, x = 72", 1.0),
    ("1,234", "1234", 1.0),
    ("3 hours", "3", 1.0),
]


@pytest.mark.parametrize(("gold", "completion", "want"), MATH_CASES)
def test_math_verify_grades_against_the_whole_gold(gold: str, completion: str, want: float) -> None:
    assert build_reward("math_verify", {})(P, [completion], answer=[gold]) == [want]


def test_math_verify_unreadable_gold_is_unscored() -> None:
    assert build_reward("math_verify", {})(P, ["5"], answer=[""]) == [None]


def test_exact_match_normalisation_options() -> None:
    f = build_reward("exact_match", {})
    assert f(P * 3, [" Paris! ", "paris  france", "PARIS"], answer=["paris", "Paris France", "Paris."]) == [1.0, 1.0, 1.0]
    strict = build_reward("exact_match", {"lowercase": False, "strip_punctuation": False})
    assert strict(P * 2, ["PARIS", "Paris"], answer=["Paris", "Paris"]) == [0.0, 1.0]
    first = build_reward("exact_match", {"first_line": True})
    assert first(P, ["Paris\nbecause ...", ], answer=["paris"]) == [1.0]
    assert normalize_text("  A,  b.\tC ") == "a b c"


def test_exact_match_keeps_numbers_whole() -> None:
    f = build_reward("exact_match", {})
    comps = ["10", "3", "-3", "1.0", "3.", "34", "3-4", "The answer: -3!"]
    golds = ["1.0", "-3", "-3", "1.0", "3", "3-4", "3-4", "the answer -3"]
    assert f(P * 8, comps, answer=golds) == [0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]


def test_numeric_tolerance_and_pick() -> None:
    f = build_reward("numeric", {"tolerance": 0.01})
    assert f(P * 4, ["x = 3.005", "1,234", "none", "2 then 5"], answer=["3", "1234", "1", "5"]) == [1.0, 1.0, 0.0, 1.0]
    first = build_reward("numeric", {"pick": "first"})
    assert first(P, ["2 then 5"], answer=["5"]) == [0.0]
    rel = build_reward("numeric", {"rel_tolerance": 0.1})
    assert rel(P * 2, ["105", "111"], answer=["100", "100"]) == [1.0, 0.0]
    assert parse_number("cost -1.5e2 dollars") == -150.0


def test_numeric_reads_no_number_from_an_expression() -> None:
    f = build_reward("numeric", {})
    comps = ["4-5", "4-5", "4 - 5", "4-5=-1", "6 (2*3)", "-5"]
    golds = ["-5", "5", "-1", "-1", "6", "-5"]
    assert f(P * 6, comps, answer=golds) == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert [parse_number(t) for t in ("4-5", "2,5", "12,345.5", "x=-3", "(2*3) so 6")] == [None, 5.0, 12345.5, -3.0, 6.0]


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
    assert set(REWARDS) == {"math_verify", "exact_match", "numeric", "regex_format", "json_schema", "length_penalty",
                            "countdown"}


def test_grading_pool_runs_builtin_rewards_in_a_subprocess() -> None:
    from swarmrl.node.tasks.grading import GradingPool

    rewards = [{"name": "exact_match", "weight": 1.0}, {"name": "regex_format", "weight": 0.1, "pattern": r"^\d+$"}]
    with GradingPool("dataset:x", "x", timeout_s=20, rewards=rewards) as pool:
        grades = pool.grade(["q", "q"], ["5", "five"], [{"answer": "5"}, {"answer": "5"}])
    assert pool.reward_names == ("exact_match", "regex_format")
    assert [g.reward for g in grades] == [pytest.approx(1.1), 0.0]


COUNTDOWN_CASES = [   # (row numbers, completion, target, reward): checked by hand
    ("4 4 6 8", "(4 + 8) * (6 - 4)", "24", 1.0),           # 12 * 2
    ("4 4 6 8", " (4+8)*(6-4)\nbecause 12*2=24", "24", 1.0),  # first line only, spaces stripped
    ("4, 4, 6, 8", "(8 - 4) * 4 + 6 + 2", "24", 0.0),       # 2 is not in the row
    ("4 4 6 8", "24", "24", 0.0),                          # the value alone: no numbers used
    ("4 4 6 8", "4*6", "24", 0.0),                         # right value, two numbers unused
    ("4 4 6 8", "(8 - 4) * 6 * 4 / 4", "24", 0.0),         # 4 used three times
    ("4 4 6 8", "6 * 8 / (4 - 4)", "24", 0.0),             # division by zero
    ("1 2 3 4", "1 * 2 * 3 * 4", "24", 1.0),
    ("1 5 5 5", "5 * (5 - 1 / 5)", "24", 1.0),             # 5 * 24/5: exact with fractions
    ("3 3 8 8", "8 / (3 - 8 / 3)", "24", 1.0),             # 8 / (1/3)
    ("4 4 6 8", "(4 + 8) * (6 - 4) = 24", "24", 0.0),      # not an expression alone
    ("4 4 6 8", "__import__('os').getcwd()", "24", 0.0),    # never evaluated: a call is refused
    ("4 4 6 8", "(4 + 8) ** 1 * (6 - 4)", "24", 0.0),      # ** is not allowed
    ("4 4 6 8", "0x4 * 6 + 8 - 8", "24", 0.0),             # only plain decimal numbers
    ("4 4 6 8", "-4 + 4 + 6 * 8 / 2", "24", 0.0),          # 2 is not in the row
    ("1 4 6 8", "-(4 - 8) * 6 * 1", "24", 1.0),            # unary minus: 4 * 6 * 1
    ("2 4 6 8", "2 * 4 + 6 + 8", "24", 0.0),               # = 22
    ("2 3 8 9", "9 * 8 / 3 - 2 + 2", "24", 0.0),           # 2 used twice, 3 numbers from the row
    ("2 3 8 9", "(9 - 3) * 8 / 2", "24", 1.0),
    ("4 4 6 8", "", "24", 0.0),                            # empty
    ("4 4 6 8", "(4 + 8) * (6 - 4", "24", 0.0),            # unbalanced
    ("10 2.5", "10 * 2.5", "25", 1.0),                      # decimals in the row and the expression
]


@pytest.mark.parametrize(("numbers", "completion", "target", "want"), COUNTDOWN_CASES)
def test_countdown_table(numbers: str, completion: str, target: str, want: float) -> None:
    f = build_reward("countdown", {"numbers_field": "nums"})
    assert f(P, [completion], answer=[target], row=[{"nums": numbers}]) == [want]


def test_countdown_unparsable_row_is_unscored_and_missing_fields_raise() -> None:
    f = build_reward("countdown", {"numbers_field": "nums"})
    assert f(P * 2, ["1+2", "1+2"], answer=["3", "x"], row=[{"nums": "1 two"}, {"nums": "1 2"}]) == [None, None]
    with pytest.raises(ValueError, match="countdown needs numbers_field"):
        build_reward("countdown", {})(P, ["1"], answer=["1"], row=[{"nums": "1"}])
    with pytest.raises(RewardConfigError, match="numbers_field must be a field name"):
        build_reward("countdown", {"numbers_field": 3})


def test_countdown_job_reads_the_prompt_field_by_default() -> None:
    import json

    from swarmrl.protocol.envs.dataset import DatasetEnv, DatasetTask, chunk_hashes, sha256_hex

    data = "".join(json.dumps({"puzzle": f"{a} {a} {a} {a}", "target": "24"}) + "\n" for a in range(1, 21)).encode()
    task = DatasetTask(dataset="p.jsonl", dataset_sha256=sha256_hex(data), dataset_size=len(data),
                       dataset_chunks=chunk_hashes(data), prompt_field="puzzle", answer_field="target",
                       rewards=[{"name": "countdown"}])
    assert task.rewards[0].params == {"numbers_field": "puzzle"} and task.row_fields == ("puzzle",)
    env = DatasetEnv(task, data, seed=0)
    spec = next(env.prompt(0, i) for i in range(40) if env.prompt(0, i).info["row"]["puzzle"] == "6 6 6 6")
    assert spec.info == {"answer": "24", "row": {"puzzle": "6 6 6 6"}}
    assert env.rewards([spec, spec], ["6 + 6 + 6 + 6", "24"]) == [[1.0], [0.0]]
