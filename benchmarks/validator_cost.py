"""Validator cost and honest false positives: the full ladder on honest rollouts.

An honest worker (the same calls `JobSession.generate` / `grade` make) answers leases of the
built-in arithmetic job with the adapter at version 1; a validator checks every group with the
full ladder (sample rate 1: structure, freshness, duplicate, regrade, logprob, plausibility).
Prints:
- worker seconds per generated rollout (generation; generation + grading),
- validator seconds per checked rollout, and the ratio validator / worker;
- honest false positives (failed verdicts; target 0) over the checked rollouts;
- the log-prob recomputation alone, two ways on the same groups: one prefill of the group's prompt
  shared by its G completions (what the validator does) against one prefill of prompt +
  completion per completion (the baseline), as seconds per rollout and their ratio, with the
  largest log-prob difference between the two;
- the margins: the logprob rung's tolerance against the honest group-mean and per-token gaps
  (distribution: median, p99, max), and the plausibility threshold against the worst honest
  log e-value.
Usage (one torch thread, as each process of a local swarm has):

    .venv/bin/python benchmarks/validator_cost.py --model tiny --rollouts 2000 [--adapter runs/x/adapter]
    .venv/bin/python benchmarks/validator_cost.py --model gemma --rollouts 200 [--adapter runs/gemma1/adapter]
    .venv/bin/python benchmarks/validator_cost.py --model gemma --rollouts 64 \
        --job examples/jobs/reasoning_chain_sum.toml -j sampling.max_new_tokens=256   # 256-token completions

--job: a job file (e.g. a reasoning-gym task, docs/REASONING.md) instead of the built-in arithmetic
job; its prompts are rendered as workers render them (chat template included). Worker and
validator time are also reported in CPU seconds of this process (the grading pool's subprocess
CPU aside): on a shared machine their ratio moves less than the wall-clock one.

--adapter: a PEFT folder from a swarmrl run used as version 1 (default: the job's LoRA
initialisation with its B matrices perturbed by N(0, --b-std), so that the adapter matters).
Legend: G = completions per group.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from swarmrl.node.inference import build_backend
from swarmrl.node.inference.base import Sampling
from swarmrl.node.models.base_model import prepare_base_model, resolve_model_name
from swarmrl.node.models.causal_lm import render_prompt
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.tasks.grading import GradingPool
from swarmrl.node.tasks.job_file import grader_for, load_job_file
from swarmrl.protocol import signing
from swarmrl.protocol.envs import get_environment, job_environment
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.validator import checks as ck
from swarmrl.validator.adapters import InMemoryAdapters
from swarmrl.validator.plausibility import completion_plausibility
from swarmrl.validator.reputation import Reputation
from swarmrl.validator.rescoring import rescore
from swarmrl.validator.seen import SeenStore
from swarmrl.validator.validator import Validator, ValidatorSettings

WORKER, JOB = "worker", "bench-job"


def _versions(backend, spec, adapter: Path | None, b_std: float) -> dict[int, dict[str, torch.Tensor]]:
    backend.add_slot("template", spec.lora)
    v0 = backend.adapter_state("template")
    backend.remove_adapter("template")
    if adapter is not None:
        from safetensors.torch import load_file

        v1 = {k: v.float() for k, v in load_file(str(adapter / "adapter_model.safetensors")).items()}
        missing = set(v0) ^ set(v1)
        if missing:
            raise ValueError(f"adapter keys differ from the job's LoRA shape: {sorted(missing)[:3]}")
    else:
        gen = torch.Generator().manual_seed(1)
        v1 = {k: v + (b_std * torch.randn(v.shape, generator=gen) if "lora_B" in k else 0) for k, v in v0.items()}
    return {0: v0, 1: v1}


def admitted_batch(me: Identity, groups: list[pb.Group], seq: int, job: str = JOB) -> pb.AdmittedBatch:
    """`groups` as the trainer's SampleAdmitted stream hands them to a validator: a signed batch
    under a lease of `me` at policy version 1 (also used by benchmarks/episode_cost.py)."""
    lease = pb.Lease(lease_id=f"lease-{seq}", job_id=job, peer_id=me.peer_id,
                     prompt_indices=[g.prompt_index for g in groups], policy_version=1)
    batch = pb.RolloutBatch(job_id=job, lease_id=lease.lease_id, peer_id=me.peer_id, groups=groups, created_ms=1,
                            nonce=os.urandom(8))
    return pb.AdmittedBatch(seq=seq, batch=signing.sign(me, signing.ROLLOUT_BATCH, batch), lease=lease,
                            admitted_prompt_indices=[g.prompt_index for g in groups])


def _quantiles(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"median": statistics.median(s), "p99": s[min(len(s) - 1, int(0.99 * len(s)))], "max": s[-1]}


def _add_gaps(g: pb.Group, scored: list, group_gaps: list[float], token_gaps: list[float]) -> None:
    """Append the group's |claimed - recomputed| log-prob gaps: their mean, and each token's."""
    gaps = [x for c, r in zip(g.completions, scored) for x in ck.logprob_gaps(c.logprobs, r.logprobs_T.tolist())]
    group_gaps.append(statistics.fmean(gaps))
    token_gaps += gaps


def _nested(overrides: list[str]) -> dict:
    """`-j a.b=VALUE` overrides (JSON values) as a nested table, as the CLI's `-j` reads them."""
    from swarmrl.node.runtime.config import parse_override, set_dotted

    out: dict = {}
    for item in overrides:
        set_dotted(out, *parse_override(item))
    return out


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    name = resolve_model_name(args.model)
    path = prepare_base_model(name, args.cache_dir)
    if args.job is not None:
        spec = load_job_file(args.job, args.cache_dir, _nested(args.j), base_model=name).spec
        env = job_environment(spec)
        pool = grader_for(spec, 30.0)
    else:
        spec = builtin_job(name, args.cache_dir)
        env = get_environment(spec.environment, spec.env_version)
        pool = GradingPool(spec.environment, spec.env_version, timeout_s=30.0)
    backend = build_backend("hf", path)
    versions = _versions(backend, spec, args.adapter, args.b_std)
    backend.add_slot(WORKER, spec.lora)
    backend.set_adapter(WORKER, versions[1])
    validator = Validator(backend, seen=SeenStore(":memory:"), reputation=Reputation(":memory:"),
                          sampling_key=os.urandom(32), settings=ValidatorSettings(base_rate=1.0, logprob=None),
                          grader_factory=lambda n, v: pool)
    adapters = InMemoryAdapters(JOB, versions)
    me = Identity.generate()
    s = spec.sampling
    per_lease = spec.prompts_per_lease
    t_gen = t_grade = t_val = cpu_gen = cpu_val = 0.0
    tokens = 0
    rollouts = failed = 0
    fails: list[str] = []
    group_gaps: list[float] = []
    token_gaps: list[float] = []
    worst_e: list[float] = []
    t_shared = t_per_completion = 0.0
    base_group_gaps: list[float] = []   # the same gaps under the per-completion prefill (baseline)
    base_token_gaps: list[float] = []
    path_gap = 0.0
    index, seq = 0, 0
    while rollouts < args.rollouts:
        prompts = env.prompts(spec.seed, list(range(index, index + per_lease)))
        index += per_lease
        seq += 1
        ids = [render_prompt(backend.tokenizer, p, spec.chat_template) for p in prompts]
        sampling = Sampling(n=spec.group_size, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                            top_p=s.top_p, stop=tuple(s.stop), seed=seq)
        t0, c0 = time.perf_counter(), time.process_time()
        outs = backend.generate(ids, sampling, adapter=WORKER)
        t1 = time.perf_counter()
        cpu_gen += time.process_time() - c0
        flat = [c for comps in outs for c in comps]
        tokens += sum(len(c.token_ids) for c in flat)
        grades = pool.grade([p.text for p in prompts for _ in range(spec.group_size)], [c.text for c in flat],
                            [p.info for p in prompts for _ in range(spec.group_size)])
        t2 = time.perf_counter()
        t_gen, t_grade = t_gen + t1 - t0, t_grade + t2 - t1
        groups, k = [], 0
        for p, pid, comps in zip(prompts, ids, outs):
            cs = []
            for c in comps:
                gr = grades[k]
                k += 1
                cs.append(pb.Completion(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
                                        policy_version=1, rewards=[math.nan if r is None else r for r in gr.rewards],
                                        reward=math.nan if gr.reward is None else gr.reward, grade_error=gr.error))
            groups.append(pb.Group(prompt_index=p.index, prompt_token_ids=pid, completions=cs))
        t3, c3 = time.perf_counter(), time.process_time()
        verdicts = validator.validate_batch(admitted_batch(me, groups, seq), spec, job_id=JOB, head_version=1,
                                            adapters=adapters)
        t_val += time.perf_counter() - t3
        cpu_val += time.process_time() - c3
        rollouts += len(flat)
        bad = [v for v in verdicts if not v.passed]
        failed += sum(len(groups[0].completions) for _ in bad)
        fails += [f"{v.check}: {v.detail}" for v in bad]
        assert len(verdicts) == len(groups), "sample rate 1: every group gets a verdict"
        for g in groups:   # outside the validator's timing: scoring paths, honest gaps and e-values
            prompts_g = [list(g.prompt_token_ids)] * len(g.completions)
            completions_g = [list(c.token_ids) for c in g.completions]
            timed: dict[bool, tuple[float, list]] = {}
            with backend.activated(JOB) as model:
                for shared in (True, False) if len(group_gaps) % 2 == 0 else (False, True):   # alternate the order
                    t4 = time.perf_counter()
                    out = rescore(model, prompts_g, completions_g, temperature=s.temperature,
                                  pad_id=backend.pad_token_id, shared_prompt=shared)
                    timed[shared] = (time.perf_counter() - t4, out)
            (dt_shared, scored), (dt_base, baseline) = timed[True], timed[False]
            t_shared, t_per_completion = t_shared + dt_shared, t_per_completion + dt_base
            _add_gaps(g, baseline, base_group_gaps, base_token_gaps)
            path_gap = max([path_gap] + [float((a.logprobs_T - b.logprobs_T).abs().max()) if len(a.logprobs_T) else 0.0
                                         for a, b in zip(scored, baseline, strict=True)])
            _add_gaps(g, scored, group_gaps, token_gaps)
            for c, r in zip(g.completions, scored):
                sc = completion_plausibility(r.logprobs_T, torch.tensor(list(c.token_ids)), r.stats,
                                             low_test=s.top_p >= 1.0)
                worst_e.append(max(sc.log_e_high, sc.log_e_low if sc.log_e_low is not None else -math.inf))
    pool.close()
    validator.close()
    tol = validator.logprob_tolerance
    worker_s = t_gen / rollouts
    return {
        "model": name, "adapter": str(args.adapter) if args.adapter else f"init + N(0, {args.b_std}) on B",
        "job": str(args.job) if args.job else "built-in arithmetic", "max_new_tokens": s.max_new_tokens,
        "mean_completion_tokens": tokens / rollouts,
        "checked_rollouts": rollouts, "groups": len(group_gaps), "threads": args.threads,
        "cpu_ratio_validator_over_worker_gen": cpu_val / max(cpu_gen, 1e-12),
        "worker_gen_cpu_s_per_rollout": cpu_gen / rollouts, "validator_cpu_s_per_checked_rollout": cpu_val / rollouts,
        "worker_gen_s_per_rollout": worker_s, "worker_gen_grade_s_per_rollout": (t_gen + t_grade) / rollouts,
        "validator_s_per_checked_rollout": t_val / rollouts, "ratio_validator_over_worker_gen": t_val / t_gen,
        "ratio_validator_over_worker_gen_grade": t_val / (t_gen + t_grade),
        "rescore_s_per_rollout": {"shared_prompt": t_shared / rollouts,
                                  "prefill_per_completion": t_per_completion / rollouts,
                                  "speedup": t_per_completion / max(t_shared, 1e-12),
                                  "max_abs_logprob_difference": path_gap,
                                  "honest_group_mean_gap_prefill_per_completion": _quantiles(base_group_gaps),
                                  "honest_token_gap_prefill_per_completion": _quantiles(base_token_gaps)},
        "honest_failed_rollouts": failed, "honest_failures": fails[:10],
        "logprob_tolerance": {"group_mean": tol.mean_abs, "per_token": tol.max_abs},
        "honest_group_mean_gap": _quantiles(group_gaps), "honest_token_gap": _quantiles(token_gaps),
        "logprob_margin_group_mean": tol.mean_abs / max(max(group_gaps), 1e-12),
        "logprob_margin_per_token": tol.max_abs / max(max(token_gaps), 1e-12),
        "plausibility_log_threshold": validator.log_threshold, "honest_worst_log_e": max(worst_e),
        "plausibility_margin_nats": validator.log_threshold - max(worst_e),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--rollouts", type=int, default=2000, help="checked rollouts (completions) to reach")
    p.add_argument("--adapter", type=Path, help="PEFT folder used as version 1")
    p.add_argument("--b-std", type=float, default=0.02)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir", type=Path)
    p.add_argument("--out", type=Path, help="also write the figures here as JSON")
    p.add_argument("--job", type=Path, help="a job file instead of the built-in arithmetic job")
    p.add_argument("-j", action="append", default=[], metavar="FIELD=VALUE", help="job field override (TOML value)")
    args = p.parse_args()
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
