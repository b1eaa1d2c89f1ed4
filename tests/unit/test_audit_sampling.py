"""protocol/audit_sampling.py: one audit's draw of updates and credited batches, windows included."""

from __future__ import annotations

import random

import pytest

from swarmrl.protocol.audit_sampling import Checks, pick_checks, window_start

VERSIONS = [1, 2, 3, 4, 5, 6]
BATCHES = [3, 0, 2, 5, 1, 4]


def _draw_before_windows(versions, batches, seed, sample, adapters):
    """What audit_job drew before pick_checks: head + rng.sample(others), then rng.sample(credited)."""
    rng = random.Random(seed)
    picked = [versions[-1]] + rng.sample(versions[:-1], min(adapters, len(versions) - 1))
    credited = [(s, b) for s, n in enumerate(batches) for b in range(n)]
    return picked, (credited if sample == 0 else rng.sample(credited, min(sample, len(credited))))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("sample, adapters", [(4, 1), (64, 2), (0, 0), (7, 9)])
def test_the_whole_chain_draws_what_the_audit_drew_before(seed, sample, adapters):
    got = pick_checks(VERSIONS, BATCHES, random.Random(seed), sample=sample, adapters=adapters)
    assert (got.adapter_versions, got.batches) == _draw_before_windows(VERSIONS, BATCHES, seed, sample, adapters)


def test_a_window_draws_only_its_statements_and_every_update_when_asked():
    got = pick_checks(VERSIONS, BATCHES, random.Random(0), sample=0, adapters=None, first=3)
    assert got.adapter_versions[0] == 6 and sorted(got.adapter_versions) == [4, 5, 6]
    assert got.batches == [(3, b) for b in range(5)] + [(4, 0)] + [(5, b) for b in range(4)]
    sampled = pick_checks(VERSIONS, BATCHES, random.Random(1), sample=3, adapters=1, first=4)
    assert len(sampled.batches) == 3 and all(s in (4, 5) and b < BATCHES[s] for s, b in sampled.batches)
    assert len(set(sampled.batches)) == 3


def test_empty_windows_and_chains_draw_nothing():
    assert pick_checks([], [], random.Random(0), sample=64, adapters=1) == Checks([], [])
    assert pick_checks(VERSIONS, BATCHES, random.Random(0), sample=64, adapters=1, first=6) == Checks([], [])
    assert pick_checks([3], [0], random.Random(0), sample=64, adapters=None) == Checks([3], [])


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="batch counts"):
        pick_checks([1, 2], [1], random.Random(0), sample=1, adapters=1)
    with pytest.raises(ValueError, match="outside the chain"):
        pick_checks([1, 2], [1, 1], random.Random(0), sample=1, adapters=1, first=3)


def test_window_start():
    times = [100, 200, 200, 300]
    assert window_start(times, None) == 0
    assert window_start(times, 150) == 1 and window_start(times, 200) == 1
    assert window_start(times, 301) == 4 and window_start([], 5) == 0
