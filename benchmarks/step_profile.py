"""Where the time of one main-job step goes, end to end, in one process.

A real trainer (`node.trainer.hosting.Trainer` behind its gRPC server on 127.0.0.1) hosts the
built-in arithmetic job; a real worker session (`JobSession`, HF backend) leases, catches up,
generates, grades, signs and submits over gRPC until a batch is pending; then the trainer takes
its step (`JobRuntime.train_step`: learner forward, backward, optimizer, publish, checkpoint).
Each phase is timed in wall seconds and in CPU seconds of this process (all its threads: the
gRPC server's admission work counts under submit); the CPU figure is the steadier one on a
shared machine. The learner's phases are read by wrapping its methods, not by a copy of its step.
Every process of `swarmrl up` gets one torch thread; so does this one (`--threads`).

The grading pool's subprocesses are not this process: their CPU is missing from the CPU column
(their wall time is in the wall column).

Printed as a table and as JSON (all steps with `--out`), the mean over the steps after the first
(warm-up), or the only step:
phase -> wall/cpu seconds and share of the step, worker overhead (grade + sign + submit over
generate), generated tokens/s. `--head checkpointed` scores the loss through the plain LM head
recomputed in backward (the path before `scoring._HeadLogprob`), for a before/after figure.

    .venv/bin/python benchmarks/step_profile.py --model gemma --steps 2
    .venv/bin/python benchmarks/step_profile.py --model gemma --steps 2 --head checkpointed
    .venv/bin/python benchmarks/step_profile.py --model tiny --steps 3
    .venv/bin/python benchmarks/step_profile.py --model gemma --steps 1 --job examples/jobs/reasoning_chain_sum.toml \
        -j environment.chat_template=false -j batch_groups=2     # a reasoning-gym job, 256-token completions

--job: a job file (e.g. a reasoning-gym task, docs/REASONING.md) instead of the built-in job; -j
overrides its fields (JSON values, as the CLI's -j).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from swarmrl.node.inference import build_backend, scoring
from swarmrl.node.models.base_model import prepare_base_model, resolve_model_name
from swarmrl.node.net.grpc_wire import connect
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.submitter.client import submit_job
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.hosting import Trainer
from swarmrl.node.trainer.service import serve
from swarmrl.node.worker.session import JobSession
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

WORKER = ("worker: lease", "worker: catch-up", "worker: generate", "worker: grade", "worker: sign",
          "worker: submit + admission")
TRAINER = ("trainer: forward", "trainer: backward", "trainer: optimizer", "trainer: publish",
           "trainer: checkpoint", "trainer: rest of step")


class Phases:
    """Wall and CPU seconds per named phase."""

    def __init__(self) -> None:
        self.wall: Counter[str] = Counter()
        self.cpu: Counter[str] = Counter()

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall[name] += time.perf_counter() - w0
            self.cpu[name] += time.process_time() - c0

    def since(self, before: Phases) -> Phases:
        """The seconds added after `before` (a `copy()` of this)."""
        out = Phases()
        out.wall, out.cpu = self.wall - before.wall, self.cpu - before.cpu
        return out

    def copy(self) -> Phases:
        out = Phases()
        out.wall, out.cpu = Counter(self.wall), Counter(self.cpu)
        return out

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.time(name):
                return fn(*args, **kwargs)
        return timed


def instrument(runtime: Any, phases: Phases) -> None:
    """Time the learner's forward (log-probs), gradients, optimizer, and the runtime's publish and
    checkpoint, by wrapping them on the instances (the step itself is untouched)."""
    learner = runtime.learner
    learner._logprobs = phases.wrap("trainer: forward", learner._logprobs)
    learner.compute_gradients = phases.wrap("gradients", learner.compute_gradients)
    learner.apply_gradients = phases.wrap("trainer: optimizer", learner.apply_gradients)
    runtime.publish = phases.wrap("trainer: publish", runtime.publish)
    runtime.checkpoint = phases.wrap("trainer: checkpoint", runtime.checkpoint)


def worker_round(session: JobSession, phases: Phases) -> int:
    """One lease, phase by phase (`JobSession.work_once`'s order). Returns the groups admitted."""
    with phases.time("worker: lease"):
        lease = session.request_lease()
    if lease is None:
        raise RuntimeError(f"no lease: {session.last_refusal}")
    with phases.time("worker: catch-up"):
        session.catch_up(lease.policy_version)
    prompts = session.env.prompts(session.spec.seed, list(lease.prompt_indices))
    with phases.time("worker: generate"):
        groups = session.generate(prompts, lease)
    with phases.time("worker: grade"):
        session.grade(prompts, groups)
    with phases.time("worker: sign"):
        envelope = session.sign(lease, groups)
    with phases.time("worker: submit + admission"):
        result = session.submit(lease, envelope, len(groups))
    return result.admitted


def one_step(session: JobSession, runtime: Any, phases: Phases) -> dict[str, float]:
    """Lease rounds until a batch is pending, then the trainer's step; returns counters."""
    tokens0, completions = session.stats.tokens, 0
    while runtime.ledger.count_pending(runtime.job_id) < runtime.spec.batch_min:
        worker_round(session, phases)
        completions += runtime.spec.prompts_per_lease * runtime.spec.group_size
    with phases.time("trainer: step"):
        row = runtime.train_step()
    return {"stepped": float(row is not None), "completions": float(completions),
            "tokens": float(session.stats.tokens - tokens0),
            "reward_mean": float(row["reward_mean"]) if row else float("nan")}


def breakdown(phases: Phases) -> dict[str, dict[str, float]]:
    """Per phase wall/cpu seconds and share of the step; derived: backward = gradients - forward,
    rest of step = step - (gradients + optimizer + publish + checkpoint)."""
    out: dict[str, dict[str, float]] = {}
    for kind in ("wall", "cpu"):
        t = getattr(phases, kind)
        derived = dict(t)
        derived["trainer: backward"] = t["gradients"] - t["trainer: forward"]
        derived["trainer: rest of step"] = t["trainer: step"] - sum(
            t[k] for k in ("gradients", "trainer: optimizer", "trainer: publish", "trainer: checkpoint"))
        total = sum(derived[k] for k in WORKER + TRAINER)
        for k in WORKER + TRAINER:
            row = out.setdefault(k, {})
            row[f"{kind}_s"] = derived[k]
            row[f"{kind}_share"] = derived[k] / total if total else float("nan")
        out.setdefault("total", {})[f"{kind}_s"] = total
    return out


def overhead(phases: Phases) -> dict[str, float]:
    """(grade + sign + submit) / generate, wall and CPU."""
    out = {}
    for kind in ("wall", "cpu"):
        t = getattr(phases, kind)
        extra = t["worker: grade"] + t["worker: sign"] + t["worker: submit + admission"]
        out[kind] = extra / t["worker: generate"] if t["worker: generate"] else float("nan")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    if args.head == "checkpointed":
        scoring._frozen_linear = lambda head: False   # type: ignore[assignment]
    name = resolve_model_name(args.model)
    path = prepare_base_model(name, args.cache_dir)
    if getattr(args, "job", None) is not None:
        from swarmrl.node.runtime.config import parse_override, set_dotted
        from swarmrl.node.tasks.job_file import load_job_file

        overrides: dict[str, Any] = {"steps": args.steps + 1, "seed": args.seed}
        for item in getattr(args, "j", []):
            set_dotted(overrides, *parse_override(item))
        spec = load_job_file(args.job, args.cache_dir, overrides, base_model=name).spec
    else:
        spec = builtin_job(name, args.cache_dir, steps=args.steps + 1, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="step-profile-") as tmp:
        trainer_key = Identity.generate()
        cfg = TrainerConfig(state_dir=Path(tmp) / "state", cache_dir=args.cache_dir, threads=args.threads)
        trainer = Trainer(cfg, trainer_key)
        server, port = serve(trainer, "127.0.0.1", 0, cfg.max_message_mb)
        try:
            endpoint = f"127.0.0.1:{port}"
            job_id = submit_job(endpoint, Identity.generate(), spec)
            runtime = trainer.jobs[job_id]
            record = pb.JobRecord(job_id=job_id, trainer_id=trainer_key.peer_id, endpoint=endpoint,
                                  spec_json=spec.canonical_json(), trainer_public_key=trainer_key.public_key)
            backend = build_backend("hf", path)
            backend.add_slot(job_id, spec.lora)
            worker = Identity.generate()
            session = JobSession(record, connect(record, max_message_mb=64, peer_id=worker.peer_id), identity=worker,
                                 backend=backend, max_prompts=spec.prompts_per_lease, grade_timeout_s=30)
            phases, steps = Phases(), []
            instrument(runtime, phases)
            for _ in range(args.steps):
                before = phases.copy()
                counters = one_step(session, runtime, phases)
                step = phases.since(before)
                steps.append({"breakdown": breakdown(step), "worker_overhead": overhead(step), **counters,
                              "generated_tok_per_s": counters["tokens"] / step.wall["worker: generate"]})
            session.close()
        finally:
            server.stop(0)
    return {"model": name, "head": args.head, "threads": args.threads, "group_size": spec.group_size,
            "batch_groups": spec.batch_groups, "prompts_per_lease": spec.prompts_per_lease,
            "max_new_tokens": spec.sampling.max_new_tokens, "steps": steps, "mean_after_warmup": mean(steps[1:])}


def mean(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean of the steps' breakdown, overhead and tokens/s (empty when there are none)."""
    if not steps:
        return {}
    keys = steps[0]["breakdown"].keys()
    br = {k: {f: sum(s["breakdown"][k][f] for s in steps) / len(steps) for f in steps[0]["breakdown"][k]}
          for k in keys}
    return {"breakdown": br,
            "worker_overhead": {k: sum(s["worker_overhead"][k] for s in steps) / len(steps) for k in ("wall", "cpu")},
            "generated_tok_per_s": sum(s["generated_tok_per_s"] for s in steps) / len(steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=2, help="steps to profile; the first is a warm-up")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--head", choices=("function", "checkpointed"), default="function")
    p.add_argument("--cache-dir", type=Path)
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--job", type=Path, help="a job file instead of the built-in job")
    p.add_argument("-j", action="append", default=[], metavar="FIELD=VALUE", help="job field override (JSON value)")
    args = p.parse_args()
    result = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print_table(result)
    print(json.dumps(result["mean_after_warmup"] or result["steps"][-1]))


def print_table(result: dict[str, Any]) -> None:
    """The phases of the mean step after warm-up (or the only step) as a table."""
    from rich.console import Console
    from rich.table import Table

    figures = result["mean_after_warmup"] or result["steps"][-1]
    table = Table(title=f"one step of the main job ({result['model']}, head: {result['head']}, "
                        f"{result['threads']} thread(s))")
    for col in ("phase", "wall s", "wall %", "cpu s", "cpu %"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for phase, row in figures["breakdown"].items():
        wall, cpu = (f"{100 * row[k]:.1f}" if k in row else "" for k in ("wall_share", "cpu_share"))
        table.add_row(phase, f"{row['wall_s']:.3f}", wall, f"{row['cpu_s']:.3f}", cpu)
    Console().print(table)
    oh = figures["worker_overhead"]
    print(f"worker overhead (grade + sign + submit) / generate: wall {100 * oh['wall']:.2f}%, "
          f"cpu {100 * oh['cpu']:.2f}% (grading subprocesses' CPU not counted); "
          f"generated {figures['generated_tok_per_s']:.1f} tok/s")


if __name__ == "__main__":
    main()
