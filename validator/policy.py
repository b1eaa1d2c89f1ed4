"""The validator's sampling policy as pure functions of a peer's counts (no store, no clock).

`reputation.Reputation` keeps the counts in SQLite and asks these; the simulator
(`simulations/validator.py`) keeps them in memory and asks the same. See reputation.py's module
docstring for the policy in words.
"""

from __future__ import annotations

from typing import cast

NEW_PEER_CHECKS = 16
RECENT_FAILURE_MS = 6 * 3600 * 1000
BAN_MS = 24 * 3600 * 1000
MAX_BAN_MS = 30 * 24 * 3600 * 1000
GAIN = 4.0


def score(passed: int, checked: int, soft_flags: int = 0) -> float:
    """(passed + 1) / (checked + soft_flags + 2), in (0, 1): Laplace's rule of succession."""
    return (passed + 1) / (checked + soft_flags + 2)


def sample_rate(base: float, *, checked: int, passed: int, soft_flags: int, banned: bool,
                since_failure_ms: int | None) -> float:
    """Share of the peer's groups to check fully: 1 for a new, banned or recently failed peer,
    else base + (1 - base) * min(1, GAIN * (1 - score)). Raises ValueError unless 0 <= base <= 1."""
    if not 0.0 <= base <= 1.0:
        raise ValueError(f"base sample rate must be in [0, 1], got {base}")
    if checked < NEW_PEER_CHECKS or banned:
        return 1.0
    if since_failure_ms is not None and since_failure_ms < RECENT_FAILURE_MS:
        return 1.0
    return base + (1.0 - base) * min(1.0, GAIN * (1.0 - score(passed, checked, soft_flags)))


def ban_duration_ms(earlier_bans: int) -> int:
    """BAN_MS doubled per earlier ban, capped at MAX_BAN_MS."""
    doubling = cast(int, 2 ** min(int(earlier_bans), 16))  # int ** int is typed Any (a negative power is a float)
    return min(BAN_MS * doubling, MAX_BAN_MS)
