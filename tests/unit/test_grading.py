"""GradingPool with environments defined in this module (loaded in the workers by import path)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from swarmrl.node.tasks.grading import GradingError, GradingPool
from swarmrl.protocol.envs import get_environment
from swarmrl.protocol.envs.base import Grade


def correct(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def brevity(prompts, completions, **kwargs):
    return [None if c == "" else 1.0 / len(c) for c in completions]


def tricky(prompts, completions, **kwargs):
    """Misbehaves as the batch's texts say."""
    if "raise" in completions:
        raise ValueError("boom")
    if "sleep" in completions:
        time.sleep(60)
    if "exit" in completions:
        os._exit(3)
    if "short" in completions:
        return [0.0] * (len(completions) - 1)
    if "scalar" in completions:
        return 1.0
    table = {"nan": float("nan"), "inf": float("inf"), "str": "abc", "none": None, "bool": True}
    return [table.get(c, 2.0) for c in completions]


def slow(prompts, completions, **kwargs):
    """0.2 s per completion; "hang" never returns."""
    for c in completions:
        time.sleep(3600 if c == "hang" else 0.2)
    return [1.0] * len(completions)


def call_size(prompts, completions, **kwargs):
    """Each row's value is how many rows its call saw; "hang" never returns."""
    if "hang" in completions:
        time.sleep(3600)
    return [float(len(completions))] * len(completions)


def sees_secret(prompts, completions, **kwargs):
    return [1.0 if "SWARMRL_TEST_SECRET" in os.environ else 0.0 for _ in completions]


ARITH = SimpleNamespace(reward_funcs=[correct, brevity], reward_weights=[1.0, 0.5])
TRICKY = SimpleNamespace(reward_funcs=[tricky], reward_weights=None)
SNOOP = SimpleNamespace(reward_funcs=[sees_secret], reward_weights=[1.0])
SLOW = SimpleNamespace(reward_funcs=[slow], reward_weights=[1.0])
SIZES = SimpleNamespace(reward_funcs=[call_size], reward_weights=[1.0])


def make_tricky() -> SimpleNamespace:
    return TRICKY


def pool(attr: str, **kwargs) -> GradingPool:
    return GradingPool("test", "0", env_factory=f"{__name__}:{attr}", **kwargs)


def grade(p: GradingPool, completions: list[str]) -> list[Grade]:
    return p.grade(["Q"] * len(completions), completions, [{}] * len(completions))


@pytest.fixture(scope="module")
def tricky_pool():
    with pool("make_tricky", timeout_s=0.5) as p:
        yield p


def test_correct_rewards_weighted_total() -> None:
    completions = ["7", " 7 ", "8", ""]
    infos = [{"answer": 7}, {"answer": 7}, {"answer": 7}, {"answer": 0}]
    with pool("ARITH") as p:
        grades = p.grade(["What is 3+4?"] * 4, completions, infos)
        assert p.reward_names == ("correct", "brevity") and p.reward_weights == (1.0, 0.5)
    assert [g.error for g in grades] == [""] * 4
    assert grades[0] == Grade(reward=1.0 + 0.5 * 1.0, rewards=(1.0, 1.0), error="")
    assert grades[1].rewards == (1.0, 1 / 3) and grades[1].reward == pytest.approx(1.0 + 0.5 / 3)
    assert grades[2].reward == 0.5
    assert grades[3] == Grade(reward=0.0, rewards=(0.0, None), error="")  # None skipped, not zero


def test_values_none_nan_and_non_numeric(tricky_pool: GradingPool) -> None:
    grades = grade(tricky_pool, ["ok", "none", "nan", "inf", "str", "bool"])
    assert grades[0] == Grade(reward=2.0, rewards=(2.0,), error="")
    assert grades[1] == Grade(reward=None, rewards=(None,), error="")  # every function returned None
    assert grades[2].reward is None and grades[2].error == "tricky: non-finite value: nan"
    assert grades[3].reward is None and "non-finite" in grades[3].error
    assert grades[4].reward is None and grades[4].error.startswith("tricky: non-numeric value: str")
    assert grades[5].reward == 1.0
    assert tricky_pool.failures["non_finite"] >= 2 and tricky_pool.failures["non_numeric"] >= 1


def test_raising_function_fails_only_its_completion(tricky_pool: GradingPool) -> None:
    before = tricky_pool.failures["exception"]
    grades = grade(tricky_pool, ["ok", "raise", "ok"])
    assert [g.reward for g in grades] == [2.0, None, 2.0]
    assert grades[1].error == "tricky: ValueError: boom"
    assert tricky_pool.failures["exception"] == before + 1


def test_wrong_length_and_not_a_list_fail_only_their_completion(tricky_pool: GradingPool) -> None:
    grades = grade(tricky_pool, ["ok", "short", "ok"])
    assert [g.reward for g in grades] == [2.0, None, 2.0]
    assert grades[1].error == "tricky: wrong length: got 0, want 1"
    grades = grade(tricky_pool, ["scalar", "ok"])
    assert grades[0].reward is None and "not a list" in grades[0].error and grades[1].reward == 2.0
    assert tricky_pool.failures["wrong_length"] >= 1 and tricky_pool.failures["not_a_list"] >= 1


def test_timeout_kills_and_respawns(tricky_pool: GradingPool) -> None:
    started = time.monotonic()
    grades = grade(tricky_pool, ["sleep", "ok"])
    assert time.monotonic() - started < 5.0
    assert grades[0].reward is None and grades[0].error == "tricky: timeout after 0.5s"
    assert grades[1].reward == 2.0
    assert tricky_pool.failures["timeout"] >= 1
    assert grade(tricky_pool, ["ok"])[0].reward == 2.0


def test_the_limit_measures_each_completions_grading_not_its_wait() -> None:
    """Issue 25 item 6: 2 processes, a 1 s limit, 20 completions that each grade in 0.2 s: all
    are scored (2 s in all, 10 per process); add one that hangs: the 20 are scored and only it is
    unscored, after about 1 s of its own, its process replaced."""
    with pool("SLOW", timeout_s=1.0, processes=2) as p:
        assert [g.reward for g in grade(p, ["x"] * 20)] == [1.0] * 20
        grades = grade(p, ["x"] * 10 + ["hang"] + ["x"] * 10)
        assert [g.reward for g in grades] == [1.0] * 10 + [None] + [1.0] * 10
        assert grades[10].error == "slow: timeout after 1.0s"
        assert p.failures["timeout"] == 1 and p.failures.total() == 1


def test_worker_death_is_a_failure_and_respawns(tricky_pool: GradingPool) -> None:
    grades = grade(tricky_pool, ["exit"])
    assert grades[0].reward is None and "worker died (exit code 3)" in grades[0].error
    assert tricky_pool.failures["crash"] >= 1
    assert grade(tricky_pool, ["ok"])[0].reward == 2.0


def test_worker_killed_between_calls_is_replaced(tricky_pool: GradingPool) -> None:
    victim = tricky_pool._workers[0]
    victim.proc.kill()
    victim.proc.wait()
    grades = grade(tricky_pool, ["ok"])
    assert grades[0].reward is None and "died" in grades[0].error
    assert grade(tricky_pool, ["ok"])[0].reward == 2.0


def test_a_group_column_grades_each_group_in_one_call() -> None:
    """Group-level rewards (`protocol.envs.group_rewards`) see their whole group: rows with a
    `group` column are graded a group per call; without it, a row per call. A group that hangs
    fails its own rows only."""
    with pool("SIZES", timeout_s=1.0, processes=2) as p:
        assert [g.reward for g in grade(p, ["a"] * 4)] == [1.0] * 4
        texts = ["a", "b", "c", "d", "e", "hang"]
        groups = [{"group": g} for g in (7, 3, 7, 7, 3, 5)]
        grades = p.grade(["Q"] * 6, texts, groups)
    assert [g.reward for g in grades] == [3.0, 2.0, 3.0, 3.0, 2.0, None]
    assert grades[5].error == "call_size: timeout after 1.0s"


def test_parallel_processes_share_the_batch() -> None:
    with pool("make_tricky", timeout_s=0.5, processes=2) as p:
        grades = grade(p, ["ok", "ok", "nan", "ok", "raise", "ok"])
    assert [g.reward for g in grades] == [2.0, 2.0, None, 2.0, None, 2.0]
    assert "non-finite" in grades[2].error and "ValueError: boom" in grades[4].error


def test_worker_gets_no_inherited_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMRL_TEST_SECRET", "key material")
    with pool("SNOOP") as p:
        assert grade(p, ["x"])[0].reward == 0.0


def test_bad_inputs_and_environments(tricky_pool: GradingPool) -> None:
    with pytest.raises(ValueError):
        tricky_pool.grade(["Q"], ["a", "b"], [{}, {}])
    with pytest.raises(ValueError):
        tricky_pool.grade(["Q", "Q"], ["a", "b"], [{"answer": 1}, {}])
    with pytest.raises(ValueError):
        tricky_pool.grade(["Q"], ["a"], [{"answer": object()}])
    assert tricky_pool.grade([], [], []) == []
    with pytest.raises(GradingError):
        GradingPool("no-such-environment", "0")
    with pytest.raises(GradingError):
        pool("NOT_THERE")
    closed = pool("ARITH")
    closed.close()
    closed.close()
    with pytest.raises(GradingError):
        grade(closed, ["x"])


def test_installed_environment_by_name_matches_in_process_grading() -> None:
    env = get_environment("arithmetic")
    specs = [env.prompt(0, i) for i in range(3)]
    completions = [" 7\n", " The answer is 12.", ""]
    with GradingPool(env.name, env.version) as p:
        grades = p.grade([s.text for s in specs], completions, [s.info for s in specs])
    expected = env.rewards(specs, completions)
    assert [g.rewards for g in grades] == [tuple(r) for r in expected]
    assert [g.reward for g in grades] == [env.total(r) for r in expected]
    with pytest.raises(GradingError):
        GradingPool(env.name, env.version + "-other")
