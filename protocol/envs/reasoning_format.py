"""The reasoning format of long-completion jobs: a thinking span, then an answer tag. Pure stdlib.

Two formats (a job's `[environment] reasoning_format`):
- ``think_answer`` (default): the prompt ends with ``<think>`` (the start of the model's reply,
  written by the prompt, so the model begins inside its thinking span); a completion is
  ``THINKING</think>`` then ``<answer>ANSWER</answer>``, whitespace around them allowed, nothing
  after. DeepSeek-R1's format reward (``^<think>.*?</think>\\s*<answer>.*?</answer>$``, Guo et al.
  2025) with the opening tag moved into the prompt, as TinyZero and open-r1 do.
- ``answer``: free reasoning text, then ``<answer>ANSWER</answer>``, nothing after.

**What a truncated completion earns (the decision).** A completion cut by the length limit
(`max_new_tokens`) before it closed its answer tag is *incomplete*: it earns 0 from every reward
of the format, the same as a completion with no answer, so it can never earn full reward for a
fragment that looks right (``...</think><answer>4`` cut before ``2</answer>``, or an answer that
appears inside the thinking). The rule reads the text only, so workers and validators apply it
identically without trusting a claimed finish reason: the answer is read only from a closed
``<answer>...</answer>`` that ends the completion, and jobs stop sampling at ``</answer>``, so a
completion with a closed answer tag is one the model finished. A completion that closed its tag on
exactly its last allowed token is complete (nothing was cut). Text after the closing tag (a model
that goes on writing) makes the completion not in the format: 0 as well. Completions that finished
in the format but answered wrong earn the format reward alone (0.1 of the 1.1 total in
reasoning-gym jobs), so any finished attempt outscores a truncated one. The loss may, in addition,
leave truncated completions out of the gradient (`loss.mask_truncated`, DAPO's overlong filter).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

ReasoningFormat = Literal["think_answer", "answer"]
FORMATS: tuple[str, ...] = ("think_answer", "answer")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
STOP: tuple[str, ...] = (ANSWER_CLOSE,)
"""The stop strings of a reasoning job: sampling ends at the closing answer tag (kept in the text)."""

_TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
_THINK_ANSWER = re.compile(r"\s*(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)
_ANSWER = re.compile(r"(?P<think>.*?)<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)


@dataclass(frozen=True)
class ReasoningParse:
    """A completion read in a reasoning format.

    complete: the completion is in the format, its answer tag closed and nothing after it.
    answer: the stripped text inside the answer tag (None unless complete).
    thinking: the thinking span's text ("" unless complete).
    """

    complete: bool
    answer: str | None
    thinking: str = ""


INCOMPLETE = ReasoningParse(complete=False, answer=None)


def response_prefix(fmt: str) -> str:
    """What the prompt writes at the start of the model's reply: ``<think>`` for think_answer."""
    _check_format(fmt)
    return THINK_OPEN if fmt == "think_answer" else ""


def parse_reasoning(completion: str, fmt: str) -> ReasoningParse:
    """Read `completion` (the text after the prompt) in format `fmt` (see the module docstring).

    The thinking span may hold no tag of the format (a second ``<think>`` or an ``<answer>`` inside
    it) and the answer none either, so the answer read is the one the completion ends with.

    Raises:
        ValueError: an unknown format.
    """
    _check_format(fmt)
    pattern = _THINK_ANSWER if fmt == "think_answer" else _ANSWER
    found = pattern.fullmatch(completion)
    if found is None:
        return INCOMPLETE
    think, answer = found.group("think"), found.group("answer")
    if any(tag in think or tag in answer for tag in _TAGS):
        return INCOMPLETE
    return ReasoningParse(complete=True, answer=answer.strip(), thinking=think.strip())


def format_instructions(fmt: str) -> str:
    """The system prompt's sentence that asks for format `fmt`."""
    _check_format(fmt)
    if fmt == "think_answer":
        return ("Think step by step inside <think> </think> tags, then give only the final answer inside "
                "<answer> </answer> tags, e.g. <think> reasoning here </think> <answer> answer here </answer>.")
    return ("Think step by step, then give only the final answer inside <answer> </answer> tags, "
            "e.g. reasoning here <answer> answer here </answer>.")


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown reasoning format {fmt!r}; known: {', '.join(FORMATS)}")
