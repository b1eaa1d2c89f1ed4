"""Every job the swarm announces, as `swarmrl status` (no job id) lists it: read from the signed
DHT job records (node/swarm/dht.py) and the workers' environment records (env_records.py).

Per job (its records merged over its trainers): the trainers announcing it, its head version,
whether it is done, its demand (`pb.Demand`: capacity summed over its trainers, intake per minute
summed, weight the highest announced), the workers that can serve it (base model and
environment, `env_records.serving`), its share of the swarm's intake and its weighted share
among the running jobs (`protocol.market.intake_shares`, `weight_shares`). A record whose spec
does not parse or whose demand is missing is listed with the reason, not dropped silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.node.swarm.env_records import serving
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.market import Offer, intake_shares, weight_shares
from swarmrl.protocol.pb import swarm_pb2 as pb


@dataclass(frozen=True)
class JobListing:
    """One job as the swarm announces it (module docstring). share: of the running jobs' intake;
    fair_share: weight / total weight of the running jobs (what it gets when all want more);
    both None for a job that is done or whose record is unsound (`problem`)."""

    job_id: str
    name: str
    base_model: str
    environment: str
    trainers: int
    head_version: int
    total_steps: int
    done: bool
    capacity: int
    intake_per_min: float
    weight: float
    serving_workers: int
    unserved_reason: str
    share: float | None
    fair_share: float | None
    problem: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The listing as JSON-ready data (`swarmrl status --json`)."""
        return asdict(self)


def list_jobs(records: Sequence[VerifiedRecord], workers: Sequence[pb.WorkerEnvs]) -> list[JobListing]:
    """The jobs of `records` (verified job records, any number per job), one listing each,
    running jobs first, then by name and id."""
    by_job: dict[str, list[pb.JobRecord]] = {}
    for r in records:
        by_job.setdefault(r.record.job_id, []).append(r.record)
    rows = [_one(job_id, recs, workers) for job_id, recs in by_job.items()]
    running = [Offer(r.job_id, r.capacity, r.intake_per_min, r.weight) for r in rows if not r.done and not r.problem]
    intake, fair = intake_shares(running), weight_shares(running)
    rows = [JobListing(**{**asdict(r), "share": intake.get(r.job_id), "fair_share": fair.get(r.job_id)}) for r in rows]
    return sorted(rows, key=lambda r: (r.done, r.name, r.job_id))


def _one(job_id: str, recs: list[pb.JobRecord], workers: Sequence[pb.WorkerEnvs]) -> JobListing:
    head = max(recs, key=lambda r: r.head_version)
    problem, name, steps, environment, able, why = "", "?", 0, head.environment, 0, ""
    try:
        spec = JobSpec.from_json(head.spec_json)
        name, steps, environment = spec.name, spec.steps, spec.environment_id
        found = serving(spec, workers)
        able, why = found.workers, found.reason
    except ValueError as exc:
        problem = f"its spec does not parse: {str(exc).splitlines()[0][:120]}"
    with_demand = [r for r in recs if r.HasField("demand")]
    if not with_demand and not problem:
        problem = "no demand announced (workers ignore it)"
    weight = max((r.demand.weight for r in with_demand), default=0.0)
    if not problem and not weight > 0:
        problem = f"weight {weight} is not > 0 (workers ignore it)"
    return JobListing(job_id=job_id, name=name, base_model=head.base_model, environment=environment,
                      trainers=len({r.trainer_id for r in recs}), head_version=int(head.head_version),
                      total_steps=steps, done=all(r.done for r in recs),
                      capacity=sum(max(0, int(r.demand.capacity)) for r in with_demand),
                      intake_per_min=sum(max(0.0, r.demand.intake_per_min) for r in with_demand), weight=weight,
                      serving_workers=able, unserved_reason=why, share=None, fair_share=None, problem=problem)


def read_jobs(initial_peers: Sequence[str]) -> list[JobListing]:
    """Join the swarm through `initial_peers` as a client DHT node, read every job record and
    worker record, list the jobs, leave.

    Raises:
        SwarmError: none of the initial peers could be reached.
    """
    from swarmrl.node.swarm.dht import find_jobs, start_dht
    from swarmrl.node.swarm.env_records import find_worker_envs

    dht = start_dht(initial_peers, client_mode=True)
    try:
        return list_jobs(find_jobs(dht), find_worker_envs(dht))
    finally:
        dht.shutdown()
