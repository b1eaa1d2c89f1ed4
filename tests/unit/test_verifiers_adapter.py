"""verifiers environments through the adapter, against the real `verifiers` package (0.3.1, the
`swarmrl[verifiers]` extra; these tests skip without it): a MultiTurnEnv packaged as a submitter
would (tests/fixtures/vf_guess, pip-installed, found through the entry-point group) plays,
replays and grades exactly as verifiers' own rollout loop does, on the tiny model's tokenizer
with token-exact traces; single-turn and group-level rubrics; what is refused and why."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from swarmrl.node.inference.base import Sampling
from swarmrl.node.models.recipes import build_tiny_tokenizer
from swarmrl.node.tasks.episode_play import (
    encode_observation,
    episode_rewards,
    play_episodes,
    scripted,
    trace_completion,
)
from swarmrl.protocol.envs import get_environment, installed_environments
from swarmrl.protocol.envs.base import HELDOUT_START, PromptSpec
from swarmrl.protocol.envs.episode import EpisodeEnv, EpisodeSpec
from swarmrl.protocol.envs.verifiers_adapter import VerifiersEnv
from swarmrl.protocol.envs.verifiers_load import adapt_verifiers
from swarmrl.protocol.envs.verifiers_multiturn import VerifiersEpisodeEnv
from swarmrl.protocol.envs.verifiers_replay import finished
from swarmrl.validator.episodes import replay_episode

SYSTEM = "I am thinking of a number from 1 to 16. Guess it: reply with one number per turn."


@pytest.fixture(scope="module")
def guess(vf_guess_site: Path) -> VerifiersEpisodeEnv:
    env = get_environment("vf_guess", "0.1.0")
    assert isinstance(env, VerifiersEpisodeEnv)
    return env


def _spec(env: VerifiersEpisodeEnv, index: int, turns: list[str]) -> PromptSpec:
    p = env.prompt(0, index)
    return PromptSpec(index=index, text=p.text, info={**p.info, "turns": turns})


def test_the_package_is_found_and_adapted(guess: VerifiersEpisodeEnv) -> None:
    listed = {e.name: e for e in installed_environments()}["vf_guess"]
    assert (listed.version, listed.package, len(listed.package_sha256)) == ("0.1.0", "vf-guess", 64)
    assert guess.max_turns == 6 and guess.deterministic and not guess.group_rewards
    # a MultiTurnEnv's rubric is a RubricGroup: its own functions, then verifiers' num_turns metric
    assert [f.__name__ for f in guess.reward_funcs] == ["correct_answer", "efficiency", "num_turns"]
    assert guess.reward_weights == (1.0, 0.2, 0.0)
    p = guess.prompt(0, 2)   # verifiers' formatted prompt: system prompt, then the question
    assert p.messages == (("system", SYSTEM), ("user", "Round 2: your first guess?"))
    assert p.text == f"{SYSTEM}\n\nRound 2: your first guess?"
    assert p.info == {"answer": "2", "vf_split": "train", "vf_row": 2} and guess.prompt(0, 66).info["vf_row"] == 2
    assert guess.prompt(0, HELDOUT_START + 4).info == {"answer": "5", "vf_split": "eval", "vf_row": 4}


def test_replies_come_from_env_response_and_the_stop_conditions(guess: VerifiersEpisodeEnv) -> None:
    p = guess.prompt(0, 1)   # the number is 11
    assert p.info["answer"] == "11"
    assert guess.reply(p, ["8"]).observation == "\nHigher.\n"
    assert guess.reply(p, ["8", "12"]).observation == "\nLower.\n"
    assert guess.reply(p, ["8", "twelve"]).observation == "\nNot a number. Guess again.\n"
    assert guess.reply(p, ["8", "11"]).done                       # the environment's @vf.stop `guessed`
    assert guess.reply(p, ["1"] * 6).done and not guess.reply(p, ["1"] * 5).done   # max_turns_reached
    assert guess.reply(p, ["8", "12"]) == guess.reply(p, ["8", "12"])   # replayed from scratch, the same


def test_rewards_get_verifiers_messages_and_state(guess: VerifiersEpisodeEnv) -> None:
    state = finished(guess.vf_env, guess.row(guess.prompt(0, 1).info), ["8", "12", "11"])
    assert [(m.role, m.content) for m in state["completion"]] == [
        ("assistant", "8"), ("user", "Higher."), ("assistant", "12"), ("user", "Lower."), ("assistant", "11")]
    assert state["stop_condition"] == "guessed" and state["guesses"] == ["8", "12"]   # setup_state + env_response
    rows = guess.rewards([_spec(guess, 1, ["8", "12", "11"]), _spec(guess, 1, ["8", "9"]), _spec(guess, 1, ["11"])],
                         ["", "", ""])
    assert rows == [[1.0, pytest.approx(1 - 2 / 6), 3.0], [0.0, 0.0, 2.0], [1.0, 1.0, 1.0]]
    assert [guess.total(r) for r in rows] == [pytest.approx(1.2 - 0.4 / 6), 0.0, pytest.approx(1.2)]


class _ScriptedClient:
    """A verifiers `Client` answering with fixed turns: verifiers' own rollout loop then plays the
    same episode our adapter replays (the model's side of `vf_env.rollout`)."""

    @staticmethod
    def make(turns: list[str]) -> Any:
        import verifiers as vf
        from verifiers.legacy.clients import Client
        from verifiers.legacy.types import Response, ResponseMessage

        left = list(turns)

        class Scripted(Client):  # type: ignore[misc]
            def setup_client(self, config: Any) -> None:
                return None

            async def to_native_tool(self, tool: Any) -> Any:
                return tool

            async def to_native_prompt(self, messages: vf.Messages) -> tuple[Any, dict[str, Any]]:
                return messages, {}

            async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                          **kwargs: Any) -> str:
                return left.pop(0)

            async def raise_from_native_response(self, response: Any) -> None:
                return None

            async def from_native_response(self, response: str) -> Any:
                return Response(id="r", created=0, model="scripted",
                                message=ResponseMessage(content=response, finish_reason="stop", is_truncated=False))

            async def close(self) -> None:
                return None

        return Scripted(None)


@pytest.mark.parametrize("turns", [["8", "12", "11"], ["1", "x", "3", "4", "5", "6"]])
def test_the_adapter_replays_what_verifiers_own_rollout_plays(guess: VerifiersEpisodeEnv, turns: list[str]) -> None:
    row = guess.row(guess.prompt(0, 1).info)
    theirs = asyncio.run(guess.vf_env.rollout(dict(row), _ScriptedClient.make(turns), "scripted", {}))
    asyncio.run(guess.vf_env.rubric.score_rollout(theirs))
    ours = guess.rewards([_spec(guess, 1, turns)], [""])[0]
    assert list(theirs["metrics"].values()) == ours and theirs["reward"] == pytest.approx(guess.total(ours))
    mine = finished(guess.vf_env, row, turns)
    assert mine["completion"] == theirs["completion"] and mine["stop_condition"] == theirs["stop_condition"]


def test_episodes_are_token_exact_on_the_tiny_tokenizer(guess: VerifiersEpisodeEnv) -> None:
    tok = build_tiny_tokenizer()
    specs = guess.prompts(0, [0, 1])
    limits = EpisodeSpec(max_turns=6, max_tokens=64, max_observation_tokens=16)
    traces = play_episodes(lambda c, s: [], tok, guess, specs, [tok(p.text).input_ids for p in specs], n=2,
                           sampling=Sampling(n=1, max_new_tokens=4), script=scripted(tok, guess), limits=limits)
    for spec, group in zip(specs, traces, strict=True):
        for t in group:   # the binary-search player: 8, then halves; every reply is the environment's
            assert t.finish_reason == "stop" and t.turn_texts[0] == "8" and t.turn_texts[-1] == spec.info["answer"]
            env_ids = [i for i, m in zip(t.token_ids_T, t.mask_T, strict=True) if m == 0]
            assert env_ids == [i for o in t.observations for i in encode_observation(tok, o)]
            assert replay_episode(guess, spec, tok, trace_completion(t, 0), limits) == ""
    assert [t.turn_texts for t in traces[1]] == [["8", "12", "10", "11"]] * 2
    rewards = episode_rewards(guess, specs, traces, tok)
    assert [r[0] for r in rewards] == [1.0] * 4 and guess.solved(specs[1].info, ["8", "12", "10", "11"])
    assert not guess.solved(specs[1].info, ["8", "9"])


def test_a_forged_reply_fails_the_replay(guess: VerifiersEpisodeEnv) -> None:
    tok = build_tiny_tokenizer()
    spec = guess.prompt(0, 1)
    limits = EpisodeSpec(max_turns=6, max_tokens=64, max_observation_tokens=16)
    t = play_episodes(lambda c, s: [], tok, guess, [spec], [tok(spec.text).input_ids], n=1,
                      sampling=Sampling(n=1, max_new_tokens=4), script=scripted(tok, guess), limits=limits)[0][0]
    c = trace_completion(t, 0)
    at = list(c.token_mask).index(0)
    forged = encode_observation(tok, "Lower.")[0]   # "Higher." rewritten
    assert c.token_ids[at + 1] != forged
    c.token_ids[at + 1] = forged
    assert "reply 0: claimed" in replay_episode(guess, spec, tok, c, limits)


def _module(name: str, load: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.load_environment = load  # type: ignore[attr-defined]
    module.__version__ = "0.2"  # type: ignore[attr-defined]
    return module


def test_single_turn_environments_get_their_completion_as_messages(vf_guess_site: Path) -> None:
    import verifiers as vf
    from datasets import Dataset

    seen: list[Any] = []

    def exact(completion: vf.Messages, answer: str) -> float:
        seen.append(completion)
        return 1.0 if completion[-1]["content"].strip() == answer else 0.0

    def load(**kwargs: Any) -> vf.Environment:
        rows = Dataset.from_list([{"question": f"{i}+{i}?", "answer": str(2 * i)} for i in range(20)])
        return vf.SingleTurnEnv(dataset=rows, eval_dataset=rows.select(range(3)), system_prompt="Add.",
                                rubric=vf.Rubric(funcs=[exact], weights=[0.5]))

    env = adapt_verifiers(_module("vf_add", load))
    assert isinstance(env, VerifiersEnv) and not isinstance(env, EpisodeEnv)
    assert (env.name, env.version, env.reward_weights) == ("vf_add", "0.2", (0.5, 0.0))   # + num_turns
    p = env.prompt(0, 3)
    assert p.messages == (("system", "Add."), ("user", "3+3?")) and p.info["answer"] == "6"
    assert env.rewards([p, p], [" 6", "7"]) == [[1.0, 1.0], [0.0, 1.0]]
    assert [(m.role, m.content) for m in seen[0]] == [("assistant", " 6")]


def test_group_level_rubric_functions_score_each_group(vf_guess_site: Path) -> None:
    import verifiers as vf
    import vf_guess

    def shortest(completions: list[vf.Messages]) -> list[float]:   # verifiers' GroupRewardFunc signature
        lengths = [len(c) for c in completions]
        return [1.0 if n == min(lengths) else 0.0 for n in lengths]

    def load(**kwargs: Any) -> vf.Environment:
        env = vf_guess.load_environment()
        env.rubric.rubrics[0].add_reward_func(shortest, weight=0.1)
        return env

    env = adapt_verifiers(_module("vf_guess_grouped", load))
    assert env.group_rewards and [f.__name__ for f in env.reward_funcs][2] == "shortest"
    rows = [_spec(env, 1, t) for t in (["8", "11"], ["8", "12", "11"], ["11"], ["8", "11"])]
    for r, g in zip(rows, (1, 1, 2, 2), strict=True):
        r.info["group"] = g
    assert [r[2] for r in env.rewards(rows, [""] * 4)] == [1.0, 0.0, 1.0, 0.0]


def test_what_is_not_a_verifiers_multiturn_env_is_refused(vf_guess_site: Path) -> None:
    import vf_guess

    with pytest.raises(ValueError, match="returned a builtins.dict, not a verifiers MultiTurnEnv"):
        adapt_verifiers(_module("vf_bad", lambda **kw: {"dataset": []}))
    with pytest.raises(ValueError, match="neither an Environment nor has load_environment"):
        adapt_verifiers(types.ModuleType("vf_none"))
    handler = signal.getsignal(signal.SIGTERM)   # verifiers' Environment installs its own; loading keeps ours
    adapt_verifiers(_module("vf_guess_again", vf_guess.load_environment))
    assert signal.getsignal(signal.SIGTERM) is handler


def test_an_environment_loads_off_the_main_thread(vf_guess_site: Path) -> None:
    import vf_guess

    with concurrent.futures.ThreadPoolExecutor(1) as pool:   # verifiers' signal.signal would raise there
        env = pool.submit(adapt_verifiers, _module("vf_guess_thread", vf_guess.load_environment)).result()
    assert env.reply(env.prompt(0, 1), ["8"]).observation == "\nHigher.\n"


def test_without_the_package_the_adapter_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "verifiers", None)   # as if not installed
    with pytest.raises(ValueError, match=r"needs the `verifiers` package: pip install 'swarmrl\[verifiers\]'"):
        adapt_verifiers(_module("vf_any", lambda **kw: None))

