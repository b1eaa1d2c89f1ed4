"""Worker tokens/s and trainer step seconds at reasoning lengths (e.g. 256 and 1024 tokens), in CPU
seconds of this process (one torch thread, as each process of a local swarm has), so the figures
move little with the load of a shared machine; wall seconds are printed beside them.

Worker: the transformers backend samples G completions for `--prompts` prompts of a reasoning-gym
job (rendered as workers render them) with no stop string, so completions run to the length limit
unless the model ends them (the tokens actually generated are counted). Trainer: the GRPO step's
forward + backward (`Learner.compute_gradients`, no optimizer) on groups of G completions of exactly
L random tokens each, the job's prompts, rewards with spread (no group dropped).

    .venv/bin/python benchmarks/long_completion_cost.py --model smollm2 --lengths 256,1024 --groups 1
    .venv/bin/python benchmarks/long_completion_cost.py --model gemma --lengths 256 --groups 1 \\
        -j environment.chat_template=false

Legend: G = completions per group, L = completion tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

if __name__ == "__main__":   # before torch loads: one thread, as in a local swarm
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from swarmrl.node.inference import Sampling, build_backend
from swarmrl.node.models.base_model import prepare_base_model, resolve_model_name
from swarmrl.node.models.causal_lm import render_prompt
from swarmrl.node.tasks.job_file import load_job_file
from swarmrl.node.trainer.learner import Learner, build_step_batch
from swarmrl.protocol.envs import job_environment
from swarmrl.protocol.pb import swarm_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]


def _timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its live descendants (from /proc)."""
    from swarmrl.node.runtime.procs import descendants

    total = 0
    for p in (pid, *descendants(pid)):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def worker_rate(backend, spec, env, length: int, prompts: int, server_pid: int | None = None) -> dict:
    """One generate call's tokens and seconds; with `server_pid` (vLLM) the CPU is the server's process tree's."""
    specs = env.prompts(spec.seed, range(prompts))
    ids = [render_prompt(backend.tokenizer, p, spec.chat_template) for p in specs]
    sampling = Sampling(n=spec.group_size, max_new_tokens=length, temperature=1.0, stop=(), seed=1)
    before = tree_cpu_s(server_pid) if server_pid else 0.0
    outs, cpu, wall = _timed(lambda: backend.generate(ids, sampling, adapter=None))
    if server_pid:
        cpu = tree_cpu_s(server_pid) - before
    tokens = sum(len(c.token_ids) for group in outs for c in group)
    return {"completions": sum(map(len, outs)), "tokens": tokens, "mean_tokens": tokens / sum(map(len, outs)),
            "cpu_s": cpu, "wall_s": wall, "tokens_per_cpu_s": tokens / cpu, "tokens_per_wall_s": tokens / wall}


def trainer_step(learner: Learner, spec, env, length: int, groups: int) -> dict:
    rng = random.Random(0)
    vocab = learner.model.get_input_embeddings().num_embeddings
    batch_groups = []
    for p in env.prompts(spec.seed, range(groups)):
        comps = [pb.Completion(token_ids=[rng.randrange(3, vocab) for _ in range(length)], logprobs=[-1.0] * length,
                               finish_reason="stop", policy_version=0, rewards=[float(k % 2), 1.0],
                               reward=float(k % 2) + 0.1) for k in range(spec.group_size)]
        batch_groups.append(pb.Group(prompt_index=p.index, completions=comps,
                                     prompt_token_ids=render_prompt(learner.tokenizer, p, spec.chat_template)))
    batch = build_step_batch(batch_groups, spec, current_version=0)
    _, cpu, wall = _timed(lambda: learner.compute_gradients(batch))
    return {"completions": len(batch.completion_ids), "tokens": int(batch.mask_BT.sum()), "cpu_s": cpu, "wall_s": wall,
            "cpu_s_per_1k_tokens": cpu / int(batch.mask_BT.sum()) * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--job", type=Path, default=ROOT / "examples/jobs/reasoning_chain_sum.toml")
    ap.add_argument("-j", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--lengths", default="256,1024")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per generate call (x G completions)")
    ap.add_argument("--groups", type=int, default=1, help="groups of G in the trainer's step")
    ap.add_argument("--skip-trainer", action="store_true")
    ap.add_argument("--vllm", action="store_true", help="also the vLLM backend (its server's CPU seconds)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from swarmrl.node.runtime.config import parse_override, set_dotted

    overrides: dict = {}
    for item in args.j:
        set_dotted(overrides, *parse_override(item))
    name = resolve_model_name(args.model)
    path = prepare_base_model(name)
    spec = load_job_file(args.job, None, overrides, base_model=name).spec
    env = job_environment(spec)
    backend = build_backend("hf", path)
    learner = None if args.skip_trainer else Learner(path, spec)
    vllm = None
    if args.vllm:
        from swarmrl.node.inference.vllm_start import start_vllm_backend

        vllm = start_vllm_backend(path, max_jobs=1)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        row = {"model": name, "length": length, "group_size": spec.group_size,
               "worker": worker_rate(backend, spec, env, length, args.prompts)}
        if vllm is not None:
            row["worker_vllm"] = worker_rate(vllm, spec, env, length, args.prompts, vllm.server.proc.pid)
        if learner is not None:
            row["trainer"] = trainer_step(learner, spec, env, length, args.groups)
        row["load"] = os.getloadavg()
        print(json.dumps(row), flush=True)
        rows.append(row)
    if vllm is not None:
        vllm.close()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
