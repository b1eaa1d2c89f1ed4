"""Playing a `verifiers` environment's episode from the model's turns with verifiers' own machinery.

Written against verifiers' classic API (`verifiers.MultiTurnEnv`, of which `SingleTurnEnv` is the
one-turn case; verifiers 0.3.1, the `swarmrl[verifiers]` extra). The model is swarmrl's, so the
rollout loop of `MultiTurnEnv.rollout` is re-driven here with the model's turns as given:

    state = init_state(row); setup_state(state)
    for each model turn:
        stop if is_completed(state)              # the environment's @vf.stop conditions
        prompt = get_prompt_messages(state)      # calls env_response after the first turn
        stop if state["final_env_response"]
        add_trajectory_step(state, prompt + the turn as an assistant message)
    then once more (the environment's answer to the last turn): is_completed, get_prompt_messages

`replay` returns the state, the messages the environment added after the last turn (the next
observation) and whether the episode is over; `finished` then runs the environment's cleanup
handlers, which render `state["completion"]` (the episode's messages after the prompt, with a
`final_env_response` if one was set) as verifiers does before scoring. Reward functions are
called as verifiers' `Rubric` calls them (`Rubric.score_objects`: `prompt`, `completion` and
`state` as verifiers types, `answer`, `info`, `task`, `parser` and the rubric's class objects;
only the names a function declares unless it takes `**kwargs`; sync or async), but a function that
raises propagates (verifiers logs it and scores 0.0; swarmrl's grader records the failure).

The environment's state is rebuilt from scratch from the row and the turns every time, so an
environment whose `env_response` is a function of the conversation and the state is replayed
exactly by validators. A model call made by the environment itself (`state["client"]`) is
refused: the model runs in swarmrl's worker, not behind an API.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def verifiers_module() -> Any:
    """The `verifiers` package.

    Raises:
        ValueError: it is not installed.
    """
    try:
        import verifiers
    except ImportError as e:
        raise ValueError("this environment needs the `verifiers` package: pip install 'swarmrl[verifiers]' "
                         f"({type(e).__name__}: {e})") from e
    return verifiers


@functools.cache
def _no_model_client() -> Any:
    """A verifiers `Client` that refuses every model call (one instance per process)."""
    from verifiers.legacy.clients import Client

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a verifiers environment asked for a model call: under swarmrl the model runs in "
                           "the worker, and an environment's own model calls (judges, simulated users) are "
                           "not supported")

    async def refuse_async(*args: Any, **kwargs: Any) -> Any:
        refuse()

    async def close(self: Any) -> None:
        return None

    methods = {name: refuse_async for name in ("to_native_tool", "to_native_prompt", "get_native_response",
                                               "raise_from_native_response", "from_native_response")}
    cls = type("SwarmrlNoModelClient", (Client,), {"setup_client": refuse, "close": close, **methods})
    return cls(None)


def content_text(content: Any) -> str:
    """A message's content as text: a string as is, the text parts of a list of content parts
    joined by spaces (as verifiers' `Parser` reads them).

    Raises:
        ValueError: content that is neither (an image-only message).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") if isinstance(p, dict) else getattr(p, "text", None) for p in content]
        return " ".join(p for p in parts if isinstance(p, str)).strip()
    raise ValueError(f"message content of type {type(content).__name__} is not text")


@dataclass
class Replay:
    """One replayed episode.

    state: the verifiers state after the model's turns (and the environment's answer to the last).
    observation: the messages the environment added after the last turn ([] when it ended).
    done: the episode is over (a stop condition fired or the environment sent a final response).
    """

    state: Any
    observation: list[Any]
    done: bool


async def _replay(vf_env: Any, row: dict[str, Any], turns: Sequence[str]) -> Replay:
    vf = verifiers_module()
    state = await vf_env.init_state(dict(row), _no_model_client(), "swarmrl")
    state = await vf_env.setup_state(state) or state
    for i, text in enumerate([*turns, None]):
        if await vf_env.is_completed(state):
            return Replay(state, [], True)
        prompt = list(await vf_env.get_prompt_messages(state))
        if state.get("final_env_response") is not None:
            await vf_env.is_completed(state)   # records the stop condition, as the rollout loop does
            return Replay(state, [], True)
        if text is None:   # the environment's answer to the last turn: the next observation
            step = state["trajectory"][-1] if state["trajectory"] else None
            seen = len(step["prompt"]) + len(step["completion"]) if step is not None else len(prompt)
            return Replay(state, prompt[seen:], False)
        completion = [vf.AssistantMessage(content=text)]
        await vf_env.add_trajectory_step(state, {
            "prompt": prompt, "completion": completion, "response": None, "tokens": None, "reward": None,
            "advantage": None, "is_truncated": False, "trajectory_id": state["trajectory_id"],
            "extras": {"swarmrl_turn": i}})
    raise AssertionError("unreachable")


def replay(vf_env: Any, row: dict[str, Any], turns: Sequence[str]) -> Replay:
    """Play `turns` against the environment from the dataset row `row` (see the module docstring).

    Raises whatever the environment's code raises.
    """
    return asyncio.run(_replay(vf_env, row, turns))


def finished(vf_env: Any, row: dict[str, Any], turns: Sequence[str]) -> Any:
    """The state of the episode with these turns as verifiers scores it: replayed, then the
    environment's cleanup handlers run (they render `state["completion"]`)."""
    async def run() -> Any:
        played = await _replay(vf_env, row, turns)
        await vf_env.cleanup(played.state)
        return played.state

    return asyncio.run(run())


def _named(func: Any, objects: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(func).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return objects
    return {k: v for k, v in objects.items() if k in params}


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def call_reward(rubric: Any, func: Any, state: Any) -> Any:
    """`func`'s value on one scored state, called as verifiers' `Rubric` calls it."""
    return asyncio.run(_maybe_await(func(**_named(func, rubric.score_objects(state)))))


def call_group_reward(rubric: Any, func: Any, states: list[Any]) -> Any:
    """A group-level function's values (one per state), called as verifiers' `Rubric` calls it."""
    return asyncio.run(_maybe_await(func(**_named(func, rubric.group_score_objects(states)))))
