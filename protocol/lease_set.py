"""Which jobs a worker leases from in one round when its engine batches several jobs' adapters
(vLLM: one engine batch carries every held job's requests, each on its own job's LoRA adapter).

A round's lease set is up to `k` jobs (`WorkerConfig.jobs_per_round`), chosen by the one-job rule
(`protocol.market.choose_job`) applied once per place in the set:
1. Each job kept from the last round (in the order it was kept) is challenged once, as a worker
   with one job is: it stays, or the worker moves that place to a better-placed challenger
   (`choose_job` with it as the current job). A kept job challenged away is out of this round,
   so moving one place never hands the next kept job a second challenge in its stead.
2. Places left are filled by fresh weighted power-of-two draws among the jobs that want work.
No job fills two places; the set is shorter than `k` when fewer jobs want work. With `k = 1` it
is exactly `choose_job` (the same draws from the same `random.Random`), so a worker serving one
job a round behaves as before.

When a trainer of the set refuses as `busy`, the worker fills the place again at once with
`plan_round(remaining offers, kept=(), k=places left)`: the refused job and the jobs already
tried are left out of `offers` by the caller.

Pure (no network, no clock): the worker (`node/worker/market.py`) and a simulator run the same rule.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from swarmrl.protocol.market import MAX_WEIGHT, SWITCH_MARGIN, Offer, choose_job


def plan_round(offers: Sequence[Offer], rng: random.Random, *, kept: Sequence[str] = (), k: int = 1,
               cap: float = MAX_WEIGHT, margin: float = SWITCH_MARGIN) -> list[str]:
    """The job ids to lease from this round, at most `k`, in the order they were chosen (see the
    module docstring).

    offers: the jobs as their records announce them (a kept job is kept whatever capacity it
        announced: its trainer's live answer decides, as in `choose_job`).
    kept: the jobs whose leases the last round held; those absent from `offers` are passed over.
    Raises ValueError for k < 1, and as `choose_job` does (a weight not > 0, a bad margin).
    """
    if k < 1:
        raise ValueError(f"a round leases from at least 1 job, got k={k}")
    live = {o.job_id for o in offers}
    queue = [j for j in dict.fromkeys(kept) if j in live]   # each kept job once, in order
    plan: list[str] = []
    out: set[str] = set()   # jobs chosen, and kept jobs already challenged
    while len(plan) < k:
        current = next((j for j in queue if j not in out), None)
        pick = choose_job([o for o in offers if o.job_id not in out], rng, current=current, cap=cap, margin=margin)
        if current is not None:
            out.add(current)
        if pick is None:
            break
        plan.append(pick)
        out.add(pick)
    return plan
