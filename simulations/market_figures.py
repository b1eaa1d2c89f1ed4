"""What a market run measured (summary.json of a scenario with `market.jobs`): the swarm's totals,
each job's groups trained against its weighted fair share, Jain's index over those ratios, the
workers' moves between jobs and the snapshot bytes by source.

A job's demand is what its trainers can train per hour at most, `trainers x batch_max x 3600 /
step` (the step time of its largest batch and averaging, `World.step_s`); its fair share is the weighted
max-min split (`protocol.market.fair_split`) of what the swarm trained in all among those demands.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import TYPE_CHECKING, Any

from swarmrl.protocol.market import fair_split, jain
from swarmrl.simulations.metrics import WASTE, busy_share, quantile

if TYPE_CHECKING:
    from swarmrl.simulations.market_world import MarketWorld


def market_summary(mw: MarketWorld, *, sim_s: float, wall_s: float, interrupted: bool) -> dict[str, Any]:
    """The run's figures; `sim_s`: the simulated seconds reached."""
    hours = max(sim_s, 1e-9) / 3600
    trained = {j.job_id: sum(n for _, _, n in j.metrics.steps) for j in mw.jobs}
    most = {j.job_id: j.trainers[0].spec.batch_max for j in mw.jobs}
    demand = {j.job_id: len(j.trainers) * most[j.job_id] * 3600 / j.step_s(len(j.trainers), most[j.job_id])
              for j in mw.jobs}
    weight = {j.job_id: j.job.weight for j in mw.jobs}
    fair = fair_split(sum(trained.values()) / hours, demand, weight)
    ratio = {j: trained[j] / hours / fair[j] for j in fair if fair[j] > 0}
    wasted: Counter[str] = Counter()
    for j in mw.jobs:
        wasted.update(j.metrics.wasted)
    generated = sum(j.metrics.counts["groups_generated"] for j in mw.jobs)
    snap = Counter[str]()
    for j in mw.jobs:
        snap.update(j.gossip.snapshot_sent)
    delta_trainer = sum(j.gossip.trainer_bytes for j in mw.jobs)
    delta_peer = sum(j.gossip.peer_bytes for j in mw.jobs)
    reach = [s.reach_s["95"] for j in mw.jobs for s in j.gossip.spreads if s.live]
    served = [len(mw.served.get(w.idx, ())) for w in mw.workers]
    worker_hours = sum(max(0.0, min(w.leaves_s, sim_s) - w.joined_s) for w in mw.workers) / 3600
    return {
        "scenario": mw.sc.name, "market_choice": mw.sc.market.choice, "simulated_s": round(sim_s, 1),
        "wall_s": round(wall_s, 1), "interrupted": interrupted, "jobs": len(mw.jobs),
        "workers_total": len(mw.workers), "trainers": sum(len(j.trainers) for j in mw.jobs),
        "versions": sum(j.version for j in mw.jobs),
        "groups_generated": generated,
        "groups_admitted": sum(j.metrics.counts["groups_admitted"] for j in mw.jobs),
        "groups_trained": sum(trained.values()),
        "groups_trained_per_hour": round(sum(trained.values()) / hours),
        "wasted_share": {k: round(wasted[k] / max(1, generated), 4) for k in WASTE},
        "wasted_share_total": round(sum(wasted.values()) / max(1, generated), 4),
        "fairness": {"jain_over_fair_share_ratios": round(jain(list(ratio.values())), 4),
                     "ratio_min": round(min(ratio.values()), 3) if ratio else None,
                     "ratio_p10": quantile(list(ratio.values()), 0.1),
                     "jobs_below_0_9": sum(1 for r in ratio.values() if r < 0.9),
                     "jobs_starved": sum(1 for j in mw.jobs if trained[j.job_id] == 0)},
        "workers": {"served_more_than_one_job": round(sum(1 for n in served if n > 1) / max(1, len(served)), 4),
                    "jobs_served_mean": round(statistics.fmean(served), 2) if served else 0.0,
                    "switches_per_worker_hour": round(mw.switches / worker_hours, 2) if worker_hours else 0.0,
                    "busy_share": busy_share(mw.workers, sim_s)},
        "bytes": {"delta_trainer": delta_trainer, "delta_peer": delta_peer,
                  "snapshot_trainer": snap["trainer"], "snapshot_peer": snap["peer"],
                  "snapshot_trainer_share": round(snap["trainer"] / (snap["trainer"] + snap["peer"]), 4)
                  if snap["trainer"] + snap["peer"] else 0.0},
        "reach_95_s_p50": quantile(reach, 0.5),
        "honest_banned": sum(1 for w in mw.workers if not w.cheater and math.isfinite(w.banned_s)),
        "cheaters_banned": sum(1 for w in mw.workers if w.cheater and math.isfinite(w.banned_s)),
        "per_job": [{"job": j.job_id, "weight": j.job.weight, "batch_groups": j.job.batch_groups, "batch_max": most[j.job_id],
                     "trainers": len(j.trainers), "versions": j.version,
                     "groups_trained_per_hour": round(trained[j.job_id] / hours),
                     "demand_per_hour": round(demand[j.job_id]), "fair_share_per_hour": round(fair[j.job_id]),
                     "ratio_to_fair": round(ratio[j.job_id], 3) if j.job_id in ratio else None,
                     "groups_generated": j.metrics.counts["groups_generated"],
                     "wasted_share": round(sum(j.metrics.wasted.values()) / max(1, j.metrics.counts["groups_generated"]), 4)}
                    for j in mw.jobs],
    }
