"""The trainer's GRPO step with and without a shared prompt prefill, on the same batches.

Two learners of the built-in arithmetic job (same seed, so the same LoRA initialisation) take
the forward/backward of the same batch of groups (`Learner.compute_gradients`, no optimizer step,
so every repetition sees the same weights): one scores each group's G completions over one
prefill of its prompt (`share_prompts=True`, what trainers run), the other prefills every
prompt + completion (the baseline). The groups use the job's real few-shot prompts, completions
of random token ids with the job's length limit, rewards with spread (no group is dropped) and
claimed log-probs of -1. Prints, as JSON: median seconds per step of each, the speedup, and how
far the two agree (largest |log-prob| difference of the loss inputs, relative gradient difference).
Usage (one torch thread, as a trainer of a local swarm has):

    .venv/bin/python benchmarks/learner_step.py --model gemma --groups 8 --repeats 5
    .venv/bin/python benchmarks/learner_step.py --model tiny --groups 8 --repeats 20

Legend: G = completions per group, B = completions in the batch, T = completion tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from swarmrl.node.models.base_model import prepare_base_model, resolve_model_name
from swarmrl.node.models.causal_lm import encode_prompt
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.learner import Learner, build_step_batch
from swarmrl.protocol.envs import Environment, get_environment
from swarmrl.protocol.pb import swarm_pb2 as pb


def make_groups(learner: Learner, n_groups: int, seed: int, *, env: Environment | None = None,
                render: Callable[[Any], list[int]] | None = None,
                lengths: tuple[int, int] | None = None) -> list[pb.Group]:
    """`n_groups` groups of the job's prompts 0..n-1 with random completions (see module doc).
    `env`: the prompts' environment (default: the spec's installed one); `render`: a prompt's
    token ids (default: its text encoded); `lengths`: completion tokens, uniform in [lo, hi]
    (default: 2 .. the job's max_new_tokens)."""
    spec = learner.spec
    env = env or get_environment(spec.environment, spec.env_version)
    render = render or (lambda p: encode_prompt(learner.tokenizer, p.text))
    lo, hi = lengths or (2, spec.sampling.max_new_tokens)
    rng = random.Random(seed)
    vocab = learner.model.get_input_embeddings().num_embeddings
    groups = []
    for p in env.prompts(spec.seed, list(range(n_groups))):
        completions = []
        for k in range(spec.group_size):
            n = rng.randint(lo, hi)
            completions.append(pb.Completion(
                token_ids=[rng.randrange(3, vocab) for _ in range(n)], logprobs=[-1.0] * n, finish_reason="stop",
                policy_version=0, rewards=[float(k % 2), 0.1], reward=float(k % 2) + 0.1))
        groups.append(pb.Group(prompt_index=p.index, prompt_token_ids=render(p), completions=completions))
    return groups


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    name = resolve_model_name(args.model)
    path = prepare_base_model(name, args.cache_dir)
    spec = builtin_job(name, args.cache_dir)
    learners = {shared: Learner(path, spec, share_prompts=shared) for shared in (True, False)}
    groups = make_groups(learners[True], args.groups, seed=0)
    batch = build_step_batch(groups, spec, current_version=0)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.repeats):
        for shared in (True, False) if r % 2 == 0 else (False, True):   # alternate the order
            t0 = time.perf_counter()
            learners[shared].compute_gradients(batch)
            seconds[shared].append(time.perf_counter() - t0)
    grads = {s: torch.cat([g.flatten() for g in learners[s].grads()]) for s in (True, False)}
    with torch.no_grad():
        lps = {s: learners[s].completion_logprobs(batch)[0] for s in (True, False)}
    shared_s, baseline_s = statistics.median(seconds[True]), statistics.median(seconds[False])
    prompt_tokens = [len(g.prompt_token_ids) for g in groups]
    return {
        "model": name, "groups": args.groups, "group_size": spec.group_size, "completions": len(batch.completion_ids),
        "prompt_tokens_mean": statistics.fmean(prompt_tokens),
        "completion_tokens_mean": statistics.fmean(len(c) for c in batch.completion_ids),
        "threads": args.threads, "repeats": args.repeats,
        "step_s_shared_prompt": shared_s, "step_s_prefill_per_completion": baseline_s,
        "speedup": baseline_s / shared_s,
        "max_abs_logprob_difference": float((lps[True] - lps[False]).abs().max()),
        "relative_gradient_difference": float((grads[True] - grads[False]).norm() / grads[False].norm()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir", type=Path)
    args = p.parse_args()
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
