"""Audits of cooked credit books on the simulated clock (issue 27's figure, docs/CREDIT.md section 6).

Input: the contribution statements a simulated run's trainers signed (`Metrics.statements`: time,
version, trainer rank, batches credited). A trainer cooks a share of its statements with one of
the red-team modes (`protocol.red_team_modes`); auditors arrive at random (Poisson, `per_hour`
over the swarm, each auditing one trainer picked at random) and each draws its checks with the
audit command's own rule (`protocol.audit_sampling.pick_checks`, `window_start`). A cooked
statement is caught by the first audit whose draw sees it:

- `sybil_credit`: one batch credited to a sybil (a batch the trainer never received, at a random
  place in the statement) caught when the draw fetches it while the statement is younger than
  `protocol.audit.FRESH_S` (`unknown_batch`; an older one is only `unavailable`);
- `misstated_adapter`: caught when the draw checks the version's signed update while the trainer
  still keeps it (the versions head - max_async_level - keep_versions .. head: the trainer's
  retention rule, node/trainer/retention.py, whose default `KEEP_VERSIONS` this copies and a
  test holds equal).

`omit_groups` needs the victim's receipts, which a third-party audit does not hold: it is caught
by the victim's own audit once the omitted group is due (`protocol.audit.due`), so its delay is
the due time plus the victim's audit interval, whatever the third-party rate (`omission_due_s`).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass

from swarmrl.protocol import audit
from swarmrl.protocol.audit_sampling import pick_checks, window_start
from swarmrl.protocol.red_team_modes import MISSTATED_ADAPTER, SYBIL_CREDIT

KEEP_VERSIONS = 8   # node/trainer/retention.KEEP_VERSIONS (the trainer's default; tests/unit/test_sim_audits.py)
Statement = tuple[float, int, int, int]   # (published at s, version, trainer rank, batches credited)


@dataclass(frozen=True)
class AuditRule:
    """What one audit draws (the `swarmrl audit` flags of the same names). window_s: only the
    statements of the last window_s seconds (0: the whole chain); adapters: other versions'
    updates checked besides the head's (None: every one in the window)."""

    name: str
    sample: int = 64
    adapters: int | None = 1
    window_s: float = 0.0


@dataclass(frozen=True)
class Caught:
    """One cooked statement's fate: its mode, when it was published, and the delay (s) until an
    audit caught it (None: not caught by the end of the run)."""

    mode: str
    published_s: float
    delay_s: float | None


class Chains:
    """Each trainer's chain of statements in order, with the times and versions the draw needs."""

    def __init__(self, statements: Sequence[Statement]) -> None:
        by_rank: dict[int, list[Statement]] = {}
        for st in sorted(statements):
            by_rank.setdefault(st[2], []).append(st)
        self.ranks = sorted(by_rank)
        self.times = {r: [s[0] for s in by_rank[r]] for r in self.ranks}
        self.versions = {r: [s[1] for s in by_rank[r]] for r in self.ranks}
        self.batches = {r: [s[3] for s in by_rank[r]] for r in self.ranks}

    def cooked(self, share: float, rng: random.Random) -> list[tuple[int, int]]:
        """A random `share` of all statements (at least one), as (rank, index in its chain)."""
        every = [(r, i) for r in self.ranks for i in range(len(self.times[r]))]
        return rng.sample(every, max(1, round(share * len(every))))


def run_audits(chains: Chains, mode: str, rule: AuditRule, per_hour: float, *, share: float, end_s: float,
               seed: int, max_async_level: int, keep_versions: int = KEEP_VERSIONS) -> list[Caught]:
    """One trial: cook `share` of the statements with `mode` (SYBIL_CREDIT or MISSTATED_ADAPTER),
    audit at `per_hour` over [0, end_s] under `rule`; each cooked statement's fate.

    Raises:
        ValueError: a mode a third-party audit can't see (omit_groups: see the module).
    """
    if mode not in (SYBIL_CREDIT, MISSTATED_ADAPTER):
        raise ValueError(f"{mode}: only sybil_credit and misstated_adapter are seen without receipts")
    rng = random.Random(f"audits/{seed}")
    cooked = chains.cooked(share, rng)
    extra = {(r, i): rng.randint(0, chains.batches[r][i]) for r, i in cooked} if mode == SYBIL_CREDIT else {}
    found: dict[tuple[int, int], float] = {}
    t = rng.expovariate(per_hour / 3600) if per_hour > 0 else end_s
    while t < end_s and len(found) < len(cooked):
        r = rng.choice(chains.ranks)
        n = bisect.bisect_right(chains.times[r], t)   # statements published by t
        if n:
            _audit_one(chains, r, n, t, rule, extra, cooked, found, mode, rng, max_async_level + keep_versions)
        t += rng.expovariate(per_hour / 3600)
    return [Caught(mode, chains.times[r][i], found[(r, i)] - chains.times[r][i] if (r, i) in found else None)
            for r, i in cooked]


def _audit_one(chains: Chains, r: int, n: int, t: float, rule: AuditRule, extra: dict[tuple[int, int], int],
               cooked: list[tuple[int, int]], found: dict[tuple[int, int], float], mode: str,
               rng: random.Random, kept: int) -> None:
    """One audit of trainer `r` at `t` over its first `n` statements; records what it catches."""
    versions = chains.versions[r][:n]
    batches = [b + (1 if (r, i) in extra else 0) for i, b in enumerate(chains.batches[r][:n])]
    first = window_start(chains.times[r][:n], None if rule.window_s <= 0 else t - rule.window_s)
    checks = pick_checks(versions, batches, rng, sample=rule.sample, adapters=rule.adapters, first=first)
    if mode == MISSTATED_ADAPTER:
        floor = versions[-1] - kept
        hits = {v for v in checks.adapter_versions if v >= floor}
        for key in cooked:
            if key[0] == r and key[1] < n and key not in found and chains.versions[r][key[1]] in hits:
                found[key] = t
    else:
        fresh = t - audit.FRESH_S
        for s, b in checks.batches:
            key = (r, s)
            if key in extra and key not in found and extra[key] == b and chains.times[r][s] >= fresh:
                found[key] = t


def caught_within(results: Sequence[Caught], within_s: float, end_s: float) -> tuple[float, int]:
    """The share of cooked statements caught within `within_s` of their publication, over those
    published at least `within_s` before `end_s` (the rest had no full window); and their count."""
    judged = [c for c in results if c.published_s <= end_s - within_s]
    if not judged:
        return float("nan"), 0
    return sum(c.delay_s is not None and c.delay_s <= within_s for c in judged) / len(judged), len(judged)


def omission_due_s(statements: Sequence[Statement], max_async_level: int) -> list[float]:
    """For each version p, seconds from p's publication until a group admitted at p is due in
    the chain (`protocol.audit.due`: the statement of p + A + 2): the least delay of a receipt-
    holding victim's audit."""
    published: dict[int, float] = {}
    for t, v, _, _ in statements:
        published[v] = min(t, published.get(v, t))
    out = []
    for p, t in sorted(published.items()):
        due_at = next((published[h] for h in sorted(published) if h > p
                       and audit.due(p, h, max_async_level, None)), None)
        if due_at is not None:
            out.append(due_at - t)
    return out
