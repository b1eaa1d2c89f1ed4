"""What `swarmrl up` leaves behind: summary.json's job and red-team figures, metrics.csv,
reward.png, and the summary table it prints.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

METRIC_COLUMNS = ("step", "policy_version", "reward_mean", "groups_trained", "groups_rejected", "staleness_mean",
                  "loss", "seconds")
"""metrics.csv's first columns (fields of a StepSummary); the steps' `extra` figures follow."""


def summarize(st: pb.JobStatus, spec: JobSpec, job_id: str, version: int, adapter_hash: bytes,
              workers: dict[str, dict[str, Any]], keys: dict[str, Identity], seconds: float) -> dict[str, Any]:
    """The job's part of summary.json.

    reward_first / reward_last: mean of the per-step mean rewards over the first / last
    `reward_window` steps (5 from 20 steps on, fewer in shorter runs); reward_last_step: the last
    step's alone (what the live status line shows). groups_admitted: every admitted group,
    pending, dropped (stale, banned), trained and no_signal alike; groups_trained: those trained
    into versions; groups_no_signal: those consumed by batches with no learning signal;
    zero_variance_token_share: of the completion tokens admitted (this trainer process's run),
    the share in groups with all-equal rewards; prompts_skipped: indices `lease_filter =
    "signal"` passed over (`protocol.prompt_signal`). The other parts: `red_team_summary`,
    `swarm_figures` (node/swarm/figures.py) and `disk` (`DiskWatch.report`).
    """
    rewards = [h.reward_mean for h in st.history if not math.isnan(h.reward_mean)]
    k = max(1, min(5, len(rewards) // 4 or 1))
    worker_hashes = {w: s.get("adapters", {}).get(job_id, {}) for w, s in workers.items()}
    agree = all(h.get("hash") == adapter_hash.hex() and h.get("version") == version for h in worker_hashes.values())
    return {
        "job_id": job_id, "base_model": spec.base_model, "environment": spec.environment_id, "loss": spec.loss.variant,
        "final_version": int(st.policy_version), "steps": int(st.step),
        "reward_first": sum(rewards[:k]) / k if rewards else math.nan,
        "reward_last": sum(rewards[-k:]) / k if rewards else math.nan,
        "reward_last_step": rewards[-1] if rewards else math.nan,
        "reward_window": k,
        "groups_admitted": int(st.groups_admitted), "groups_dropped": int(st.groups_dropped),
        "groups_trained": int(st.groups_trained), "groups_no_signal": int(st.groups_no_signal),
        "groups_rejected": dict(st.groups_rejected),
        "tokens_admitted": int(st.tokens_admitted),
        "zero_variance_token_share": st.tokens_zero_variance / st.tokens_admitted if st.tokens_admitted else None,
        "prompts_skipped": int(st.prompts_skipped),
        "validator": {"checked": int(st.validator_checked), "failed": int(st.validator_failed)},
        "serving_workers": int(st.serving_workers) if st.HasField("serving_workers") else None,
        "peers": [p.peer_id for p in st.peers],
        "roles": {name: ident.peer_id for name, ident in keys.items()},
        "adapter_hash": adapter_hash.hex(), "adapter_hash_agreement": agree,
        "worker_adapters": worker_hashes, "seconds": round(seconds, 1),
        "staleness_mean": sum(h.staleness_mean for h in st.history) / max(1, len(st.history)),
    }


BENIGN_REJECTIONS = frozenset({"stale", "lease_expired", "duplicate_group", "banned", "future_version",
                               "unknown_lease", "unknown_job"})
"""Rejections an honest worker can earn (slow, late, raced): they don't count as detection."""


def red_team_summary(st: pb.JobStatus, adversaries: dict[str, str], states: dict[str, dict[str, Any]],
                     keys: dict[str, Identity], honest: list[str]) -> dict[str, Any]:
    """The drill's figures: per mode {submitted, admitted_before_ban, detected, seconds_to_ban, ...};
    honest workers banned; groups dropped because of bans.

    submitted: groups the adversary sent (its own count). admitted_before_ban: its groups the
    trainer admitted (nothing is admitted after a ban). detected: banned, or a failed verdict, or a
    rejection an honest worker can't earn (not in BENIGN_REJECTIONS). seconds_to_ban: the
    trainer's ban time minus the adversary's first submission (None: not banned).
    """
    peers = {p.peer_id: p for p in st.peers}
    table: dict[str, dict[str, Any]] = {}
    for name, mode in adversaries.items():
        p = peers.get(keys[name].peer_id)
        red = states.get(name, {}).get("red_team", {})
        first = red.get("first_submit_ms") or (p.first_seen_ms if p is not None else 0)
        cheats = {r: n for r, n in (p.rejected_by_reason.items() if p is not None else []) if r not in BENIGN_REJECTIONS}
        banned = p is not None and p.banned
        table[mode] = {
            "submitted": int(red.get("submitted_groups", 0)),
            "admitted_before_ban": int(p.groups_admitted) if p is not None else 0,
            "trained": int(p.groups_trained) if p is not None else 0,
            "detected": bool(banned or (p is not None and p.verdicts_failed > 0) or cheats),
            "banned": bool(banned), "ban_reason": p.ban_reason if p is not None else "",
            "seconds_to_ban": round((p.banned_at_ms - first) / 1000, 1) if p is not None and banned and first else None,
            "rejected": cheats, "verdicts_failed": int(p.verdicts_failed) if p is not None else 0,
        }
    honest_ids = {keys[w].peer_id for w in honest}
    return {"red_team": table, "honest_banned": sum(1 for p in st.peers if p.peer_id in honest_ids and p.banned),
            "groups_dropped_banned": int(st.groups_dropped_banned)}


def write_outputs(out: Path, st: pb.JobStatus, summary: dict[str, Any]) -> None:
    """Write `out`/metrics.csv (one row per step of `st.history`: METRIC_COLUMNS, then every
    `extra` figure any step has), summary.json and reward.png (reward per step, with a 5-step
    moving mean from 5 steps on)."""
    extra_keys = sorted({k for h in st.history for k in h.extra})
    with open(out / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*METRIC_COLUMNS, *extra_keys])
        for h in st.history:
            w.writerow([getattr(h, c) for c in METRIC_COLUMNS] + [h.extra.get(k, "") for k in extra_keys])
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    _plot_reward(out / "reward.png", st)


def _plot_reward(path: Path, st: pb.JobStatus) -> None:
    import matplotlib.pyplot as plt  # first: it waits for an import under way on another thread (warm_plotting)

    plt.switch_backend("Agg")   # not matplotlib.use: that calls a half-imported pyplot's switch_backend (AttributeError)

    steps = [h.step for h in st.history]
    rewards = [h.reward_mean for h in st.history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, marker=".", label="mean reward of the step's batch")
    if len(rewards) >= 5:
        w = 5
        smooth = [sum(rewards[max(0, i - w + 1):i + 1]) / len(rewards[max(0, i - w + 1):i + 1])
                  for i in range(len(rewards))]
        ax.plot(steps, smooth, label=f"moving mean ({w} steps)")
    ax.set_xlabel("trainer step (policy version)")
    ax.set_ylabel("reward")
    ax.set_title(f"swarmrl job {st.job_id[:12]}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_summary(summary: dict[str, Any], out: Path, console: Console | None = None) -> None:
    """Print summary.json's headline figures (and the red-team drill's, if any) as a table, to
    stdout unless `console` says otherwise: the summary is `up`'s result, while its progress and
    logs go to stderr (so `swarmrl up > summary.txt` keeps the result and shows the progress)."""
    table = Table(title="swarmrl up: summary")
    table.add_column("figure")
    table.add_column("value", overflow="fold")
    for key in ("job_id", "base_model", "environment", "loss", "final_version", "steps", "reward_first", "reward_last",
                "reward_last_step", "groups_admitted", "groups_dropped", "groups_rejected", "validator",
                "adapter_hash_agreement", "trainers", "delta_bytes_per_version", "adapter_bytes", "base_model_bytes",
                "trainer_upload_bytes", "peer_upload_bytes", "trainer_upload_share", "trainer_upload_vs_star",
                "seconds"):
        v = summary.get(key)
        window = {"reward_first": "first", "reward_last": "last"}.get(key)
        label = f"{key} (mean, {window} {summary['reward_window']})" if window else key
        table.add_row(label, f"{v:.3f}" if isinstance(v, float) else str(v))
    if "disk" in summary:
        d = summary["disk"]
        table.add_row("trainer disk", f"{d['trainer_bytes'] / 1e6:.2f} MB at the end, "
                      f"{d['trainer_peak_bytes'] / 1e6:.2f} MB at most")
    table.add_row("peers", str(len(summary["peers"])))
    if "audit" in summary:
        a = summary["audit"]
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(a.get("by_reason", {}).items()))
        table.add_row("credit audit" + (f" (trainer red team: {summary['trainer_red_team']})"
                                        if summary.get("trainer_red_team") else ""),
                      a["error"] if "error" in a else
                      f"{a['findings']} findings{' (' + reasons + ')' if reasons else ''}, honest flagged "
                      f"{a['honest_flagged']}; {a['statements']} statements, {a['batches_checked']} batches, "
                      f"{a['receipts_checked']} receipts checked in {a['seconds']:.2f} s")
    if "credit" in summary:
        table.add_row("credit (signed statements)", _credit(summary["credit"]))
    if summary.get("red_team"):
        table.add_row("honest_banned", str(summary["honest_banned"]))
        table.add_row("groups_dropped_banned", str(summary["groups_dropped_banned"]))
        for mode, r in summary["red_team"].items():
            table.add_row(f"red_team {mode}", f"detected={r['detected']} banned={r['banned']} "
                          f"submitted={r['submitted']} admitted={r['admitted_before_ban']} "
                          f"seconds_to_ban={r['seconds_to_ban']}")
    table.add_row("outputs", f"{out}/adapter, metrics.csv, reward.png, summary.json")
    (console or Console()).print(table)


def _credit(credit: dict[str, Any]) -> str:
    """One cell: each peer's credited groups, share and verified share (`credit_audit.credit_summary`)."""
    if "error" in credit:
        return str(credit["error"])
    peers = sorted(credit["peers"].items(), key=lambda kv: -kv[1]["groups"])
    cells = [f"{name[:16]} {p['groups']} ({p['share']:.0%}"
             + (f", verified {p['verified_share']:.0%}" if p["verified_share"] is not None else "")
             + (", banned" if p["banned"] else "") + ")" for name, p in peers]
    return f"{credit['groups']} groups over {credit['statements']} statements: " + ", ".join(cells)
