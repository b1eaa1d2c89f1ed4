"""Regions and the one-way latency between them (milliseconds, typical home-link figures).

Assumed, not measured: round-trip times between continents on consumer links run 20-40 ms within
a region and 80-300 ms across oceans; a one-way figure is half of that.
"""

from __future__ import annotations

REGIONS = ("na", "eu", "asia", "sa", "oceania")

_ONE_WAY_MS = {
    ("na", "na"): 15, ("eu", "eu"): 12, ("asia", "asia"): 20, ("sa", "sa"): 20, ("oceania", "oceania"): 15,
    ("na", "eu"): 45, ("na", "asia"): 80, ("na", "sa"): 60, ("na", "oceania"): 80,
    ("eu", "asia"): 90, ("eu", "sa"): 100, ("eu", "oceania"): 140,
    ("asia", "sa"): 150, ("asia", "oceania"): 60, ("sa", "oceania"): 150,
}


def one_way_s(a: str, b: str) -> float:
    """One-way latency from region `a` to region `b`, seconds (symmetric)."""
    ms = _ONE_WAY_MS.get((a, b)) or _ONE_WAY_MS[(b, a)]
    return ms / 1000.0
