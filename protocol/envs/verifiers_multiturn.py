"""Run a `verifiers` multi-turn environment (`vf.MultiTurnEnv`, more than one turn) as a swarmrl
`EpisodeEnv`.

Each reply is recomputed from scratch from the prompt's row and the model's turns by verifiers'
own rollout steps (`verifiers_replay.replay`: `init_state`, `setup_state`, the `@vf.stop`
conditions, `env_response`, `final_env_response`), so replies are a pure function of the turns as
long as the environment's are, and validators replay them. An environment that is not
deterministic sets `deterministic = False` on itself and its episodes are not replayed.
The environment's messages after a turn render as plain text: each message's content on its own
line, after a newline, ending with a newline. A `final_env_response` ends the episode without
being shown to the model (it is part of the scored completion, as in verifiers). The episode's
turn cap is the environment's `max_turns` (verifiers' -1, no cap, leaves the job's).

`swarmrl env check` plays a scripted episode: the environment's `scripted_turn(messages, state)`
if it has one (the conversation so far as verifiers messages, and the state), else the row's
reference answer every turn. `swarmrl eval` counts an episode solved when its total reward
reaches the environment's `pass_threshold` (verifiers' own notion of a passing rollout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from swarmrl.protocol.envs.base import PromptSpec
from swarmrl.protocol.envs.episode import EpisodeEnv, Reply
from swarmrl.protocol.envs.verifiers_adapter import VerifiersEnv
from swarmrl.protocol.envs.verifiers_replay import content_text, replay

NO_CAP = 64
"""The turn cap of an environment without one (verifiers' max_turns -1): `EpisodeSpec`'s ceiling."""


class VerifiersEpisodeEnv(VerifiersEnv, EpisodeEnv):
    """A loaded verifiers multi-turn environment behind swarmrl's `EpisodeEnv` interface."""

    def __init__(self, vf_env: Any, name: str, version: str) -> None:
        super().__init__(vf_env, name, version)
        cap = int(vf_env.max_turns)
        self.max_turns = cap if cap > 0 else NO_CAP
        self.deterministic = bool(getattr(vf_env, "deterministic", True))

    def reply(self, spec: PromptSpec, turns: Sequence[str]) -> Reply:
        """The environment's messages after the last turn, as text; done when it ended."""
        played = replay(self.vf_env, self.row(spec.info), turns)
        if played.done:
            return Reply("", done=True)
        text = "".join(f"\n{content_text(m.get('content'))}" for m in played.observation)
        return Reply(text + "\n" if text else "", done=not text)

    def scripted_turn(self, spec: PromptSpec, turns: Sequence[str]) -> str:
        """The environment's `scripted_turn(messages, state)`, else the reference answer."""
        script = getattr(self.vf_env, "scripted_turn", None)
        if not callable(script):
            return str(spec.info.get("answer", ""))
        played = replay(self.vf_env, self.row(spec.info), turns)
        state = played.state
        if state["trajectory"]:
            last = state["trajectory"][-1]
            messages = [*last["prompt"], *last["completion"], *played.observation]
        else:
            messages = list(state["prompt"])
        return str(script(messages, state))

    def solved(self, info: dict[str, Any], turns: Sequence[str]) -> bool:  # type: ignore[override]
        """Whether the episode's total reward reaches the environment's `pass_threshold`."""
        spec = PromptSpec(index=0, text="", info={**info, "turns": list(turns)})
        total = self.total(self.rewards([spec], [""])[0])
        return total is not None and total >= float(getattr(self.vf_env, "pass_threshold", 0.5))
