# Legend: T = tokens of an episode after its first observation (model and environment tokens).
"""Token-exact episode traces: what the model saw and produced, and which tokens were whose.

A multi-turn episode travels as one `Completion` after its first observation (the group's
shared prompt): `token_ids_T` are the ids exactly as the model read and produced them, model
turns and environment replies interleaved; `mask_T` is 1 on tokens the model sampled and 0 on
tokens the environment wrote; `logprobs_T` holds the sampling log-prob of every model token and
exactly 0.0 on environment tokens (they were not sampled). Nothing downstream re-tokenizes text:
a tokenizer that merges across a turn boundary would otherwise change what is trained
(tests/unit/test_trace.py shows such a case).

A single-turn completion has an empty mask (every token is the model's) and `turns` 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

MODEL = 1
ENV = 0

# Admission reasons of traces (swarmrl.protocol.admission reports them like its own).
MASK_LENGTH = "mask_length"          # mask and token ids differ in length
MASK_VALUE = "mask_value"            # a mask entry other than 0 or 1
TRACE_START = "trace_start"          # the first token after the observation is not the model's
TURN_COUNT = "turn_count"            # `turns` differs from the model turns the mask shows
TOO_MANY_TURNS = "too_many_turns"    # more turns than the job's episode.max_turns
ENV_LOGPROB = "env_logprob"          # an environment token carries a log-prob (only model tokens are sampled)
UNEXPECTED_TRACE = "unexpected_trace"  # a mask or turns on a single-turn job's completion
MISSING_TRACE = "missing_trace"      # a multi-turn job's completion without its mask
TRACE_REASONS = (MASK_LENGTH, MASK_VALUE, TRACE_START, TURN_COUNT, TOO_MANY_TURNS, ENV_LOGPROB,
                 UNEXPECTED_TRACE, MISSING_TRACE)


@dataclass
class Trace:
    """One episode after its first observation (see the module docstring).

    finish_reason: "stop" when the environment ended the episode, "length" when a limit did.
    turn_texts: the model's turns as decoded text (for grading; not sent on the wire).
    observations: the environment's replies as text (for display; not sent).
    """

    token_ids_T: list[int] = field(default_factory=list)
    mask_T: list[int] = field(default_factory=list)
    logprobs_T: list[float] = field(default_factory=list)
    turns: int = 0
    finish_reason: str = "stop"
    turn_texts: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)

    def add_model(self, ids: Sequence[int], logprobs: Sequence[float], text: str) -> None:
        """Append one model turn: its sampled ids and their sampling log-probs."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} ids but {len(logprobs)} log-probs")
        self.token_ids_T += list(ids)
        self.mask_T += [MODEL] * len(ids)
        self.logprobs_T += [float(x) for x in logprobs]
        self.turns += 1
        self.turn_texts.append(text)

    def add_env(self, ids: Sequence[int], text: str) -> None:
        """Append one environment reply (its ids as the environment's tokenizer wrote them)."""
        self.token_ids_T += list(ids)
        self.mask_T += [ENV] * len(ids)
        self.logprobs_T += [0.0] * len(ids)
        self.observations.append(text)


def spans(mask_T: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal mask values: (value, lo, hi) with hi exclusive, in order."""
    out: list[tuple[int, int, int]] = []
    for t, m in enumerate(mask_T):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1], t + 1)
        else:
            out.append((int(m), t, t + 1))
    return out


def model_spans(mask_T: Sequence[int]) -> list[tuple[int, int]]:
    """(lo, hi) of each model turn's tokens."""
    return [(lo, hi) for m, lo, hi in spans(mask_T) if m == MODEL]


def split_turns(token_ids_T: Sequence[int], mask_T: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    """(model turns' ids, environment replies' ids), each in order.

    Raises:
        ValueError: mask and ids differ in length.
    """
    if len(token_ids_T) != len(mask_T):
        raise ValueError(f"{len(token_ids_T)} ids but {len(mask_T)} mask entries")
    model: list[list[int]] = []
    env: list[list[int]] = []
    for m, lo, hi in spans(mask_T):
        (model if m == MODEL else env).append(list(token_ids_T[lo:hi]))
    return model, env


def check_trace(token_ids_T: Sequence[int], mask_T: Sequence[int], logprobs_T: Sequence[float], turns: int,
                *, max_turns: int) -> str:
    """The shape checks of one completion's trace; returns a reason (`TRACE_REASONS`) or "".

    max_turns: the job's episode.max_turns, or 0 for a single-turn job (no mask and no turns
    allowed). Log-probs of model tokens are checked elsewhere (finite, <= 0); here, environment
    tokens must carry exactly 0.0 (the sampler never scored them).
    """
    if max_turns == 0:
        return UNEXPECTED_TRACE if (len(mask_T) or turns) else ""
    if not mask_T:
        return MISSING_TRACE
    if len(mask_T) != len(token_ids_T) or len(logprobs_T) != len(token_ids_T):
        return MASK_LENGTH
    if any(m not in (MODEL, ENV) for m in mask_T):
        return MASK_VALUE
    if mask_T[0] != MODEL:
        return TRACE_START
    if turns != len(model_spans(mask_T)):
        return TURN_COUNT
    if turns > max_turns:
        return TOO_MANY_TURNS
    if any(m == ENV and not (math.isfinite(lp) and lp == 0.0) for m, lp in zip(mask_T, logprobs_T, strict=True)):
        return ENV_LOGPROB
    return ""


def model_positions(mask_T: Sequence[int], n: int) -> list[bool]:
    """Per token, whether it is the model's: the mask as booleans, or all True when it is empty
    (a single-turn completion of `n` tokens)."""
    return [True] * n if not mask_T else [m == MODEL for m in mask_T]
