"""Built-in reward functions for data-set tasks: named, parameterised, no submitter code.

A data-set job names its rewards as `{name, weight, **params}` (see `RewardSpec` in
`protocol.envs.dataset`); `build_reward` checks the parameters once (unknown name, unknown or
bad parameter, a regex that does not compile, a JSON schema that is not one) and returns a
`BoundReward`: a picklable callable with TRL's signature
`f(prompts, completions, answer=None, **kwargs) -> list[float | None]`, named after the reward
(the grading pool reports failures by that name).

| name | params | value per completion |
|---|---|---|
| `math_verify` | - | 1.0 when math-verify finds the final answer equal to the whole reference (`protocol.envs.math_answer`), else 0.0 |
| `exact_match` | lowercase, strip_punctuation, collapse_whitespace (all true), first_line (false) | 1.0 when normalised texts are equal (a number's sign and decimal point are kept) |
| `numeric` | tolerance (0.0, absolute), rel_tolerance (0.0), pick ("last" or "first") | 1.0 when the picked number (not an operand of an expression) is within tolerance of the answer |
| `regex_format` | pattern (required), fullmatch (false), ignore_case (false) | 1.0 when the pattern matches (`re.search`, or `re.fullmatch`) |
| `json_schema` | schema (required, a JSON-schema object) | 1.0 when the completion (code fences stripped) is JSON valid under the schema |
| `length_penalty` | max_chars (required, >= 1) | 0.0 up to max_chars, then -(len - max_chars) / max_chars, floored at -1.0 |
| `countdown` | numbers_field (default: the task's prompt field) | 1.0 when the first line is an expression of exactly the row's numbers equal to the answer |

Rewards that read a row field name it in a parameter ending in `_field`; a data-set task passes
those fields of each row as the `row` kwarg (`{field: text}`, one dict per completion).
"""

from __future__ import annotations

import ast
import json
import operator
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from swarmrl.protocol.envs.math_answer import math_verify_reward

_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(rf"(?<![\w.])[-+]?{_UNSIGNED}")
_EXPRESSION = re.compile(rf"\(?[-+]?{_UNSIGNED}\)?(?:\s*[-+*/^×÷]\s*\(?[-+]?{_UNSIGNED}\)?)+")
_NUMBER_WORD = re.compile(r"(?<![\d.])[-+]?\d+(?:[.,:/\-]\d+)*")
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


def strip_punctuation_outside_numbers(text: str) -> str:
    """`text` without punctuation, except inside numbers: a leading sign and the marks between
    digits (`-3`, `1.0`, `1,000`, `3/4`, `2-3`, `12:30`) stay, so `-3` is not `3` nor `1.0` `10`."""
    parts, pos = [], 0
    for m in _NUMBER_WORD.finditer(text):
        parts += [text[pos:m.start()].translate(_PUNCT), m.group()]
        pos = m.end()
    return "".join(parts) + text[pos:].translate(_PUNCT)


def normalize_text(text: str, *, lowercase: bool = True, strip_punctuation: bool = True,
                   collapse_whitespace: bool = True, first_line: bool = False) -> str:
    """The text `exact_match` compares: first line only (optional), lowercased, punctuation
    removed outside numbers (`strip_punctuation_outside_numbers`), runs of whitespace collapsed,
    stripped."""
    if first_line:
        text = text.strip().split("\n", 1)[0]
    if lowercase:
        text = text.lower()
    if strip_punctuation:
        text = strip_punctuation_outside_numbers(text)
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
    """The first or last number written in `text` ("1,234.5" -> 1234.5, "x = -3" -> -3.0), or
    None. Operands of an arithmetic expression are not numbers of the text: `4-5` is neither -5
    nor 5, and `4-5=-1` reads -1. Thousands separators must group by three (`2,5` is 2 then 5)."""
    found = _NUMBER.findall(_EXPRESSION.sub(" ", text))
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


_PLAIN_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_ROW_NUMBERS = re.compile(r"[\s,]+")
_OPS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EXPRESSION_CHARS = 256
COUNTDOWN_TOLERANCE = 1e-6


def parse_row_numbers(text: str) -> list[Fraction]:
    """The numbers of a Countdown row, separated by spaces and/or commas ("4 4 6 8", "4, 4, 6, 8").

    Raises:
        ValueError: no numbers, or a token that is not a plain non-negative number.
    """
    tokens = [t for t in _ROW_NUMBERS.split(str(text).strip()) if t]
    if not tokens or any(not _PLAIN_NUMBER.fullmatch(t) for t in tokens):
        raise ValueError(f"not a list of numbers: {text!r}")
    return [Fraction(t) for t in tokens]


def arithmetic_expression(text: str) -> tuple[list[Fraction], ast.expr]:
    """(the numbers written, the parsed tree) of an expression of plain numbers, + - * / and
    parentheses (unary minus allowed); parsed with `ast`, never evaluated as Python.

    Raises:
        ValueError: empty, longer than MAX_EXPRESSION_CHARS, not Python syntax, or any other
            element (names, calls, powers, hex or scientific literals, ...).
    """
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError("empty or too long")
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"not an expression: {exc}") from None
    numbers: list[Fraction] = []
    for node in ast.walk(tree):
        why = _disallowed(node, text)
        if why:
            raise ValueError(why)
        if isinstance(node, ast.Constant):
            numbers.append(Fraction(ast.get_source_segment(text, node) or ""))
    return numbers, tree


def _disallowed(node: ast.AST, text: str) -> str:
    """Why `node` may not appear in a Countdown expression ("" when it may)."""
    if isinstance(node, ast.Constant):
        source = ast.get_source_segment(text, node) or ""
        ok = not isinstance(node.value, bool) and _PLAIN_NUMBER.fullmatch(source)
        return "" if ok else f"not a plain number: {source!r}"
    if isinstance(node, ast.BinOp):
        return "" if type(node.op) in _OPS else f"operator {type(node.op).__name__} not allowed"
    if isinstance(node, ast.UnaryOp):
        return "" if isinstance(node.op, ast.USub) else f"operator {type(node.op).__name__} not allowed"
    return "" if isinstance(node, ast.operator | ast.unaryop) else f"{type(node).__name__} not allowed"


def evaluate_arithmetic(tree: ast.expr) -> Fraction:
    """The exact value of a tree `arithmetic_expression` accepted (raises ZeroDivisionError)."""
    if isinstance(tree, ast.Constant):
        return Fraction(str(tree.value))
    if isinstance(tree, ast.UnaryOp):
        return -evaluate_arithmetic(tree.operand)
    assert isinstance(tree, ast.BinOp)
    return _OPS[type(tree.op)](evaluate_arithmetic(tree.left), evaluate_arithmetic(tree.right))


def countdown_score(completion: str, numbers: Sequence[Fraction], target: float) -> float:
    """1.0 when the completion's first line is an expression using exactly `numbers` (as a
    multiset) whose value is within COUNTDOWN_TOLERANCE of `target`; 0.0 otherwise (unparsable,
    other numbers, division by zero, another value)."""
    stripped = completion.strip()
    line = stripped.splitlines()[0].strip() if stripped else ""
    try:
        used, tree = arithmetic_expression(line)
        if Counter(used) != Counter(numbers):
            return 0.0
        value = evaluate_arithmetic(tree)
    except (ValueError, ZeroDivisionError, RecursionError):
        return 0.0
    return 1.0 if abs(float(value) - target) <= COUNTDOWN_TOLERANCE else 0.0


def countdown_reward(prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None,
                     row: Sequence[dict[str, Any]] | None = None, numbers_field: str = "",
                     **kwargs: Any) -> list[float | None]:
    """TinyZero's Countdown / Game of 24 reward (`countdown_score` per completion): the numbers
    come from the row field `numbers_field`, the target is the reference answer. A row whose
    numbers or answer do not parse leaves its completions unscored (None).

    Raises:
        ValueError: no `numbers_field` or no `row` fields (a data-set task passes both).
    """
    if not numbers_field or row is None:
        raise ValueError("countdown needs numbers_field and the row's fields (a data-set task passes them)")
    out: list[float | None] = []
    for completion, gold, fields in zip(completions, _answers(completions, answer), row, strict=True):
        try:
            numbers, target = parse_row_numbers(fields[numbers_field]), float(gold)
        except (KeyError, ValueError):
            out.append(None)
            continue
        out.append(countdown_score(completion, numbers, target))
    return out


def _check_countdown(p: dict[str, Any]) -> None:
    if not isinstance(p["numbers_field"], str):
        raise RewardConfigError(f"countdown: numbers_field must be a field name, got {p['numbers_field']!r}")


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
    "countdown": RewardKind(countdown_reward, {"numbers_field": ""}, (0.0, 1.0),
                            "Countdown / Game of 24: an expression of exactly the row's numbers equal to the answer",
                            _check_countdown),
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
