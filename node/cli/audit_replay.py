"""`swarmrl audit JOB --trainer HOST:PORT --replay N|all`: recompute a small job's steps from what
its statements credit, and check that each published version is that step (issue 27 item 3,
docs/CREDIT.md section 3).

The replay starts from version 0, the LoRA initialisation seeded by the job (`Learner`), and for
each version v in order: rebuilds the published W_v from the trainer's signed delta (checked by
hash), fetches the batches statement v credits (each checked against its worker's signature by
the audit), takes one learner step on exactly the credited groups from W_{v-1} (AdamW moments
carried from the earlier replayed steps, as the trainer's), and compares the published W_v with
the prediction (`protocol.step_replay`: same codec, same error feedback). A published version
that is not the credited step is `step_mismatch`. Every version before v is replayed too (the
optimizer's moments depend on all of them), so the cost is the trainer's training compute for
those steps: a check for small jobs and early versions (the trainer serves the deltas of its
last `max_async_level + keep_versions` versions: a replay from version 0 needs a trainer run
with `keep_versions` above the job's steps, or an auditor early in the job). A trainer that
averaged with cotrainers
took steps on gradients no statement of its own credits: such jobs are refused (exit 2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from swarmrl.node.cli.checks import UsageError

if TYPE_CHECKING:
    from swarmrl.node.audit.client import AuditClient
    from swarmrl.protocol.jobspec import JobSpec
    from swarmrl.protocol.pb import swarm_pb2 as pb


@dataclass
class ReplayResult:
    """What a replay did: versions compared, the largest mismatch among them, why it stopped
    before the chain's head ("" when it reached it or its limit), mean CPU-seconds per step."""

    versions: int = 0
    worst: float = 0.0
    stopped: str = ""
    step_s: float = 0.0
    findings: list[pb.AuditFinding] = field(default_factory=list)


def check_replayable(status: pb.JobStatus, spec: JobSpec) -> None:
    """Refuse a job whose steps were not this trainer's alone.

    Raises:
        UsageError: DiLoCo sync, or a trainer that averaged with cotrainers or adopted their state.
    """
    if spec.sync == "diloco":
        raise UsageError("--replay: the job syncs by DiLoCo outer steps (other trainers' pseudo-gradients enter "
                         "every outer version); replay covers jobs whose trainer stepped alone")
    if status.averaging_rounds or status.state_syncs:
        raise UsageError(f"--replay: the trainer averaged {status.averaging_rounds} steps with cotrainers and adopted "
                         f"their state {status.state_syncs} times; replay covers jobs whose trainer stepped alone")


def replay(client: AuditClient, job_id: str, trainer_id: str, statements: list[pb.ContributionStatement],
           spec: JobSpec, model_path: Path, versions: int | None) -> ReplayResult:
    """Replay the first `versions` versions of the chain `statements` (None: all) on the base
    model at `model_path`; returns what it found (see the module docstring)."""
    import grpc

    from swarmrl.node.net.call_status import code_name
    from swarmrl.node.trainer.learner import Learner
    from swarmrl.protocol import adapter as ad
    from swarmrl.protocol import audit, step_replay
    from swarmrl.protocol.updates import AdapterReplica

    out = ReplayResult()
    if not statements or statements[0].version != 1:
        out.stopped = "the chain does not start at version 1 (a cotrainer that joined late): nothing to replay from"
        return out
    learner = Learner(model_path, spec)
    prev = learner.state()
    replica = AdapterReplica(job_id, b"", state=prev, version=0, hash=ad.adapter_hash(prev))
    residual: ad.State = {}
    cpu = 0.0
    for st in statements[:versions]:
        try:
            for update in client.updates(job_id, st.version - 1, st.version, trainer_id):
                replica.apply(update)
        except ad.AdapterError as exc:
            out.stopped = f"version {st.version}: {exc} (a replayed version 0 unlike the trainer's: another torch build?)"
            break
        except Exception as exc:  # noqa: BLE001 - a pruned version or a failed call: stop, not a finding
            why = code_name(exc) if isinstance(exc, grpc.RpcError) else type(exc).__name__
            out.stopped = (f"the trainer no longer serves version {st.version} ({why}; a trainer keeps "
                           "max_async_level + keep_versions versions: replay early, or run it with a larger "
                           "keep_versions)")
            break
        groups = _credited_groups(client, job_id, st)
        if groups is None:
            out.stopped = f"a batch credited at version {st.version} is no longer kept"
            break
        assert replica.state is not None and replica.version == st.version
        published = replica.state
        t0 = time.process_time()
        metrics = learner.step(groups, st.version - 1) if groups else None
        cpu += time.process_time() - t0
        step_delta, _ = ad.make_delta(prev, learner.state() if metrics and metrics["stepped"] else prev)
        m, x = min(((step_replay.mismatch(p, published, prev), x) for p, x in
                    (step_replay.predict(prev, step_delta, r, spec.delta_codec) for r in (residual, {}))),
                   key=lambda mx: mx[0])   # with the carried residual, or none (a restarted trainer)
        if m > step_replay.TOLERANCE:
            out.findings.append(audit.finding(audit.STEP_MISMATCH, version=st.version, detail=(
                f"the published version is {m:.3g} of its own change away from one step on the {len(groups)} "
                f"credited groups (tolerance {step_replay.TOLERANCE})")))
        else:
            out.worst = max(out.worst, m)
        residual = step_replay.next_residual(x, prev, published, spec.delta_codec)
        prev = published
        learner.load_state(published)
        out.versions += 1
    out.step_s = cpu / max(1, out.versions)
    return out


def _credited_groups(client: AuditClient, job_id: str, st: pb.ContributionStatement) -> list[pb.Group] | None:
    """The groups statement `st` credits, from the batches the trainer serves (None when one is
    no longer kept; a batch that is not its worker's is the audit's finding, not the replay's)."""
    from swarmrl.protocol import signing
    from swarmrl.protocol.pb import swarm_pb2 as pb

    served = client.batches(job_id, [bytes(b.batch_id).hex() for b in st.batches])
    groups: list[pb.Group] = []
    for credited in st.batches:
        got = served.get(bytes(credited.batch_id).hex())
        if got is None:
            return None
        try:
            batch, _ = signing.open_signed(got.batch, signing.ROLLOUT_BATCH, pb.RolloutBatch)
        except signing.SignatureError:
            continue   # forged_batch: the audit's finding; its groups are not replayed
        want = set(credited.prompt_indices)
        groups += [g for g in batch.groups if g.prompt_index in want]
    return groups


def model_for(spec: JobSpec, cache_dir: Path | None) -> Path:
    """The job's base model folder (its weights' sha256 checked).

    Raises:
        UsageError: not in the cache (and not one this machine can build).
    """
    from swarmrl.node.models.base_model import find_base_model_by_sha

    try:
        return find_base_model_by_sha(spec.base_model, spec.base_model_sha256, (), cache_dir)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"--replay: the job's base model {spec.base_model} is not here ({exc})") from exc
