"""Built-in reward functions for data-set tasks: named, parameterised, no submitter code.

A data-set job names its rewards as `{name, weight, **params}` (see `RewardSpec` in
`protocol.envs.dataset`); `build_reward` checks the parameters once (unknown name, unknown or
bad parameter, a regex that does not compile, a JSON schema that is not one) and returns a
`BoundReward`: a picklable callable with TRL's signature
`f(prompts, completions, answer=None, **kwargs) -> list[float | None]`, named after the reward
(the grading pool reports failures by that name).

| name | params | value per completion |
|---|---|---|
| `math_verify` | - | 1.0 when `math_verify.verify(parse(answer), parse(completion))`, else 0.0 |
| `exact_match` | lowercase, strip_punctuation, collapse_whitespace (all true), first_line (false) | 1.0 when normalised texts are equal |
| `numeric` | tolerance (0.0, absolute), rel_tolerance (0.0), pick ("last" or "first") | 1.0 when the picked number is within tolerance of the answer |
| `regex_format` | pattern (required), fullmatch (false), ignore_case (false) | 1.0 when the pattern matches (`re.search`, or `re.fullmatch`) |
| `json_schema` | schema (required, a JSON-schema object) | 1.0 when the completion (code fences stripped) is JSON valid under the schema |
| `length_penalty` | max_chars (required, >= 1) | 0.0 up to max_chars, then -(len - max_chars) / max_chars, floored at -1.0 |
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)
_PUNCT = str.maketrans("", "", string.punctuation)


class RewardConfigError(ValueError):
    """A reward named in a job is unknown or has bad parameters."""


@dataclass(frozen=True)
class RewardKind:
    """One built-in reward: its function, its parameters (name -> default; `...` = required),
    its per-completion value range, a one-line description."""

    func: Callable[..., list[float | None]]
    params: dict[str, Any]
    value_range: tuple[float, float]
    description: str
    check: Callable[[dict[str, Any]], None] = lambda p: None


@dataclass(frozen=True)
class BoundReward:
    """A built-in reward with its parameters bound (picklable; `__name__` is the reward's name)."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def __name__(self) -> str:  # the grading pool names failures after it
        return self.name

    def __call__(self, prompts: list[str], completions: list[str], **kwargs: Any) -> list[float | None]:
        """One reward per completion (None: unscored), with this reward's parameters applied."""
        return REWARDS[self.name].func(prompts, completions, **kwargs, **self.params)


def _answers(completions: Sequence[str], answer: Sequence[Any] | None) -> list[str]:
    if answer is None:
        raise ValueError("this reward needs the data set's answer column")
    if len(answer) != len(completions):
        raise ValueError(f"{len(answer)} answers for {len(completions)} completions")
    return [str(a) for a in answer]


def math_verify_reward(prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None,
                       **kwargs: Any) -> list[float | None]:
    """1.0 when math-verify judges the completion's final answer equal to the reference, else 0.0."""
    import logging
    import threading

    from math_verify import parse, verify

    # math-verify times out with SIGALRM, which only the main thread may use (the grading pool's
    # subprocess calls from its main thread; the pool's own timeout bounds every call anyway).
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    out: list[float | None] = []
    for completion, gold in zip(completions, _answers(completions, answer), strict=True):
        gold_parsed = parse(gold, parsing_timeout=timeout) or parse(f"${gold}$", parsing_timeout=timeout)
        pred = parse(completion, parsing_timeout=timeout)
        out.append(1.0 if gold_parsed and pred and verify(gold_parsed, pred, timeout_seconds=timeout) else 0.0)
    return out


def normalize_text(text: str, *, lowercase: bool = True, strip_punctuation: bool = True,
                   collapse_whitespace: bool = True, first_line: bool = False) -> str:
    """The text `exact_match` compares: first line only (optional), lowercased, punctuation
    removed, runs of whitespace collapsed, stripped."""
    if first_line:
        text = text.strip().split("\n", 1)[0]
    if lowercase:
        text = text.lower()
    if strip_punctuation:
        text = text.translate(_PUNCT)
    if collapse_whitespace:
        text = " ".join(text.split())
    return text.strip()


def exact_match_reward(prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None,
                       lowercase: bool = True, strip_punctuation: bool = True, collapse_whitespace: bool = True,
                       first_line: bool = False, **kwargs: Any) -> list[float | None]:
    """1.0 when the normalised completion equals the normalised answer (see `normalize_text`)."""
    opts = {"lowercase": lowercase, "strip_punctuation": strip_punctuation,
            "collapse_whitespace": collapse_whitespace}
    return [1.0 if normalize_text(c, first_line=first_line, **opts) == normalize_text(a, **opts) else 0.0
            for c, a in zip(completions, _answers(completions, answer), strict=True)]


def parse_number(text: str, pick: str = "last") -> float | None:
    """The first or last number written in `text` ("1,234.5" -> 1234.5), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float((found[-1] if pick == "last" else found[0]).replace(",", ""))
    except ValueError:
        return None


def numeric_reward(prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None,
                   tolerance: float = 0.0, rel_tolerance: float = 0.0, pick: str = "last",
                   **kwargs: Any) -> list[float | None]:
    """1.0 when |x - answer| <= tolerance + rel_tolerance * |answer| for the picked number x of
    the completion; 0.0 otherwise (no number, or an answer that is not a number)."""
    out: list[float | None] = []
    for completion, gold in zip(completions, _answers(completions, answer), strict=True):
        want, got = parse_number(gold, "last"), parse_number(completion, pick)
        ok = want is not None and got is not None and abs(got - want) <= tolerance + rel_tolerance * abs(want)
        out.append(1.0 if ok else 0.0)
    return out


def regex_format_reward(prompts: list[str], completions: list[str], pattern: str = "", fullmatch: bool = False,
                        ignore_case: bool = False, **kwargs: Any) -> list[float | None]:
    """1.0 when `pattern` matches the completion (`re.search`, or `re.fullmatch`), else 0.0."""
    rx = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
    match = rx.fullmatch if fullmatch else rx.search
    return [1.0 if match(c) else 0.0 for c in completions]


def json_schema_reward(prompts: list[str], completions: list[str], schema: dict[str, Any] | None = None,
                       **kwargs: Any) -> list[float | None]:
    """1.0 when the completion (``` fences stripped) parses as JSON valid under `schema`, else 0.0."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema or {})
    out: list[float | None] = []
    for completion in completions:
        fenced = _FENCE.match(completion)
        try:
            value = json.loads(fenced.group(1) if fenced else completion)
        except ValueError:
            out.append(0.0)
            continue
        out.append(1.0 if validator.is_valid(value) else 0.0)
    return out


def length_penalty_reward(prompts: list[str], completions: list[str], max_chars: int = 1,
                          **kwargs: Any) -> list[float | None]:
    """0.0 up to `max_chars` characters, then -(len - max_chars) / max_chars, floored at -1.0."""
    return [-min(1.0, max(0, len(c) - max_chars) / max_chars) for c in completions]


def _check_regex(p: dict[str, Any]) -> None:
    if not isinstance(p["pattern"], str) or not p["pattern"]:
        raise RewardConfigError("regex_format: pattern must be a non-empty string")
    try:
        re.compile(p["pattern"])
    except re.error as exc:
        raise RewardConfigError(f"regex_format: bad pattern {p['pattern']!r}: {exc}") from None


def _check_schema(p: dict[str, Any]) -> None:
    import jsonschema

    if not isinstance(p["schema"], dict):
        raise RewardConfigError("json_schema: schema must be a table (a JSON-schema object)")
    try:
        jsonschema.Draft202012Validator.check_schema(p["schema"])
    except jsonschema.SchemaError as exc:
        raise RewardConfigError(f"json_schema: bad schema: {exc.message}") from None


def _check_numeric(p: dict[str, Any]) -> None:
    if p["pick"] not in ("first", "last"):
        raise RewardConfigError(f"numeric: pick must be 'first' or 'last', got {p['pick']!r}")
    for key in ("tolerance", "rel_tolerance"):
        if not isinstance(p[key], (int, float)) or p[key] < 0:
            raise RewardConfigError(f"numeric: {key} must be a number >= 0, got {p[key]!r}")


def _check_length(p: dict[str, Any]) -> None:
    if not isinstance(p["max_chars"], int) or p["max_chars"] < 1:
        raise RewardConfigError(f"length_penalty: max_chars must be an integer >= 1, got {p['max_chars']!r}")


REWARDS: dict[str, RewardKind] = {
    "math_verify": RewardKind(math_verify_reward, {}, (0.0, 1.0), "math-verify: final answer equals the reference"),
    "exact_match": RewardKind(exact_match_reward, {"lowercase": True, "strip_punctuation": True,
                                                   "collapse_whitespace": True, "first_line": False},
                              (0.0, 1.0), "normalised text equals the reference"),
    "numeric": RewardKind(numeric_reward, {"tolerance": 0.0, "rel_tolerance": 0.0, "pick": "last"}, (0.0, 1.0),
                          "a number within tolerance of the reference", _check_numeric),
    "regex_format": RewardKind(regex_format_reward, {"pattern": ..., "fullmatch": False, "ignore_case": False},
                               (0.0, 1.0), "the completion matches a regular expression", _check_regex),
    "json_schema": RewardKind(json_schema_reward, {"schema": ...}, (0.0, 1.0),
                              "the completion is JSON valid under a schema", _check_schema),
    "length_penalty": RewardKind(length_penalty_reward, {"max_chars": ...}, (-1.0, 0.0),
                                 "penalty for characters past max_chars", _check_length),
}


def build_reward(name: str, params: dict[str, Any]) -> BoundReward:
    """A checked, bound built-in reward.

    Raises:
        RewardConfigError: unknown name (the message lists the known ones), an unknown or
            missing parameter, or a bad value (regex, schema, tolerance, max_chars).
    """
    kind = REWARDS.get(name)
    if kind is None:
        raise RewardConfigError(f"unknown reward {name!r}; built-in rewards: {', '.join(sorted(REWARDS))}")
    unknown = sorted(set(params) - set(kind.params))
    if unknown:
        known = ", ".join(sorted(kind.params)) or "none"
        raise RewardConfigError(f"reward {name}: unknown parameter(s) {', '.join(unknown)} (known: {known})")
    merged = {**kind.params, **params}
    missing = sorted(k for k, v in merged.items() if v is ...)
    if missing:
        raise RewardConfigError(f"reward {name}: missing parameter(s) {', '.join(missing)}")
    kind.check(merged)
    return BoundReward(name, dict(params))


def weighted_range(names: Sequence[str], weights: Sequence[float]) -> tuple[float, float]:
    """Bounds of the weighted total over rewards `names` (each term may also be skipped: 0)."""
    low = high = 0.0
    for name, w in zip(names, weights, strict=True):
        lo, hi = REWARDS[name].value_range
        low += min(0.0, w * lo, w * hi)
        high += max(0.0, w * lo, w * hi)
    return low, high
