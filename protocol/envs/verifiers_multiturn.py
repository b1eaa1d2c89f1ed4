"""Run a `verifiers` multi-turn environment (`MultiTurnEnv`-shaped) as a swarmrl `EpisodeEnv`.

Duck-typed, as the single-turn adapter (`verifiers_adapter.py`; the package is not installed
here): besides a data set and a rubric, the loaded environment has
- `env_response(messages, state, **kwargs) -> (new_messages, state)`: the environment's reply to
  the conversation so far (a list of `{"role", "content"}` dicts), sync or async;
- `is_completed(messages, state, **kwargs) -> bool` (optional; default: never, so the turn limit
  ends the episode), sync or async;
- `max_turns` (optional, default 10).

A reply is recomputed from scratch from the prompt's messages and the model's turns (a fresh
state `{"answer", "info", "prompt", "turn"}` each time), so replies are a pure function of the
turns as long as the environment's are: validators replay them. An environment that is not
deterministic sets `deterministic = False` and its episodes are not replayed.
Each reply renders as plain text: its messages' contents, each on its own line. Rubric functions
get the episode's text after the first observation as `completion`, as single-turn ones do.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from typing import Any

from swarmrl.protocol.envs.base import PromptSpec
from swarmrl.protocol.envs.episode import EpisodeEnv, Reply
from swarmrl.protocol.envs.verifiers_adapter import VerifiersEnv


def _resolve(value: Any) -> Any:
    """The value of a sync or async call."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def is_multiturn(vf_env: Any) -> bool:
    """Whether a loaded verifiers environment plays several turns (it has `env_response`)."""
    return callable(getattr(vf_env, "env_response", None))


class VerifiersEpisodeEnv(VerifiersEnv, EpisodeEnv):
    """A loaded verifiers multi-turn environment behind swarmrl's `EpisodeEnv` interface."""

    def __init__(self, vf_env: Any, name: str, version: str) -> None:
        super().__init__(vf_env, name, version)
        self.vf_env = vf_env
        self.max_turns = int(getattr(vf_env, "max_turns", 10) or 10)
        self.deterministic = bool(getattr(vf_env, "deterministic", True))

    def _messages(self, spec: PromptSpec) -> list[dict[str, Any]]:
        return [{"role": r, "content": c} for r, c in spec.messages] or [{"role": "user", "content": spec.text}]

    def _completed(self, messages: list[dict[str, Any]], state: dict[str, Any]) -> bool:
        done = getattr(self.vf_env, "is_completed", None)
        return bool(_resolve(done(messages, state))) if callable(done) else False

    def reply(self, spec: PromptSpec, turns: Sequence[str]) -> Reply:
        """Replay the conversation: each model turn as an assistant message, then the
        environment's `env_response`, until the last turn; its response is the observation."""
        messages = self._messages(spec)
        state: dict[str, Any] = {"answer": spec.info.get("answer"), "info": dict(spec.info),
                                 "prompt": list(messages), "turn": 0}
        new: list[dict[str, Any]] = []
        for i, turn in enumerate(turns):
            messages.append({"role": "assistant", "content": turn})
            state["turn"] = i + 1
            if self._completed(messages, state) or i + 1 >= self.max_turns:
                return Reply("", done=True)
            new, state = _resolve(self.vf_env.env_response(messages, state))
            new = list(new or [])
            messages += new
        text = "".join(f"\n{m.get('content', '')}" for m in new)
        return Reply(text + "\n" if text else "", done=not text)
