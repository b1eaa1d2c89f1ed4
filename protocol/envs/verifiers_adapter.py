"""Run an environment written for `verifiers` as a swarmrl `Environment` (multi-turn ones as an
`EpisodeEnv`: `verifiers_multiturn.py`; `verifiers_load.adapt_verifiers` picks which).

Written against verifiers' classic API (verifiers 0.3.1, the `swarmrl[verifiers]` extra; from
0.3.1 on it lives in `verifiers.legacy`, still answering as `import verifiers as vf`): a module
whose `load_environment(**kwargs)` returns a `vf.MultiTurnEnv` (`vf.SingleTurnEnv` is its one-turn
case) with
- `dataset` (and optionally `eval_dataset`, the held-out split), formatted by verifiers: each row
  has `prompt` (chat messages, the system prompt and few-shot turns included) and `answer`;
- `rubric`: a `vf.Rubric` (or a `vf.RubricGroup`: a multi-turn environment always has one, with
  verifiers' `num_turns` metric at weight 0) of weighted reward functions.
verifiers' v1 environments (`verifiers.v1`, the only API of verifiers 0.4) are refused: they run
agent harnesses against a model API, with no turn-by-turn hook for a model that is not behind one.

Each row is one prompt: its chat messages, and as text their contents joined by blank lines.
Indices map to rows as in data-set tasks: train index i -> dataset row i mod n; held-out index
HELDOUT_START + k -> eval_dataset row k (or, without one, a hash split of `dataset`). A prompt's
`info` holds the row's `answer` and its place (`vf_split`, `vf_row`), so a grader rebuilds the
row. Reward functions get what verifiers gives them: the episode replayed from the model's turns
(`verifiers_replay`), `completion` as verifiers messages, `state`, `answer`, `parser`, ... Each
becomes a TRL-style batch function (`VerifiersReward`), so the grading pool runs it in its
sandboxed subprocess as any installed environment's. The environment's `name`/`version` come
from the module (`__name__`, `__version__` or "0"); sampling `stop` and `max_tokens` from the
environment's `sampling_args` when it sets them.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from swarmrl.protocol.envs.base import HELDOUT_START, Environment, PromptSpec, check_seed_index
from swarmrl.protocol.envs.verifiers_replay import (
    call_group_reward,
    call_reward,
    content_text,
    finished,
)

STATE_CACHE = 256
"""Scored states kept per environment: the F reward functions of one batch share them."""


class VerifiersReward:
    """One verifiers reward function (with its weight's rubric) as a TRL-style batch function.

    Called with `prompts`, `completions` and the columns `vf_split`, `vf_row` (the row), `turns`
    (the model's turns; absent for single-turn environments: the completion is the one turn)
    and, for group-level functions, `group` (rows sharing it are scored together, as verifiers'
    `score_group` does). Returns one float per completion.
    """

    def __init__(self, env: VerifiersEnv, func: Any, rubric: Any) -> None:
        self.env, self.func, self.rubric = env, func, rubric
        self.__name__ = str(getattr(func, "__name__", "reward"))
        self.group = bool(rubric._is_group_func(func))

    def __call__(self, prompts: list[str], completions: list[str], vf_split: Sequence[str] | None = None,
                 vf_row: Sequence[int] | None = None, turns: Sequence[Sequence[str]] | None = None,
                 group: Sequence[Any] | None = None, **kwargs: Any) -> list[float | None]:
        """One reward per completion.

        Raises:
            ValueError: the `vf_split`/`vf_row` columns are missing.
        """
        if vf_split is None or vf_row is None:
            raise ValueError("verifiers rewards need the vf_split and vf_row columns of the prompt's info")
        episodes = [list(t) for t in turns] if turns is not None else [[c] for c in completions]
        states = [self.env.scored_state(s, r, t) for s, r, t in zip(vf_split, vf_row, episodes, strict=True)]
        if not self.group:
            return [float(call_reward(self.rubric, self.func, s)) for s in states]
        out: list[float | None] = [None] * len(states)
        ids = list(group) if group is not None else [0] * len(states)
        for g in dict.fromkeys(ids):
            rows = [i for i, x in enumerate(ids) if x == g]
            values = list(call_group_reward(self.rubric, self.func, [states[i] for i in rows]))
            if len(values) != len(rows):
                raise ValueError(f"{self.__name__} returned {len(values)} values for a group of {len(rows)}")
            for i, v in zip(rows, values, strict=True):
                out[i] = float(v)
        return out


def _leaf_rubrics(rubric: Any) -> Iterator[Any]:
    """The plain rubrics of a rubric (a `RubricGroup`'s members, recursively)."""
    if hasattr(rubric, "rubrics"):
        for member in rubric.rubrics:
            yield from _leaf_rubrics(member)
    else:
        yield rubric


def _rows(dataset: Any) -> list[dict[str, Any]]:
    return [] if dataset is None else [dict(row) for row in dataset.to_list()]


def _messages(row: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"verifiers row has no chat 'prompt' (keys {sorted(row)})")
    return tuple((str(m["role"]), content_text(m.get("content"))) for m in prompt)


def _held(row: dict[str, Any]) -> bool:
    text = "\n\n".join(c for _, c in _messages(row))
    return hashlib.sha256(text.encode()).digest()[0] < 26   # ~10%


class VerifiersEnv(Environment):
    """A loaded verifiers environment behind swarmrl's `Environment` interface (one turn)."""

    regrade_tolerance = 1e-6
    stop: tuple[str, ...] = ()
    max_new_tokens = 256

    def __init__(self, vf_env: Any, name: str, version: str) -> None:
        self.name, self.version, self.vf_env = name, version, vf_env
        funcs: list[VerifiersReward] = []
        weights: list[float] = []
        for rubric in _leaf_rubrics(vf_env.rubric):
            funcs += [VerifiersReward(self, f, rubric) for f in rubric.funcs]
            weights += [float(w) for w in rubric.weights]
        if not funcs:
            raise ValueError(f"verifiers environment {name!r} has no rubric reward functions")
        self.reward_funcs, self.reward_weights = tuple(funcs), tuple(weights)
        self.group_rewards = any(f.group for f in funcs)
        low = sum(min(0.0, w) for w in weights)
        self.reward_range = (low - 1e6, sum(max(0.0, w) for w in weights) + 1e6)   # unbounded rubric values
        sampling = dict(getattr(vf_env, "sampling_args", None) or {})
        if sampling.get("stop"):
            stop = sampling["stop"]
            self.stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if sampling.get("max_tokens"):
            self.max_new_tokens = int(sampling["max_tokens"])
        vf_env.build_dataset()
        vf_env.build_eval_dataset()
        train, held = _rows(vf_env.dataset), _rows(vf_env.eval_dataset)
        if not held:
            held = [r for r in train if _held(r)]
            train = [r for r in train if not _held(r)]
        if not train or not held:
            raise ValueError(f"verifiers environment {name!r}: empty train or held-out rows")
        self.rows = {"train": train, "eval": held}
        self._states: OrderedDict[tuple[str, int, tuple[str, ...]], Any] = OrderedDict()
        self._lock = threading.Lock()

    def prompt(self, seed: int, index: int) -> PromptSpec:
        """Row `index` of its split (verifiers data sets are fixed; the seed does not reorder them)."""
        check_seed_index(seed, index)
        split = "eval" if index >= HELDOUT_START else "train"
        rows = self.rows[split]
        k = (index - HELDOUT_START if index >= HELDOUT_START else index) % len(rows)
        messages = _messages(rows[k])
        return PromptSpec(index=index, text="\n\n".join(c for _, c in messages),
                          info={"answer": rows[k].get("answer", ""), "vf_split": split, "vf_row": k},
                          messages=messages)

    def row(self, info: dict[str, Any]) -> dict[str, Any]:
        """The dataset row a prompt's `info` names."""
        return self.rows[str(info["vf_split"])][int(info["vf_row"])]

    def scored_state(self, split: str, row: int, turns: Sequence[str]) -> Any:
        """The verifiers state of the episode with these model turns, as verifiers scores it
        (`verifiers_replay.finished`); the last `STATE_CACHE` are kept, so the reward functions
        of one batch replay each episode once."""
        key = (str(split), int(row), tuple(turns))
        with self._lock:
            if key in self._states:
                return self._states[key]
        state = finished(self.vf_env, self.rows[key[0]][key[1]], key[2])
        with self._lock:
            self._states[key] = state
            while len(self._states) > STATE_CACHE:
                self._states.popitem(last=False)
        return state
