"""Which admitted groups a validator checks fully: keyed, deterministic, unpredictable to workers.

A group's draw is HMAC-SHA256(key, rung, batch id, prompt index) read as a number in [0, 1).
The same key and batch always give the same choice (reproducible runs and restarts), while a
worker without the key can't grind its batch nonce toward groups that escape checking.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

KEY_BYTES = 32
FULL = "full"        # regrade (and what comes with it)
LOGPROB = "logprob"  # the prefill rung, drawn among fully checked groups


def unit_draw(key: bytes, rung: str, batch_id: str, prompt_index: int) -> float:
    """A deterministic pseudo-random number in [0, 1) for (key, rung, batch, prompt)."""
    msg = f"{rung}\x00{batch_id}\x00{prompt_index}".encode()
    digest = hmac.digest(key, msg, hashlib.sha256)   # one-shot (OpenSSL), the same bytes as hmac.new(...).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclass(frozen=True)
class GroupPlan:
    """What to run on one group beyond the cheap rungs (which run on every group)."""

    regrade: bool
    logprob: bool


def plan_group(key: bytes, batch_id: str, prompt_index: int, rate: float) -> GroupPlan:
    """Regrade with probability `rate`; among those, recompute log-probs with probability `rate`
    again (a trusted peer at rate r gets r**2 of its groups prefilled; a new or suspect peer,
    rate 1, gets all). Raises ValueError unless 0 <= rate <= 1."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    regrade = unit_draw(key, FULL, batch_id, prompt_index) < rate
    logprob = regrade and unit_draw(key, LOGPROB, batch_id, prompt_index) < rate
    return GroupPlan(regrade, logprob)


def load_or_create_key(path: Path) -> bytes:
    """The validator's sampling key (32 random bytes, file mode 0600), created on first use."""
    if path.exists():
        key = path.read_bytes()
        if len(key) != KEY_BYTES:
            raise ValueError(f"sampling key {path} must hold {KEY_BYTES} bytes, has {len(key)}")
        return key
    path.parent.mkdir(parents=True, exist_ok=True)
    key = os.urandom(KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key
