"""Swarm-layer figures of a finished job: delta sizes, who uploaded the bytes, agreement, latency.

Pure functions over the trainers' final `JobStatus`es and the workers' ready-file reports
(`node.worker.main.Worker.report`); `swarmrl up` and `benchmarks/delta_gossip.py` print them.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from swarmrl.protocol.pb import swarm_pb2 as pb


def base_model_bytes(model_dir: Path) -> int:
    """Bytes of the base model's weight files (`*.safetensors`) in a prepared model folder."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def publish_times(st: pb.JobStatus) -> dict[int, float]:
    """Unix time each version was published, from the status history (`published_at`)."""
    return {int(h.policy_version): float(h.extra["published_at"]) for h in st.history if "published_at" in h.extra}


def propagation(published: dict[int, float], workers: dict[str, dict[str, Any]], job_id: str) -> list[float]:
    """Per version that every worker held: seconds from publish until the last worker held it."""
    held = [w.get("adapters", {}).get(job_id, {}).get("sync", {}).get("held_at", {}) for w in workers.values()]
    out = []
    for v, t in sorted(published.items()):
        times = [h.get(str(v)) for h in held]
        if held and all(x is not None for x in times):
            out.append(max(0.0, max(times) - t))
    return out


def upload_share(from_trainers: int, from_peers: int) -> float:
    """The share of the workers' adapter bytes that came from trainers (0.0 when none moved)."""
    total = from_trainers + from_peers
    return from_trainers / total if total else 0.0


def utilization(st: pb.JobStatus) -> dict[str, float | None]:
    """A trainer's step seconds, the part spent waiting in averaging / outer rounds, and the
    compute utilization (1 - wait / step seconds) over the steps of `st.history`."""
    total = sum(float(h.seconds) for h in st.history)
    wait = sum(float(h.extra.get("averaging_seconds", 0.0)) + float(h.extra.get("outer_seconds", 0.0))
               for h in st.history)
    return {"step_seconds": total, "round_wait_seconds": wait,
            "compute_utilization": 1.0 - wait / total if total > 0 else None}


def swarm_figures(statuses: list[pb.JobStatus], workers: dict[str, dict[str, Any]], job_id: str,
                  model_bytes: int) -> dict[str, Any]:
    """The summary fields of the swarm layer (see README: "Delta gossip figures").

    `workers` are the honest workers (the red-team drill's adversaries are not in it).
    trainer_upload_bytes: adapter bytes the trainers served to anything asking as a worker
    (adversaries included; the trainer counts them). peer_upload_bytes: bytes the workers served
    each other. trainer_upload_share: of the adapter bytes the workers received, the share that
    came from a trainer (the rest from peers), counted by the receivers, so in [0, 1].
    trainer_upload_vs_star: trainer_upload_bytes over what a star (every worker pulls every delta
    from a trainer) would send; it exceeds 1 when snapshots (late joiners), re-fetches or
    adversaries cost the trainer more than the star's deltas. trainer_sync_bytes: tensor bytes
    the trainers sent each other (per-step gradient rounds and DiLoCo outer rounds), all trainers.
    Per trainer, compute_utilization: its steps' time less the time they waited in averaging
    or outer rounds, over its steps' time (`round_wait_share` is the rest; None without steps).
    """
    head = statuses[0]
    deltas = [d for d in head.delta_bytes if d > 0]
    delta_median = int(statistics.median(deltas)) if deltas else 0
    reports = [w.get("adapters", {}).get(job_id, {}) for w in workers.values()]
    trainer_up = sum(int(st.upload_bytes.get("worker", 0)) for st in statuses)
    peer_up = sum(int(r.get("peer_upload_bytes", 0)) for r in reports)
    from_trainers = sum(int(r.get("sync", {}).get("bytes_from_trainer", 0)) for r in reports)
    from_peers = sum(int(r.get("sync", {}).get("bytes_from_peers", 0)) for r in reports)
    star = len(deltas) * len(workers) * delta_median
    lat = propagation(publish_times(head), workers, job_id)
    trainers_agree = len({(int(st.policy_version), bytes(st.adapter_hash)) for st in statuses}) == 1
    return {
        "trainers": len(statuses),
        "delta_bytes_per_version": delta_median,
        "adapter_bytes": int(head.adapter_bytes),
        "base_model_bytes": int(model_bytes),
        "delta_to_base_ratio": delta_median / model_bytes if model_bytes else 0.0,
        "trainer_upload_bytes": trainer_up,
        "trainer_upload_bytes_all": sum(int(v) for st in statuses for v in st.upload_bytes.values()),
        "peer_upload_bytes": peer_up,
        "worker_bytes_from_peers": from_peers,
        "worker_bytes_from_trainers": from_trainers,
        "trainer_upload_share": upload_share(from_trainers, from_peers),
        "trainer_upload_vs_star": trainer_up / star if star else 0.0,
        "propagation_s_median": statistics.median(lat) if lat else None,
        "propagation_s_max": max(lat) if lat else None,
        "trainers_agree": trainers_agree,
        "trainer_sync_bytes": sum(int(st.sync_bytes_sent) for st in statuses),
        "trainer_adapters": {st.trainer_id: {"version": int(st.policy_version), "hash": bytes(st.adapter_hash).hex(),
                                             "averaging_rounds": int(st.averaging_rounds),
                                             "averaging_solo": int(st.averaging_solo),
                                             "averaging_excluded": int(st.averaging_excluded),
                                             "state_syncs": int(st.state_syncs),
                                             "outer_rounds": int(st.outer_rounds),
                                             "sync_bytes_sent": int(st.sync_bytes_sent),
                                             "averaging_refused": dict(st.averaging_refused),
                                             **utilization(st)} for st in statuses},
    }
