"""The built-in multi-turn environments (wordle, calculator), traces and their admission checks."""

from __future__ import annotations

import math

import pytest

from swarmrl.protocol import admission as adm
from swarmrl.protocol.envs import HELDOUT_START, get_environment, wordle
from swarmrl.protocol.envs import calculator as calc
from swarmrl.protocol.envs.episode import EpisodeEnv
from swarmrl.protocol.envs.group_rewards import pairwise_win_rate, shortest_correct_bonus
from swarmrl.protocol.envs.trace import (
    ENV_LOGPROB,
    MASK_LENGTH,
    MASK_VALUE,
    MISSING_TRACE,
    TOO_MANY_TURNS,
    TRACE_START,
    TURN_COUNT,
    UNEXPECTED_TRACE,
    Trace,
    check_trace,
    split_turns,
)
from swarmrl.protocol.pb import swarm_pb2 as pb


def test_wordle_feedback_follows_the_repeated_letter_rule() -> None:
    assert wordle.feedback("crane", "crane") == "GGGGG"
    assert wordle.feedback("crane", "caret") == "GYYY."
    assert wordle.feedback("abbey", "bobby") == "Y.G.G"
    assert wordle.feedback("sheep", "eerie") == "YY..."


def test_wordle_plays_and_grades_an_episode() -> None:
    env = wordle.WordleEnv()
    spec = env.prompt(0, 3)
    secret = spec.info["secret"]
    assert spec == env.prompt(0, 3) and len(secret) == 5 and secret in wordle.TRAIN_WORDS
    assert env.prompt(0, HELDOUT_START).info["secret"] in wordle.HELDOUT_WORDS
    assert not set(wordle.TRAIN_WORDS) & set(wordle.HELDOUT_WORDS)
    assert 400 < len(wordle.WORDS) < 600
    first = env.reply(spec, [" zzzzz\n"])
    assert not first.done and first.observation == ".....\nGuess:"
    assert env.reply(spec, [" what?\n"]).observation.startswith(" (not a five")
    assert env.reply(spec, [" zzzzz\n", f" {secret.upper()}\n"]).done
    assert env.reply(spec, [" zzzzz\n"] * 6).done
    turns = [" zzzzz\n", "no idea\n", f" {secret}\n"]
    cols = {"prompts": [spec.text], "completions": ["".join(turns)], "secret": [secret], "turns": [turns]}
    assert wordle.solved_reward(**cols) == [1.0]
    assert wordle.letters_reward(**cols) == [1.0]
    assert wordle.format_reward(**cols) == [pytest.approx(2 / 3)]
    assert wordle.WordleEnv.solved({"secret": secret}, turns)


def test_calculator_evaluates_safely() -> None:
    assert calc.evaluate("12*3") == 36
    assert calc.evaluate(" (7 + 5) // 2 ") == 6
    assert calc.format_result(calc.evaluate("7/2")) == "3.5"
    assert calc.format_result(calc.evaluate("6/2")) == "3"
    for bad in ("__import__('os')", "x+1", "2**100000", "9**9**9", "1/0", "[1]*3", "", "1" * 80, "10**16*10"):
        with pytest.raises(calc.ToolError):
            calc.evaluate(bad)


def test_calculator_replies_and_grades() -> None:
    env = calc.CalculatorEnv()
    spec = env.prompt(0, 1)
    assert spec.text.startswith(calc.EXAMPLES) and spec.text.endswith("\nA:")
    assert env.reply(spec, [" <calc>12*3</calc>"]) == calc.Reply(" = 36", done=False)
    assert env.reply(spec, [" <calc>1/0</calc>"]).observation == " = error: division by zero"
    assert env.reply(spec, [" Answer: 5\n"]).done
    answer = spec.info["answer"]
    good = [" <calc>1+1</calc>", f". Answer: {answer}\n"]
    long_good = [" <calc>1+1</calc>", f". So the answer is clear. Answer: {answer}\n"]
    bad = [" Answer: 0\n"]
    turns = [good, long_good, bad]
    texts = [" = 2".join(t) for t in turns[:2]] + ["".join(bad)]
    cols = {"prompts": [spec.text] * 3, "completions": texts, "answer": [answer] * 3, "turns": turns,
            "group": [7, 7, 7]}
    assert calc.correct_reward(**cols) == [1.0, 1.0, 0.0]
    assert calc.format_reward(**cols) == [1.0, 1.0, 1.0]
    assert calc.format_reward(prompts=["q"] * 3, completions=[""] * 3, turns=[["so 4"], ["none"], []]) == [0.5, 0.0, 0.0]
    assert calc.shortest_correct_reward(**cols) == [1.0, 0.0, 0.0]
    assert calc.tool_calls(good) == 1 and calc.tool_calls(bad) == 0
    assert env.tool_calls(good) == 1   # what swarmrl eval's tool-call rate reads
    assert calc.parse_answer("so 42") == 42 and calc.parse_answer("nothing") is None


def test_group_rewards_are_the_same_over_one_group_or_a_batch() -> None:
    correct = [True, True, False, True, True]
    lengths = [5, 3, 1, 9, 9]
    groups = [1, 1, 1, 2, 2]
    assert shortest_correct_bonus(correct, lengths, groups) == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert shortest_correct_bonus(correct[:3], lengths[:3], groups[:3]) == [0.0, 1.0, 0.0]
    assert pairwise_win_rate([1.0, 2.0, 2.0, 0.0], ["a", "a", "a", "b"]) == [0.0, 0.75, 0.75, 0.5]


def test_both_environments_are_installed_and_episodic() -> None:
    for name in ("wordle", "calculator"):
        env = get_environment(name)
        assert isinstance(env, EpisodeEnv) and env.version == "1"


def _two_turn() -> Trace:
    t = Trace()
    t.add_model([5, 6], [-0.5, -1.0], "ab")
    t.add_env([7, 8, 9], "cde")
    t.add_model([10], [-0.25], "f")
    return t


def test_trace_shape_checks_name_each_problem() -> None:
    t = _two_turn()
    assert t.mask_T == [1, 1, 0, 0, 0, 1] and t.logprobs_T == [-0.5, -1.0, 0.0, 0.0, 0.0, -0.25] and t.turns == 2
    assert split_turns(t.token_ids_T, t.mask_T) == ([[5, 6], [10]], [[7, 8, 9]])
    ok = (t.token_ids_T, t.mask_T, t.logprobs_T, 2)
    assert check_trace(*ok, max_turns=6) == ""
    assert check_trace(*ok, max_turns=1) == TOO_MANY_TURNS
    assert check_trace(t.token_ids_T, t.mask_T[:-1], t.logprobs_T, 2, max_turns=6) == MASK_LENGTH
    assert check_trace(t.token_ids_T, [1, 1, 0, 2, 0, 1], t.logprobs_T, 2, max_turns=6) == MASK_VALUE
    assert check_trace(t.token_ids_T, [0, 1, 0, 0, 0, 1], t.logprobs_T, 2, max_turns=6) == TRACE_START
    assert check_trace(t.token_ids_T, t.mask_T, t.logprobs_T, 3, max_turns=6) == TURN_COUNT
    # model tokens flagged as environment tokens: they carry sampled log-probs
    assert check_trace(t.token_ids_T, [1, 0, 0, 0, 0, 1], t.logprobs_T, 2, max_turns=6) == ENV_LOGPROB
    nan = [-0.5, -1.0, 0.0, math.nan, 0.0, -0.25]
    assert check_trace(t.token_ids_T, t.mask_T, nan, 2, max_turns=6) == ENV_LOGPROB
    assert check_trace(t.token_ids_T, [], t.logprobs_T, 0, max_turns=6) == MISSING_TRACE
    assert check_trace(t.token_ids_T, t.mask_T, t.logprobs_T, 2, max_turns=0) == UNEXPECTED_TRACE
    assert check_trace(t.token_ids_T, [], t.logprobs_T, 0, max_turns=0) == ""


def test_admission_rejects_bad_traces_with_a_reason() -> None:
    lim = adm.AdmissionLimits(group_size=2, vocab_size=100, max_prompt_tokens=16, max_new_tokens=6,
                              reward_range=(0.0, 1.6), num_reward_funcs=1, max_async_level=2, max_turns=2)
    lease = pb.Lease(policy_version=0)
    t = _two_turn()

    def completion(**kw: object) -> pb.Completion:
        fields = {"token_ids": t.token_ids_T, "logprobs": t.logprobs_T, "token_mask": t.mask_T, "turns": 2,
                  "finish_reason": "stop", "rewards": [1.0], "reward": 1.0, **kw}
        return pb.Completion(**fields)  # type: ignore[arg-type]

    assert adm.check_completion(completion(), lease, 0, lim) == ""
    assert adm.check_completion(completion(token_mask=t.mask_T[:5]), lease, 0, lim) == MASK_LENGTH
    assert adm.check_completion(completion(turns=3), lease, 0, lim) == TURN_COUNT
    longer = lim.__class__(**{**lim.__dict__, "max_new_tokens": 5})
    assert adm.check_completion(completion(), lease, 0, longer) == adm.TOO_LONG
    bad_lp = [-0.5, -1.0, 0.0, math.inf, 0.0, -0.25]
    assert adm.check_completion(completion(logprobs=bad_lp), lease, 0, lim) == ENV_LOGPROB
    nan_model = [math.nan, -1.0, 0.0, 0.0, 0.0, -0.25]
    assert adm.check_completion(completion(logprobs=nan_model), lease, 0, lim) == adm.NON_FINITE


def test_the_grading_pool_gives_a_group_reward_the_same_over_a_batch_or_one_group() -> None:
    """The validator re-grades only its sampled groups: a group-level reward must not depend on
    the other groups of the worker's batch."""
    from swarmrl.node.tasks.grading import GradingPool

    env = calc.CalculatorEnv()
    a, b = env.prompt(0, 1), env.prompt(0, 2)

    def rows(spec: calc.PromptSpec, finals: list[str]) -> tuple[list[str], list[str], list[dict[str, object]]]:
        turns = [[f" <calc>{spec.info['expression']}</calc>", f". {f}\n"] for f in finals]
        infos = [{**spec.info, "turns": t, "group": spec.index} for t in turns]
        return [spec.text] * len(finals), ["".join(t) for t in turns], infos

    ra = rows(a, [f"Answer: {a.info['answer']}", f"So it is. Answer: {a.info['answer']}", "Answer: 0"])
    rb = rows(b, [f"Answer: {b.info['answer']} at last", f"Answer: {b.info['answer']}"])
    with GradingPool("calculator", "1", timeout_s=20.0) as pool:
        both = pool.grade(ra[0] + rb[0], ra[1] + rb[1], ra[2] + rb[2])
        alone = pool.grade(*rb)
    assert [g.rewards[2] for g in both] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert [g.reward for g in both[3:]] == [g.reward for g in alone] == [pytest.approx(1.1), pytest.approx(1.3)]
