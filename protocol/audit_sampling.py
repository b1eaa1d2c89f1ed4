"""What one audit of a trainer's books checks (docs/CREDIT.md section 6): which versions' signed
updates it compares with their statements, and which credited batches it fetches. Pure: the
audit command (`node/audit/books.py`) and the simulator's audit model
(`simulations/audits.py`) draw with the same rule, so the simulator's catch rates are the
command's.

The rule: of the statements in the window (the chain's tail from `first`; 0: the whole chain),
the head's update and `adapters` others' (None: every one in the window), and `sample` credited
batches drawn uniformly among the window's (0: all of them).
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Checks:
    """One audit's draw. adapter_versions: versions whose signed update is checked, the head's
    first; batches: (statement index in the chain, batch index in that statement) pairs."""

    adapter_versions: list[int]
    batches: list[tuple[int, int]]


def window_start(created: Sequence[float], since: float | None) -> int:
    """Index of the first statement created at or after `since` (None: 0, the whole chain).
    `created`: the chain's statement times in chain order (non-decreasing), in the unit of
    `since` (the command passes ms, the simulator s)."""
    if since is None:
        return 0
    return bisect.bisect_left(created, since)


def pick_checks(versions: Sequence[int], batches: Sequence[int], rng: random.Random, *, sample: int,
                adapters: int | None, first: int = 0) -> Checks:
    """Draw one audit's checks.

    versions: each statement's version, in chain order; batches: each statement's credited
    batch count (same length); sample: batches to draw (0: every batch in the window);
    adapters: versions besides the head whose update is checked (None: all in the window);
    first: the window's first statement index.

    With `first=0` the draw is the one `audit_job` made before windows existed (same `rng` calls
    in the same order), so a seeded audit picks the same checks.

    Raises:
        ValueError: `versions` and `batches` differ in length, or `first` is out of range.
    """
    if len(versions) != len(batches):
        raise ValueError(f"{len(versions)} versions but {len(batches)} batch counts")
    if not 0 <= first <= len(versions):
        raise ValueError(f"window start {first} outside the chain of {len(versions)}")
    if first == len(versions):
        return Checks([], [])
    head, others = versions[-1], list(versions[first:-1])
    k = len(others) if adapters is None else min(adapters, len(others))
    adapter_versions = [head] + rng.sample(others, k)
    ends = list(itertools.accumulate(batches[first:]))   # the window's batches, numbered across statements
    total = ends[-1]
    picked = range(total) if sample == 0 else rng.sample(range(total), min(sample, total))
    drawn = []
    for n in picked:
        i = bisect.bisect_right(ends, n)
        drawn.append((first + i, n - (ends[i - 1] if i else 0)))
    return Checks(adapter_versions, drawn)
