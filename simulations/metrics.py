"""What a run measured: counters while it runs, then summary.json, timeline.csv and plots.

Waste categories (shares of groups generated): `stale` (outside the staleness window at
admission or at the step, or answered after the lease expired), `churn` (the worker left mid-lease),
`banned` (dropped with a banned peer, or refused because it was banned), `rejected` (refused at
admission for any other reason, e.g. a forged signature), `trainer_lost` (pending on a trainer
that died).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmrl.protocol import admission as adm

if TYPE_CHECKING:
    from swarmrl.simulations.gossip import VersionSpread
    from swarmrl.simulations.population import Worker

WASTE = ("stale", "churn", "banned", "rejected", "trainer_lost")
_STALE_REASONS = frozenset({adm.STALE, adm.LEASE_EXPIRED, adm.UNKNOWN_LEASE, adm.FUTURE_VERSION})


class Metrics:
    """Counters and series of one run."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.wasted: Counter[str] = Counter()
        self.ingest_by_s: Counter[int] = Counter()
        self.bans: dict[str, str] = {}
        self.steps: list[tuple[float, int, int]] = []   # (time, version, groups trained)
        self.statements: list[tuple[float, int, int, int]] = []   # (time, version, trainer rank, batches credited)
        self.verdict_delay_s: list[float] = []
        self.timeline: list[dict[str, Any]] = []

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to counter `name`."""
        self.counts[name] += n

    def reject(self, reason: str, n: int) -> None:
        """Count `n` groups refused for `reason` and book them as stale, banned or rejected waste."""
        self.rejected[reason] += n
        if reason in _STALE_REASONS:
            self.waste("stale", n)
        elif reason == adm.BANNED:
            self.waste("banned", n)
        else:
            self.waste("rejected", n)

    def waste(self, kind: str, n: int) -> None:
        """Count `n` wasted groups of `kind` (one of WASTE; AssertionError otherwise)."""
        assert kind in WASTE, kind
        self.wasted[kind] += n

    def ingest(self, now_s: float, n: int) -> None:
        """Count `n` groups admitted in the simulated second containing `now_s`."""
        self.ingest_by_s[int(now_s)] += n

    def ban_reason(self, w: Worker, why: str) -> None:
        """Remember why `w` was banned (the first reason only)."""
        self.bans.setdefault(w.peer_id, why)


def quantile(xs: list[float], q: float) -> float | None:
    """The `q` quantile (nearest rank, in [0, 1]) of the finite values of `xs`, rounded to 3
    places; None when there is none."""
    xs = sorted(x for x in xs if math.isfinite(x))
    if not xs:
        return None
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def summarize(m: Metrics, *, scenario: dict[str, Any], sim_s: float, wall_s: float, version: int, workers: list[Worker],
              spreads: list[VersionSpread], trainer_bytes: int, peer_bytes: int, trainers: int,
              interrupted: bool, job_start_s: float, fetches_failed: dict[str, int] | None = None,
              uplink_queue_s_max: dict[str, float] | None = None,
              events: dict[str, int] | None = None) -> dict[str, Any]:
    """The run's figures (summary.json). `fetches_failed`: adapter fetches that timed out or lost
    their sender, by source ("peer", "trainer"); `uplink_queue_s_max`: the longest a fetch's
    first byte waited on the sender's uplink (s), by source; `events`: the events processed, SimPy's
    (processes' steps, timeouts) and the gossip's (decisions, announcements, wait ends, retries)."""
    generated = max(1, m.counts["groups_generated"])
    ingest = [m.ingest_by_s.get(s, 0) / trainers for s in range(int(sim_s))]
    last_step_s = m.steps[-1][0] if m.steps else None
    stepping_s = (last_step_s or 0.0)
    return {
        "scenario": scenario.get("name", "custom"), "simulated_s": round(sim_s, 1), "wall_s": round(wall_s, 1),
        "interrupted": interrupted, "workers_total": len(workers), "trainers": trainers,
        "events": dict(events or {}),
        "versions": version, "versions_per_hour": round(version / (sim_s / 3600), 1) if sim_s else 0.0,
        "steps_per_minute": round(version / (stepping_s / 60), 2) if version and stepping_s else 0.0,
        "seconds_to_last_step": round(last_step_s, 2) if last_step_s is not None else None,
        "groups_generated": m.counts["groups_generated"], "groups_admitted": m.counts["groups_admitted"],
        "groups_trained": sum(n for _, _, n in m.steps),
        "leases_issued": m.counts["leases_issued"], "leases_expired": m.counts["leases_expired"],
        "prompts_reissued": m.counts["prompts_reissued"],
        "wasted_share": {k: round(m.wasted[k] / generated, 4) for k in WASTE},
        "wasted_share_total": round(sum(m.wasted.values()) / generated, 4),
        "rejected": dict(sorted(m.rejected.items())),
        "propagation": _propagation(spreads),
        "bytes": _bytes(spreads, trainer_bytes, peer_bytes, version),
        "fetches_failed": dict(fetches_failed or {}), "adapter_behind": m.counts["adapter_behind"],
        "uplink_queue_s_max": {k: round(v, 1) for k, v in (uplink_queue_s_max or {}).items()},
        "cheaters": _cheaters(workers, m),
        "honest_banned": sum(1 for w in workers if not w.cheater and math.isfinite(w.banned_s)),
        "trainer_ingest_groups_per_s": {"mean": round(statistics.fmean(ingest), 3) if ingest else 0.0,
                                        "p99": quantile(ingest, 0.99), "max": max(ingest, default=0)},
        "verdict_delay_s": {"p50": quantile(m.verdict_delay_s, 0.5), "p95": quantile(m.verdict_delay_s, 0.95)},
        "worker_busy_share": busy_share(workers, sim_s),
        "trainer_loss": _trainer_loss(m, spreads, scenario.get("trainers", {}).get("lost_at_s", -1.0), sim_s),
    }


def _trainer_loss(m: Metrics, spreads: list[VersionSpread], lost_s: float, sim_s: float) -> dict[str, Any] | None:
    """Before and after a trainer's loss at `lost_s` (s): versions and groups trained per hour,
    reach-95% p50 (s) of the versions published in each part (None without a loss)."""
    if lost_s < 0 or not 0 < lost_s < sim_s:
        return None
    out: dict[str, Any] = {"lost_at_s": lost_s}
    for part, lo, hi in (("before", 0.0, lost_s), ("after", lost_s, sim_s)):
        hours = (hi - lo) / 3600
        steps = [(v, n) for t, v, n in m.steps if lo <= t < hi]
        reach = [s.reach_s["95"] for s in spreads if lo <= s.published_s < hi and s.live]
        out[part] = {"versions_per_hour": round(len(steps) / hours, 1),
                     "groups_trained_per_hour": round(sum(n for _, n in steps) / hours),
                     "reach_95_s_p50": quantile(reach, 0.5),
                     "trainer_upload_per_version": round(statistics.fmean(
                         [s.trainer_bytes for s in spreads if lo <= s.published_s < hi] or [0])),
                     "failed_fetches": sum(s.failed_peer_fetches + s.failed_trainer_fetches for s in spreads
                                           if lo <= s.published_s < hi)}
    return out


def _propagation(spreads: list[VersionSpread]) -> dict[str, Any]:
    out = {}
    for q in ("50", "95", "99"):
        xs = [s.reach_s[q] for s in spreads if s.live]
        out[f"reach_{q}_s"] = {"p50": quantile(xs, 0.5), "p95": quantile(xs, 0.95),
                               "never": sum(1 for x in xs if not math.isfinite(x))}
    return out


def _bytes(spreads: list[VersionSpread], trainer_bytes: int, peer_bytes: int, version: int) -> dict[str, Any]:
    per_version = [s.trainer_bytes for s in spreads]
    total = trainer_bytes + peer_bytes
    return {"trainer_upload": trainer_bytes, "peer_upload": peer_bytes, "total_upload": total,
            "trainer_upload_per_version_mean": round(statistics.fmean(per_version)) if per_version else 0,
            "peer_share": round(peer_bytes / total, 4) if total else 0.0}


def _cheaters(workers: list[Worker], m: Metrics) -> dict[str, Any]:
    by: dict[str, dict[str, Any]] = defaultdict(lambda: {"workers": 0, "submitted": 0, "banned": 0, "to_ban_s": []})
    for w in workers:
        if not w.cheater:
            continue
        row = by[w.mode]
        row["workers"] += 1
        if math.isfinite(w.first_submit_s):
            row["submitted"] += 1
            if math.isfinite(w.banned_s):
                row["banned"] += 1
                row["to_ban_s"].append(w.banned_s - w.first_submit_s)
    out = {}
    for mode, row in sorted(by.items()):
        t = row.pop("to_ban_s")
        out[mode] = {**row, "to_ban_s_p50": quantile(t, 0.5), "to_ban_s_p95": quantile(t, 0.95), "to_ban_s_max": quantile(t, 1.0)}
    return out


def busy_share(workers: list[Worker], sim_s: float) -> float:
    """The share of the workers' lived seconds (up to `sim_s`) spent generating."""
    lived = sum(max(0.0, min(w.leaves_s, sim_s) - w.joined_s) for w in workers)
    return round(sum(w.generating_s for w in workers) / lived, 4) if lived else 0.0


TIMELINE_FIELDS = ("t_s", "version", "live_workers", "waiting_workers", "pending_groups", "groups_admitted",
                   "groups_wasted", "cheaters_banned", "trainer_upload_bytes", "peer_upload_bytes", "ingest_groups_per_s")


def write_outputs(out: Path, summary: dict[str, Any], m: Metrics, spreads: list[VersionSpread]) -> list[Path]:
    """summary.json, timeline.csv and the plots; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=_inf) + "\n")
    with open(out / "timeline.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=TIMELINE_FIELDS)
        wr.writeheader()
        wr.writerows(m.timeline)
    return [out / "summary.json", out / "timeline.csv", *_plots(out, m, spreads)]


def _inf(x: object) -> object:
    raise TypeError(f"not JSON: {x!r}")


def _plots(out: Path, m: Metrics, spreads: list[VersionSpread]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] / 3600 for r in m.timeline]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    axes[0][0].plot(t, [r["version"] for r in m.timeline])
    axes[0][0].set(title="policy version", xlabel="hours")
    for q in ("50", "95", "99"):
        axes[0][1].plot([s.published_s / 3600 for s in spreads],
                        [min(s.reach_s[q], 600) for s in spreads], label=f"{q}% of live workers")
    axes[0][1].set(title="seconds for a version to reach (capped at 600)", xlabel="hours")
    axes[0][1].legend()
    axes[1][0].plot(t, [r["ingest_groups_per_s"] for r in m.timeline], label="admitted groups/s per trainer")
    axes[1][0].plot(t, [r["waiting_workers"] for r in m.timeline], label="workers told busy")
    axes[1][0].set(title="trainer ingest", xlabel="hours", yscale="symlog")
    axes[1][0].legend()
    axes[1][1].plot(t, [r["trainer_upload_bytes"] / 1e9 for r in m.timeline], label="trainers")
    axes[1][1].plot(t, [r["peer_upload_bytes"] / 1e9 for r in m.timeline], label="peers")
    axes[1][1].set(title="delta bytes uploaded (GB, cumulative)", xlabel="hours")
    axes[1][1].legend()
    fig.tight_layout()
    path = out / "swarm.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]
