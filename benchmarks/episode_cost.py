"""Multi-turn episode cost: episodes per minute per worker, and validator cost per episode.

An honest worker plays leases of a built-in multi-turn job (`wordle`, `calculator`: the same
calls `JobSession.generate` and `grade` make for episode environments), with its adapter at
version 1 (the job's LoRA initialisation with perturbed B matrices); a validator checks every
group with the full ladder (sample rate 1: structure, episode replay, freshness, duplicate,
regrade, logprob and plausibility over model tokens only). Prints, per environment:
- episodes per minute of one worker (generation + grading), mean turns and trace tokens;
- validator seconds per episode and the ratio validator / generation;
- failed verdicts on honest episodes (target 0).
Each figure is given in wall seconds and in this process's CPU seconds (`time.process_time`, all
its threads): with one torch thread the CPU figures are what a quiet core would take, so they are
the ones to compare on a shared machine.
Usage (one torch thread, as each process of a local swarm has):

    .venv/bin/python benchmarks/episode_cost.py --model tiny --episodes 200
    .venv/bin/python benchmarks/episode_cost.py --model gemma --episodes 48 --envs calculator
    .venv/bin/python benchmarks/episode_cost.py --model gemma --envs calculator --adapter RUN/adapter

`--adapter` (a PEFT folder from `swarmrl up` or `fetch`, the job's LoRA shape) plays version 1
with a trained adapter instead of a perturbed initialisation: a policy that uses the tool.
    PYTHONPATH=DIR .venv/bin/python benchmarks/episode_cost.py --model tiny --episodes 96 --envs wordle,vf_guess
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from validator_cost import admitted_batch  # benchmarks/validator_cost.py (run as a script)

from swarmrl.node.inference import build_backend
from swarmrl.node.models.base_model import prepare_base_model, resolve_model_name
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.tasks.episode_play import grade_rows
from swarmrl.node.tasks.grading import GradingPool
from swarmrl.node.worker.episodes import episode_groups
from swarmrl.protocol.envs import get_environment
from swarmrl.protocol.envs.episode import EpisodeEnv
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.validator.adapters import InMemoryAdapters
from swarmrl.validator.reputation import Reputation
from swarmrl.validator.seen import SeenStore
from swarmrl.validator.validator import Validator, ValidatorSettings

WORKER, JOB = "worker", "bench-episodes"
JOBS = {   # the job settings of tests/fixtures/jobs/*_tiny.toml
    "wordle": {"sampling": {"max_new_tokens": 8, "stop": ["\n"]},
               "episode": {"max_turns": 6, "max_tokens": 96, "max_observation_tokens": 16}},
    "calculator": {"sampling": {"max_new_tokens": 16, "stop": ["</calc>", "\n"]},
                   "episode": {"max_turns": 4, "max_tokens": 96, "max_observation_tokens": 16}},
    # a verifiers MultiTurnEnv (tests/fixtures/vf_guess: pip install --no-deps --target DIR it, PYTHONPATH=DIR)
    "vf_guess": {"sampling": {"max_new_tokens": 6, "stop": ["\n"]}, "version": "0.1.0",
                 "episode": {"max_turns": 6, "max_tokens": 64, "max_observation_tokens": 16}},
}


def run_env(name: str, args: argparse.Namespace, backend, versions, model: str) -> dict:
    job = dict(JOBS[name])
    version = job.pop("version", "1")
    spec = builtin_job(model, args.cache_dir, environment=name, env_version=version, group_size=args.group_size,
                       max_prompt_tokens=512, **job)
    env = get_environment(name)
    assert isinstance(env, EpisodeEnv)
    s = spec.sampling
    lease = pb.Lease(sampling=pb.SamplingParams(n=spec.group_size, max_new_tokens=s.max_new_tokens,
                                                temperature=s.temperature, top_p=s.top_p, stop=list(s.stop)))
    pool = GradingPool(name, version, timeout_s=30.0)
    validator = Validator(backend, seen=SeenStore(":memory:"), reputation=Reputation(":memory:"),
                          sampling_key=os.urandom(32), settings=ValidatorSettings(base_rate=1.0, logprob=None),
                          grader_factory=lambda n, v: pool)
    me, adapters = Identity.generate(), InMemoryAdapters(JOB, versions)
    t_gen = t_val = c_gen = c_val = 0.0
    episodes = turns = tokens = failed = 0
    fails: list[str] = []
    index = seq = 0
    while episodes < args.episodes:
        prompts = env.prompts(spec.seed, list(range(index, index + args.prompts_per_lease)))
        index, seq = index + args.prompts_per_lease, seq + 1
        t0, c0 = time.perf_counter(), time.process_time()
        groups = episode_groups(backend, spec, env, prompts, lease, adapter=WORKER, policy_version=1)
        for p, g in zip(prompts, groups, strict=True):
            texts, infos = grade_rows(backend.tokenizer, env, p, g)
            for c, grade in zip(g.completions, pool.grade([p.text] * len(texts), texts, infos), strict=True):
                c.rewards.extend(float("nan") if r is None else r for r in grade.rewards)
                c.reward = float("nan") if grade.reward is None else grade.reward
        t1, c1 = time.perf_counter(), time.process_time()
        verdicts = validator.validate_batch(admitted_batch(me, groups, seq, JOB), spec, job_id=JOB, head_version=1,
                                            adapters=adapters)
        t2, c2 = time.perf_counter(), time.process_time()
        t_gen, t_val = t_gen + t1 - t0, t_val + t2 - t1
        c_gen, c_val = c_gen + c1 - c0, c_val + c2 - c1
        flat = [c for g in groups for c in g.completions]
        episodes, turns, tokens = episodes + len(flat), turns + sum(c.turns for c in flat), tokens + sum(len(c.token_ids) for c in flat)
        bad = [v for v in verdicts if not v.passed]
        failed += len(bad)
        fails += [f"{v.check}: {v.detail}" for v in bad][:3]
    validator.close()
    pool.close()
    return {"environment": name, "episodes": episodes, "episodes_per_min": round(60 * episodes / t_gen, 1),
            "mean_turns": round(turns / episodes, 2), "mean_trace_tokens": round(tokens / episodes, 1),
            "validator_s_per_episode": round(t_val / episodes, 4), "generation_s_per_episode": round(t_gen / episodes, 4),
            "validator_over_generation": round(t_val / t_gen, 3),
            "episodes_per_cpu_min": round(60 * episodes / c_gen, 1),
            "validator_cpu_s_per_episode": round(c_val / episodes, 4),
            "generation_cpu_s_per_episode": round(c_gen / episodes, 4),
            "validator_over_generation_cpu": round(c_val / c_gen, 3), "honest_failed_verdicts": failed, "fails": fails[:3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--envs", default="wordle,calculator")
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompts-per-lease", type=int, default=2)
    ap.add_argument("--b-std", type=float, default=0.02)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--adapter", type=Path, default=None, help="a trained PEFT adapter folder as version 1")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model_name(args.model)
    backend = build_backend("hf", prepare_base_model(model, args.cache_dir))
    lora = builtin_job(model, args.cache_dir).lora
    backend.add_slot("template", lora)
    v0 = backend.adapter_state("template")
    backend.remove_adapter("template")
    gen = torch.Generator().manual_seed(1)
    v1 = {k: v.float() + (args.b_std * torch.randn(v.shape, generator=gen) if "lora_B" in k else 0) for k, v in v0.items()}
    if args.adapter is not None:
        trained = {k: v.float() for k, v in load_file(str(args.adapter / "adapter_model.safetensors")).items()}
        if set(trained) != set(v0) or any(trained[k].shape != v0[k].shape for k in v0):
            raise SystemExit(f"{args.adapter}: not an adapter of the job's LoRA shape")
        v1 = trained
    backend.add_slot(WORKER, lora)
    backend.set_adapter(WORKER, v1)
    for name in args.envs.split(","):
        print(json.dumps({"model": model, **run_env(name, args, backend, {0: v0, 1: v1}, model)}), flush=True)


if __name__ == "__main__":
    main()
