"""The `math_verify` reward, with the gold and the completion's final answer each read whole.

math-verify (`math_verify.parse`) reads a text without LaTeX delimiters with its expression
extractor, which keeps the *last* expression it finds: the gold `2, 5` of a "find all
solutions" question is read as 5, and the partial answer `5` then scored 1.0 (the gold written
`$2, 5$` is read as the set {2, 5}, and `5` scores 0.0). So here:

- **The gold** is read as math-verify reads it when it carries LaTeX delimiters (`$`, `\\(`,
  `\\[`, `\\boxed`); otherwise it is also read as one LaTeX expression (`$gold$`), and that whole
  reading wins when it is a collection (a set, an interval, a tuple: `2, 5`, `2 and 5`,
  `x = 2, x = 5`, `{2, 5}`) or when the plain reading drops digits of the gold or the gold holds a
  backslash (`2\\pi`, read plainly as 2). A gold neither reading understands leaves the completion
  unscored (None), as an unreadable row is elsewhere.
- **The completion's final answer** is read as math-verify reads it (its `\\boxed{}` or last
  `$...$`, else the last expression), except that a completion without LaTeX delimiters whose last
  line is a plain list of values (`2, 5`, `The answer is 2 and 5.`) is read as that whole list: a
  list of candidates is not the last of them, so hedging with `1, 2, 3, 4, 5` does not earn the
  reward of gold 5.

Sets compare as sets (order-free), by math-verify's `verify(gold, answer)`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from typing import Any

_LATEX = re.compile(r"\$|\\\(|\\\[|\\boxed|\\fbox")
_ANSWER_LEAD = re.compile(r"^.*?\b(?:answers?|solutions?|roots?)\s*(?:is|are|:|=)\s*", re.IGNORECASE)
_PLAIN_CHARS = re.compile(r"[\w\s.,;:=+\-*/^()\[\]{}]*")
_SEPARATOR = re.compile(r"[,;]|\b(?:and|or)\b")
_WORD = re.compile(r"[A-Za-z]{2,}")
_COLLECTION_TYPES: tuple[type, ...] = ()


def _collection_types() -> tuple[type, ...]:
    global _COLLECTION_TYPES
    if not _COLLECTION_TYPES:
        import sympy

        _COLLECTION_TYPES = (sympy.Set, sympy.Tuple, list, tuple, set)
    return _COLLECTION_TYPES


def _timeout() -> int | None:
    # math-verify times out with SIGALRM, which only the main thread may use (the grading pool's
    # subprocess calls from its main thread; the pool's own time limit bounds every call anyway).
    return 5 if threading.current_thread() is threading.main_thread() else None


def _whole(text: str) -> list[Any]:
    """`text` read as one LaTeX expression ([] when it does not give a sympy value)."""
    from math_verify import LatexExtractionConfig, parse

    read = parse(f"${text}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=_timeout())
    return read if len(read) == 2 else []


def _is_collection(read: list[Any]) -> bool:
    return bool(read) and isinstance(read[0], _collection_types())


def _digits(text: str) -> str:
    return "".join(ch for ch in text if ch.isdigit())


def _is_plain_list(line: str) -> bool:
    """A line of values and separators only (`2, 5`, `x = 2 or x = 5`): no word but and / or."""
    words_ok = all(w.lower() in ("and", "or") for w in _WORD.findall(line))
    return words_ok and bool(_SEPARATOR.search(line)) and bool(_PLAIN_CHARS.fullmatch(line))


def read_gold(gold: str) -> list[Any]:
    """The reference answer as math-verify values (`math_verify.parse`'s list; [] if unreadable),
    read whole (the module's docstring says how)."""
    from math_verify import parse

    gold = gold.strip()
    if _LATEX.search(gold):
        return list(parse(gold, parsing_timeout=_timeout()))
    whole = _whole(gold.rstrip("."))
    if _is_collection(whole):
        return whole
    plain = list(parse(gold, parsing_timeout=_timeout()))
    if plain and "\\" not in gold and _digits(str(plain[-1])) == _digits(gold):
        return plain
    return whole or plain


def read_final_answer(completion: str) -> list[Any]:
    """The completion's final answer as math-verify values ([] if none): a last line that is a
    plain list of values is read whole, anything else as `math_verify.parse` reads it."""
    from math_verify import parse

    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    if lines and not _LATEX.search(completion):
        last = _ANSWER_LEAD.sub("", lines[-1]).rstrip(".").strip()
        if _is_plain_list(last):
            whole = _whole(last)
            if _is_collection(whole):
                return whole
    return list(parse(completion, parsing_timeout=_timeout()))


def math_verify_reward(prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None,
                       **kwargs: Any) -> list[float | None]:
    """1.0 when math-verify judges the completion's final answer equal to the whole reference,
    else 0.0; None (unscored) when the reference itself is unreadable.

    Raises:
        ValueError: no answer column, or not one answer per completion.
    """
    from math_verify import verify

    if answer is None:
        raise ValueError("this reward needs the data set's answer column")
    if len(answer) != len(completions):
        raise ValueError(f"{len(answer)} answers for {len(completions)} completions")
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        want = read_gold(str(gold))
        if not want:
            out.append(None)
            continue
        got = read_final_answer(completion)
        out.append(1.0 if got and verify(want, got, timeout_seconds=_timeout()) else 0.0)
    return out
