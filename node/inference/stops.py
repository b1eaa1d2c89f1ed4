"""Where a sampled completion ends, the same for every backend: after its first EOS token, or
after the token that completes its first stop string, whichever comes first."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal


def completion_end(tokenizer: Any, tokens: list[int], eos_token_ids: Collection[int],
                   stops: tuple[str, ...]) -> tuple[int, Literal["stop", "length"]]:
    """(number of tokens kept, why it ended) for generated `tokens`: the EOS token and the token
    completing a stop string are kept; "length" when neither occurs (all tokens kept)."""
    end: int = len(tokens)
    reason: Literal["stop", "length"] = "length"
    eos_at = next((i for i, t in enumerate(tokens) if t in eos_token_ids), None)
    if eos_at is not None:
        end, reason = eos_at + 1, "stop"
    stop_at = first_stop(tokenizer, tokens[:end], stops)
    if stop_at is not None:
        end, reason = stop_at + 1, "stop"
    return end, reason


def first_stop(tokenizer: Any, tokens: list[int], stops: tuple[str, ...]) -> int | None:
    """Index of the token that completes the first stop string in `decode(tokens)`, or None.

    Binary search on "the decoded prefix contains a stop string", which grows with the prefix.
    """
    def contains(k: int) -> bool:
        text = tokenizer.decode(tokens[: k + 1], skip_special_tokens=True)
        return any(s in text for s in stops)

    if not stops or not tokens or not contains(len(tokens) - 1):
        return None
    lo, hi = 0, len(tokens) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if contains(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
