"""simulations/audits.py: audits of cooked statements on the simulator's recorded chains."""

from __future__ import annotations

import pytest

from swarmrl.node.trainer import retention
from swarmrl.protocol.red_team_modes import MISSTATED_ADAPTER, OMIT_GROUPS, SYBIL_CREDIT
from swarmrl.simulations import audits
from swarmrl.simulations.audits import AuditRule, Caught, Chains, caught_within, omission_due_s, run_audits
from swarmrl.simulations.scenario import load_scenario
from swarmrl.simulations.world import World

# two trainers publishing a statement every 10 s for 30 min, 20 batches each
STATEMENTS = [(10.0 * v, v, r, 20) for v in range(1, 181) for r in (0, 1)]
EVERY_KEPT = AuditRule("window", sample=64, adapters=None, window_s=600)


def test_the_retention_copy_is_the_trainers_default():
    assert audits.KEEP_VERSIONS == retention.KEEP_VERSIONS


def test_frequent_windowed_audits_catch_every_misstated_statement_soon():
    got = run_audits(Chains(STATEMENTS), MISSTATED_ADAPTER, EVERY_KEPT, 3600, share=0.05, end_s=1800, seed=1,
                     max_async_level=2)
    assert len(got) == 18 and all(c.mode == MISSTATED_ADAPTER for c in got)
    # an audit a second, half of them at each trainer: within seconds of publication
    assert all(c.delay_s is not None and 0 <= c.delay_s < 30 for c in got), got


def test_a_pruned_update_is_never_caught_by_its_adapter_check():
    # one audit rate too low to see a version while it is kept (10 versions = 100 s): late catches are impossible
    got = run_audits(Chains(STATEMENTS), MISSTATED_ADAPTER, EVERY_KEPT, 30, share=0.1, end_s=1800, seed=2,
                     max_async_level=2)
    assert all(c.delay_s is None or c.delay_s <= (2 + audits.KEEP_VERSIONS + 1) * 10 for c in got)


def test_sybil_batches_are_caught_only_when_the_draw_fetches_them():
    chains = Chains(STATEMENTS)
    everything = AuditRule("all", sample=0, adapters=0, window_s=600)
    got = run_audits(chains, SYBIL_CREDIT, everything, 360, share=0.05, end_s=1800, seed=3, max_async_level=2)
    assert all(c.delay_s is not None for c in got if c.published_s < 1200)
    none = run_audits(chains, SYBIL_CREDIT, everything, 0, share=0.05, end_s=1800, seed=3, max_async_level=2)
    assert all(c.delay_s is None for c in none)
    small = run_audits(chains, SYBIL_CREDIT, AuditRule("one", sample=1, adapters=0), 60, share=0.05, end_s=1800,
                       seed=3, max_async_level=2)
    assert caught_within(small, 600, 1800)[0] < caught_within(got, 600, 1800)[0]


def test_the_same_seed_cooks_and_audits_the_same():
    a = run_audits(Chains(STATEMENTS), SYBIL_CREDIT, EVERY_KEPT, 200, share=0.05, end_s=1800, seed=7, max_async_level=2)
    b = run_audits(Chains(STATEMENTS), SYBIL_CREDIT, EVERY_KEPT, 200, share=0.05, end_s=1800, seed=7, max_async_level=2)
    assert a == b


def test_omissions_need_receipts():
    with pytest.raises(ValueError, match="receipts"):
        run_audits(Chains(STATEMENTS), OMIT_GROUPS, EVERY_KEPT, 60, share=0.01, end_s=1800, seed=0, max_async_level=2)


def test_caught_within_judges_only_full_windows():
    results = [Caught(SYBIL_CREDIT, 0, 50), Caught(SYBIL_CREDIT, 100, 700), Caught(SYBIL_CREDIT, 200, None),
               Caught(SYBIL_CREDIT, 1500, 10)]
    assert caught_within(results, 600, 1800) == (1 / 3, 3)
    assert caught_within([], 600, 1800)[1] == 0


def test_an_omission_is_due_max_async_level_plus_two_versions_later():
    assert set(omission_due_s(STATEMENTS, 2)) == {40.0}


def test_the_world_records_one_statement_per_trainer_step():
    sc = load_scenario(None, {"workers": 40, "hours": 0.1, "trainers": {"count": 2},
                              "job": {"batch_groups": 32, "prompts_per_lease": 2}})
    w = World(sc)
    w.run(sc.seconds, lambda: False)
    assert w.metrics.steps and w.metrics.statements
    by_version: dict[int, list[tuple[int, int]]] = {}
    for t, v, rank, batches in w.metrics.statements:
        by_version.setdefault(v, []).append((rank, batches))
        assert rank in (0, 1) and 1 <= batches <= 32   # a cotrainer joins a round with what it has
    assert sorted(by_version) == [v for _, v, _ in w.metrics.steps]
    for stated in by_version.values():
        assert len({rank for rank, _ in stated}) == len(stated)   # one statement per trainer and version
        assert max(b for _, b in stated) >= 32 / 2   # the trainer that opened the round: 32 groups from leases of 2
