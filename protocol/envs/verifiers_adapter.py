"""Run an environment written for `verifiers` as a swarmrl `Environment` (multi-turn ones, with
`env_response`, as an `EpisodeEnv`: `verifiers_multiturn.py`).

Written against verifiers' documented interface, duck-typed (the `verifiers` package is not
installed here: a dry run showed it would install ~45 packages into the shared environment,
without changing our pins): a module whose `load_environment(**kwargs)` returns an environment
with
- `dataset`: rows with a `question` (or `prompt`, a list of chat messages) and an `answer`
  column (a list of dicts, or anything with `__len__` and `__getitem__` giving dicts, as a
  `datasets.Dataset` does); optional `eval_dataset` for the held-out split;
- `system_prompt` (optional) and `few_shot` (optional list of chat messages);
- `rubric` with `funcs` (or `reward_funcs`) and `weights` (or `reward_weights`): reward functions
  called as `f(completion=..., answer=..., prompt=..., parser=..., **kwargs)` returning a float
  (verifiers' keyword-argument convention); `parser` (optional) is passed to them.

Indices map to rows as in data-set tasks: train index i -> dataset row i mod n; held-out index
HELDOUT_START + k -> eval_dataset row k (or, without one, a hash split of `dataset`).
The adapted reward functions are TRL-style batch functions, so the grading pool runs them in its
sandboxed subprocess exactly as any installed environment's. The environment's `name`/`version`
come from the module (`__name__`, `__version__` or "0").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from swarmrl.protocol.envs.base import HELDOUT_START, Environment, PromptSpec, check_seed_index


class VerifiersReward:
    """One verifiers reward function as a TRL-style batch function (picklable if the function is)."""

    def __init__(self, func: Any, parser: Any = None) -> None:
        self.func, self.parser = func, parser
        self.__name__ = getattr(func, "__name__", "reward")

    def __call__(self, prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None,
                 **kwargs: Any) -> list[float | None]:
        """One reward per completion (None: unscored); `answer` holds the reference answers."""
        answers = list(answer) if answer is not None else [None] * len(completions)
        out: list[float | None] = []
        for prompt, completion, gold in zip(prompts, completions, answers, strict=True):
            value = self.func(completion=completion, answer=gold, prompt=prompt, parser=self.parser)
            out.append(None if value is None else float(value))
        return out


def _rows(dataset: Any) -> list[dict[str, Any]]:
    if dataset is None:
        return []
    return [dict(dataset[i]) for i in range(len(dataset))]


def _question(row: dict[str, Any]) -> str:
    if "question" in row:
        return str(row["question"])
    prompt = row.get("prompt")
    if isinstance(prompt, list):   # chat messages: the last user turn
        users = [m["content"] for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return str(users[-1])
    raise ValueError(f"verifiers row has neither 'question' nor a chat 'prompt': keys {sorted(row)}")


class VerifiersEnv(Environment):
    """A loaded verifiers environment behind swarmrl's `Environment` interface."""

    regrade_tolerance = 1e-6
    stop: tuple[str, ...] = ()
    max_new_tokens = 256

    def __init__(self, vf_env: Any, name: str, version: str) -> None:
        self.name, self.version = name, version
        self.system_prompt = str(getattr(vf_env, "system_prompt", "") or "")
        self.few_shot = [(m["role"], m["content"]) for m in (getattr(vf_env, "few_shot", None) or [])]
        rubric = getattr(vf_env, "rubric", None)
        funcs = getattr(rubric, "funcs", None) or getattr(rubric, "reward_funcs", None) or []
        weights = getattr(rubric, "weights", None) or getattr(rubric, "reward_weights", None) or [1.0] * len(funcs)
        if not funcs:
            raise ValueError(f"verifiers environment {name!r} has no rubric reward functions")
        parser = getattr(vf_env, "parser", None) or getattr(rubric, "parser", None)
        self.reward_funcs = tuple(VerifiersReward(f, parser) for f in funcs)
        self.reward_weights = tuple(float(w) for w in weights)
        low = sum(min(0.0, w) for w in self.reward_weights)
        self.reward_range = (low - 1e6, sum(max(0.0, w) for w in self.reward_weights) + 1e6)   # unbounded rubric values
        train = _rows(getattr(vf_env, "dataset", None))
        held = _rows(getattr(vf_env, "eval_dataset", None))
        if not held:
            held = [r for r in train if _held(r)]
            train = [r for r in train if not _held(r)]
        if not train or not held:
            raise ValueError(f"verifiers environment {name!r}: empty train or held-out rows")
        self.train_rows, self.heldout_rows = train, held

    def prompt(self, seed: int, index: int) -> PromptSpec:
        """Row `index` of its split (verifiers data sets are fixed; the seed does not reorder them)."""
        check_seed_index(seed, index)
        rows = self.heldout_rows if index >= HELDOUT_START else self.train_rows
        row = rows[(index - HELDOUT_START if index >= HELDOUT_START else index) % len(rows)]
        question = _question(row)
        turns = ([("system", self.system_prompt)] if self.system_prompt else []) + self.few_shot + [("user", question)]
        text = (f"{self.system_prompt}\n\n" if self.system_prompt else "") + question
        return PromptSpec(index=index, text=text, info={"answer": row.get("answer")}, messages=tuple(turns))


def _held(row: dict[str, Any]) -> bool:
    return hashlib.sha256(_question(row).encode()).digest()[0] < 26   # ~10%


def adapt_verifiers(module: Any, **kwargs: Any) -> VerifiersEnv:
    """`module.load_environment(**kwargs)` adapted (raises ValueError if it is not verifiers-shaped)."""
    load = getattr(module, "load_environment", None)
    if load is None:
        raise ValueError(f"{getattr(module, '__name__', module)!r} is neither an Environment nor has load_environment()")
    name = str(getattr(module, "__name__", "verifiers")).rsplit(".", 1)[-1]
    vf_env, version = load(**kwargs), str(getattr(module, "__version__", "0"))
    from swarmrl.protocol.envs.verifiers_multiturn import VerifiersEpisodeEnv, is_multiturn

    if is_multiturn(vf_env):   # MultiTurnEnv-shaped: plays episodes
        return VerifiersEpisodeEnv(vf_env, name, version)
    return VerifiersEnv(vf_env, name, version)
