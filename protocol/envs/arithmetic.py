"""The built-in `arithmetic` environment (version 1): few-shot integer arithmetic.

Why this design (measured on google/gemma-3-270m base, see benchmarks/base_accuracy.py): a plain
"Question: What is 37+45?\\nAnswer:" prompt with two-digit operands taught a GRPO run nothing,
because the base model echoed the question, rarely got two-digit sums right, and so almost
every group of G completions had the same reward (zero advantage, zero gradient). Here:

- The prompt is a fixed few-shot block of equations followed by the question, e.g.
  "2+3 = 5\\n8*4 = 32\\n...\\n6+7 =": the base model answers " 13\\n" in that format instead of
  echoing, and the fixed prefix is shared by every prompt (prefix-cache friendly).
- Difficulty is a mixture of families (single-digit + - *, two-digit +- one-digit, two-digit *
  one-digit) chosen so the base model's per-prompt success probability spreads over (0, 1):
  that is what gives a group of G samples reward variance. Subtraction never goes negative
  (the base model almost never writes a minus sign there).
- The parser reads the first line only; it takes the integer after the last '=' on that line
  (so an echoed "6+7 = 13" still counts), else the first integer on the line.
- Rewards: `correctness_reward` (1.0 right, 0.0 wrong) weight 1.0, plus `format_reward`
  (1.0 when the first line parses to an integer) weight 0.1, a small nudge that keeps
  completions parseable without outweighing a single correct answer. Total in [0, 1.1].
- Sampling: stop at "\\n" and `max_new_tokens = 8` (the longest answer, " 171\\n", is 5 Gemma
  tokens; the base model's completions average ~3.8 tokens); temperature 1.0, no top-k/top-p.

Measured on the base model (held-out prompts, G=8, T=1.0): greedy accuracy 0.70 / 0.56,
sampled accuracy 0.53 / 0.43, groups with reward variance 0.80 / 0.68 (n=40 seed 0 / n=80
seed 1); parseable completions 98%. (The old format left 37 of 41 TRL steps without one such group.)

Held-out split: every problem (a, op, b) is assigned to train or held-out by a hash, so
held-out indices (>= HELDOUT_START) only ever show problems that training indices never show.
"""

from __future__ import annotations

import hashlib
import random
import re
from functools import lru_cache
from itertools import accumulate
from typing import Any

from swarmrl.protocol.envs.base import HELDOUT_START, Environment, PromptSpec, check_seed_index

# (a, op, b) shown as examples in every prompt; never asked.
FEW_SHOT: tuple[tuple[int, str, int], ...] = (
    (2, "+", 3),
    (8, "*", 4),
    (9, "-", 6),
    (7, "+", 5),
    (3, "*", 6),
)

# family name -> (weight, op, range of a, range of b); subtraction draws b from range_b capped at a.
# Weights favour the families where Gemma 270M's per-problem success probability is spread over
# (0, 1) (teacher-forced P(correct), all problems; E[groups of 8 with variance] in brackets):
# add_1x1 0.62 [0.71], sub_1x1 0.37 [0.76], add_2x1 0.30 [0.74], sub_2x1 0.19 [0.60],
# mul_1x1 0.86 [0.46], mul_2x1 0.34 [0.51].
FAMILIES: dict[str, tuple[float, str, range, range]] = {
    "add_1x1": (0.30, "+", range(1, 10), range(1, 10)),
    "sub_1x1": (0.25, "-", range(1, 10), range(10)),
    "add_2x1": (0.30, "+", range(10, 40), range(1, 10)),
    "sub_2x1": (0.05, "-", range(10, 40), range(1, 10)),
    "mul_1x1": (0.05, "*", range(2, 10), range(2, 10)),
    "mul_2x1": (0.05, "*", range(10, 20), range(2, 10)),
}

HELDOUT_FRACTION = 0.125
_MAX_DIGITS = 18
_INT = re.compile(r"-?\d+")


def apply_op(a: int, op: str, b: int) -> int:
    """a op b for op in "+-*".

    Raises:
        ValueError: unknown operator.
    """
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}")


_SHOTS = "".join(f"{x}{o}{y} = {apply_op(x, o, y)}\n" for x, o, y in FEW_SHOT)   # the few-shot block
_NAMES = tuple(FAMILIES)
_CUM_WEIGHTS = tuple(accumulate(FAMILIES[n][0] for n in _NAMES))   # what choices(names, weights) sums per call


def format_prompt(a: int, op: str, b: int) -> str:
    """The prompt text: the few-shot block, then "a op b =" (the completion starts after '=')."""
    return f"{_SHOTS}{a}{op}{b} ="


@lru_cache(maxsize=4096)   # a pure function of a few hundred problems, asked at every prompt
def is_heldout_problem(a: int, op: str, b: int) -> bool:
    """Whether a problem belongs to the held-out split (a fixed hash of "a op b")."""
    digest = hashlib.sha256(f"arithmetic-v1:{a}{op}{b}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < HELDOUT_FRACTION * 2**64


def parse_answer(completion: str) -> int | None:
    """The integer a completion answers, or None.

    Reads the first line only: the integer after the last '=' on it if there is one (an echoed
    "3+4 = 7" gives 7), else the first integer on it (" 7" gives 7, " -3" gives -3). Integers of
    more than 18 digits give None.
    """
    line = completion.split("\n", 1)[0]
    if "=" in line:
        found = _INT.search(line.rsplit("=", 1)[1])
    else:
        found = _INT.search(line)
    if found is None or len(found.group().lstrip("-")) > _MAX_DIGITS:
        return None
    return int(found.group())


def correctness_reward(
    prompts: list[str], completions: list[str], answer: list[int], **kwargs: Any
) -> list[float | None]:
    """1.0 when `parse_answer(completion) == answer`, else 0.0 (TRL reward-function signature).

    Raises:
        ValueError: `prompts`, `completions` and `answer` differ in length.
    """
    _check_lengths(prompts, completions, answer)
    return [1.0 if parse_answer(c) == int(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def format_reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's first line parses to an integer, else 0.0 (TRL signature).

    Raises:
        ValueError: `prompts` and `completions` differ in length.
    """
    _check_lengths(prompts, completions)
    return [0.0 if parse_answer(c) is None else 1.0 for c in completions]


def _check_lengths(*columns: list[Any]) -> None:
    lengths = {len(column) for column in columns}
    if len(lengths) > 1:
        raise ValueError(f"reward columns differ in length: {[len(c) for c in columns]}")


class ArithmeticEnv(Environment):
    """Few-shot integer arithmetic; see the module docstring for the design and its reasons."""

    name = "arithmetic"
    version = "1"
    reward_funcs = (correctness_reward, format_reward)
    reward_weights = (1.0, 0.1)
    reward_range = (0.0, 1.1)
    regrade_tolerance = 1e-6
    stop = ("\n",)
    max_new_tokens = 8

    def prompt(self, seed: int, index: int) -> PromptSpec:
        """The problem at (seed, index): a family by weight, then operands, both from
        `random.Random(f"arithmetic-v1:{seed}:{index}")`, redrawn until the problem is in the
        index's split and is not a few-shot example.

        Raises:
            ValueError: negative seed or index outside [0, 2**63).
        """
        check_seed_index(seed, index)
        rng = random.Random(f"arithmetic-v1:{seed}:{index}")
        heldout = index >= HELDOUT_START
        while True:  # terminates: every family has problems in both splits (checked in tests)
            family = rng.choices(_NAMES, cum_weights=_CUM_WEIGHTS)[0]
            _, op, range_a, range_b = FAMILIES[family]
            a = rng.choice(range_a)
            b = rng.choice(range_b if op != "-" else range(range_b.start, min(range_b.stop, a + 1)))
            if (a, op, b) in FEW_SHOT or is_heldout_problem(a, op, b) != heldout:
                continue
            info = {"answer": apply_op(a, op, b), "family": family}
            return PromptSpec(index=index, text=format_prompt(a, op, b), info=info)
