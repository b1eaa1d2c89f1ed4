"""The job-choice rule (`protocol.market.choose_job`) in a toy market: how close the workers'
split comes to the weighted max-min fair one, and how much they move.

Toy model (no network, no trainer): each job can use at most `demand` workers and has a weight;
its announced capacity is `demand - workers on it` and its intake the workers on it (one group
per worker per round). Each round every worker in turn (in a random order) leaves its job and
re-applies the rule with that job kept, seeing the live counts. The fair split is weighted
water-filling: supply is shared by weight among the jobs still wanting more; a job that needs
less than its share gets what it needs and the rest is shared again.

Prints, after the last round: Jain's index over workers / fair share (jobs with a fair share),
the smallest and largest of those ratios, jobs with demand and no worker, idle workers, and the
share of workers that moved job in the last round. `--stale`: every worker of a round reads the
same counts (the records of the round's start), as 10,000 workers reading the same DHT records do;
a job already at its demand refuses (`busy`) and the worker picks again among the others.

    .venv/bin/python benchmarks/market_rule.py --workers 10000 --jobs 50 --rounds 20
"""

from __future__ import annotations

import argparse
import random
from collections import Counter

from swarmrl.protocol.market import Offer, choose_job, fair_split, jain


def uniform_rule(offers: list[Offer], rng: random.Random, current: str | None = None) -> str | None:
    """The rule before demand was announced, as a baseline: a worker walks every job it can
    serve in turn, one lease each, whatever each needs (here: a uniform pick among the jobs
    that still take work; a refused job sends it to the next)."""
    wanting = [o for o in offers if o.capacity > 0 or o.job_id == current]
    return rng.choice(wanting).job_id if wanting else None


def run(workers: int, jobs: int, rounds: int, seed: int, load: float, stale: bool = False,
        rule: str = "market") -> dict[str, float]:
    """One toy market; returns its figures. `load`: total demand / supply; `stale`: workers see
    the counts of the round's start (records refreshed once a round), and a job over its demand
    refuses the lease (`busy`), so the worker picks another job at once. `rule`: "market"
    (`choose_job`) or "uniform" (`uniform_rule`)."""
    choose = choose_job if rule == "market" else uniform_rule
    rng = random.Random(seed)
    weight = {f"j{i}": rng.choice([1.0, 1.0, 2.0, 4.0, 8.0]) for i in range(jobs)}
    raw = {j: rng.lognormvariate(0, 1.2) for j in weight}   # mixed sizes: a few big jobs, many small
    scale = load * workers / sum(raw.values())
    demand = {j: max(1, round(r * scale)) for j, r in raw.items()}
    on: list[str | None] = [None] * workers
    count: Counter[str] = Counter()
    moved = 0
    for _ in range(rounds):
        moved = 0
        seen = Counter(count)   # what the records say this round (stale: every worker reads the same)
        for w in rng.sample(range(workers), workers):
            cur = on[w]
            if cur is not None:
                count[cur] -= 1
            view = count if not stale else seen
            offers = [Offer(j, demand[j] - view[j], float(view[j]), weight[j]) for j in weight]
            new = choose(offers, rng, current=cur)
            while new is not None and count[new] >= demand[new]:   # the trainer refuses as busy: the next job at once
                offers = [o for o in offers if o.job_id != new]
                new = choose(offers, rng)                           # (the refused job is no longer kept)
            if new is not None:
                count[new] += 1
            moved += new != cur
            on[w] = new
    fair = fair_split(workers, {j: float(d) for j, d in demand.items()}, weight)
    ratios = [count[j] / fair[j] for j in weight if fair[j] > 0]
    return {"jain": jain(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
            "starved": float(sum(1 for j in weight if count[j] == 0 and demand[j] > 0)),
            "moved_last_round": moved / workers, "idle": float(sum(1 for x in on if x is None)) / workers}


def main() -> None:
    """Print the figures of each load."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loads", default="0.5,1.0,2.0,5.0", help="total demand / supply, comma-separated")
    ap.add_argument("--stale", action="store_true", help="records refreshed once a round (every worker reads the same)")
    ap.add_argument("--rule", choices=["market", "uniform"], default="market")
    args = ap.parse_args()
    for load in (float(x) for x in args.loads.split(",")):
        f = run(args.workers, args.jobs, args.rounds, args.seed, load, args.stale, args.rule)
        print(f"{args.rule} load {load:g}{' stale' if args.stale else ''}: Jain {f['jain']:.3f}, workers/fair share {f['min_ratio']:.2f}-{f['max_ratio']:.2f}, "
              f"starved {int(f['starved'])}, idle {f['idle']:.3f}, moved in the last round {f['moved_last_round']:.3f}")


if __name__ == "__main__":
    main()
