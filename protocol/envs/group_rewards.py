"""Group-level rewards: functions that score the episodes (or completions) of a group together.

They keep TRL's batched signature, `f(prompts, completions, **columns) -> list[float | None]`:
TRL hands a reward function the whole batch, whose G completions of one prompt sit together,
so a function may compare them. Here the `group` column says which rows belong together (the
prompt index: every row of one group carries it), so a function gives the same answers whether
it sees one group or a whole lease's batch, and a validator that re-grades a single group over
the same rows gets the same values (tests/unit/test_group_rewards.py).

Environments that use one set `group_rewards = True`; players and graders then add the `group`
column (`node.tasks.episode_play.grade_rows`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

Correct = Callable[[str, dict[str, Any]], bool]


def by_group(groups: Sequence[Any]) -> dict[Any, list[int]]:
    """Row indices of each group id, in row order."""
    rows: dict[Any, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        rows[g].append(i)
    return dict(rows)


def shortest_correct_bonus(correct_R: Sequence[bool], lengths_R: Sequence[int], groups_R: Sequence[Any]) -> list[float]:
    """1.0 for the correct rows of minimal length within their group, 0.0 for every other row.

    Ties all get the bonus; a group without a correct row gets none.
    """
    out = [0.0] * len(correct_R)
    for rows in by_group(groups_R).values():
        right = [i for i in rows if correct_R[i]]
        if right:
            shortest = min(lengths_R[i] for i in right)
            for i in right:
                out[i] = 1.0 if lengths_R[i] == shortest else 0.0
    return out


def pairwise_win_rate(scores_R: Sequence[float], groups_R: Sequence[Any]) -> list[float]:
    """Each row's share of pairwise wins against the other rows of its group (ties count 1/2):
    a preference reward in [0, 1] built from per-row scores. A lone row gets 0.5."""
    out = [0.5] * len(scores_R)
    for rows in by_group(groups_R).values():
        if len(rows) < 2:
            continue
        for i in rows:
            wins = sum(1.0 if scores_R[i] > scores_R[j] else 0.5 if scores_R[i] == scores_R[j] else 0.0
                       for j in rows if j != i)
            out[i] = wins / (len(rows) - 1)
    return out
