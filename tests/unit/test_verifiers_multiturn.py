"""A verifiers-style multi-turn environment (env_response / is_completed, sync or async) runs
through the existing adapter as an episode environment: played, replayed and graded."""

from __future__ import annotations

import re
import types
from typing import Any

import pytest

from swarmrl.node.episode_play import episode_rewards, play_episodes
from swarmrl.node.inference.base import SampledCompletion, Sampling
from swarmrl.node.model_recipes import build_tiny_tokenizer
from swarmrl.protocol.envs.base import PromptSpec
from swarmrl.protocol.envs.episode import EpisodeEnv, EpisodeSpec
from swarmrl.protocol.envs.verifiers_adapter import VerifiersEnv, adapt_verifiers


def _guess(messages: list[dict[str, Any]]) -> int | None:
    found = re.findall(r"\d+", messages[-1]["content"])
    return int(found[-1]) if found else None


def solved(completion: str, answer: str, **kwargs: Any) -> float:
    return 1.0 if re.findall(r"\d+", completion)[-1:] == [answer] else 0.0


class GuessEnv:
    """Guess a number; the environment says higher or lower (a MultiTurnEnv in verifiers' shape)."""

    def __init__(self, asynchronous: bool) -> None:
        self.dataset = [{"question": "Guess my number (1-20).", "answer": str(3 + i % 15)} for i in range(30)]
        self.eval_dataset = [{"question": "Guess my number (1-9).", "answer": "5"}]
        self.system_prompt = "One number per turn."
        self.rubric = types.SimpleNamespace(funcs=[solved], weights=[1.0])
        self.max_turns = 5
        self.asynchronous = asynchronous

    def _respond(self, messages: list[dict[str, Any]], state: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        guess = _guess(messages)
        hint = "not a number" if guess is None else "higher" if guess < int(state["answer"]) else "lower"
        return [{"role": "user", "content": hint}], {**state, "hints": state.get("hints", 0) + 1}

    def env_response(self, messages: list[dict[str, Any]], state: dict[str, Any]) -> Any:
        if self.asynchronous:
            async def later() -> tuple[list[dict[str, Any]], dict[str, Any]]:
                return self._respond(messages, state)
            return later()
        return self._respond(messages, state)

    def is_completed(self, messages: list[dict[str, Any]], state: dict[str, Any]) -> bool:
        return _guess(messages) == int(state["answer"])


def _module(asynchronous: bool) -> types.ModuleType:
    module = types.ModuleType("vf_guess")
    module.load_environment = lambda **kw: GuessEnv(asynchronous)  # type: ignore[attr-defined]
    module.__version__ = "0.1"  # type: ignore[attr-defined]
    return module


def test_single_turn_environments_stay_single_turn() -> None:
    env = GuessEnv(False)
    del env.asynchronous
    module = types.ModuleType("vf_single")
    plain = types.SimpleNamespace(dataset=env.dataset, eval_dataset=env.eval_dataset, rubric=env.rubric)
    module.load_environment = lambda **kw: plain  # type: ignore[attr-defined]
    adapted = adapt_verifiers(module)
    assert isinstance(adapted, VerifiersEnv) and not isinstance(adapted, EpisodeEnv)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_verifiers_multiturn_environment_plays_replays_and_grades(asynchronous: bool) -> None:
    env = adapt_verifiers(_module(asynchronous))
    assert isinstance(env, EpisodeEnv) and env.name == "vf_guess" and env.max_turns == 5 and env.deterministic
    spec = env.prompt(0, 2)
    answer = int(spec.info["answer"])
    assert env.reply(spec, ["1"]).observation == "\nhigher\n"
    assert env.reply(spec, ["1", "19"]).observation == "\nlower\n"
    assert env.reply(spec, ["1", str(answer)]).done
    assert env.reply(spec, ["1"] * 5).done   # the environment's turn limit

    tok = build_tiny_tokenizer()

    def script(p: PromptSpec, turns: list[str]) -> SampledCompletion:
        text = " 1" if not turns else f" {p.info['answer']}"
        ids = tok(text, add_special_tokens=False).input_ids
        return SampledCompletion(ids, [0.0] * len(ids), "stop", text)

    specs = env.prompts(0, [0, 1])
    traces = play_episodes(lambda c, s: [], tok, env, specs, [tok(p.text).input_ids for p in specs], n=1,
                           sampling=Sampling(n=1, max_new_tokens=4), script=script,
                           limits=EpisodeSpec(max_turns=5, max_tokens=64, max_observation_tokens=16))
    for t in (g[0] for g in traces):
        assert t.turns == 2 and t.finish_reason == "stop" and t.observations == ["\nhigher\n"]
        assert t.mask_T.count(0) == len(tok("\nhigher\n", add_special_tokens=False).input_ids)
    assert [env.total(r) for r in episode_rewards(env, specs, traces, tok)] == [1.0, 1.0]
