"""A vLLM worker's round over several jobs (issue 24 item 2): one engine batch carrying every
job's requests, each on its own job's adapter (`VLLMBackend.generate_batch`, what
`node/worker/lease_round.run_round` calls), against the same requests as one single-job round
after another (`generate` per job, what a worker with `jobs_per_round = 1` does).

Same requests in both arms: each job has its own prompts, its own adapter and its own sampling
seed, so the seeded completions are the same tokens whichever way they run (checked and
printed). tokens/s = completion tokens generated / wall seconds of the whole round; medians over
`--reps` repetitions (after one warm-up of each arm), the arms alternating. Also printed: one
job's round alone, the reference for "throughput serving k jobs relative to one job".

    .venv/bin/python benchmarks/vllm_multi_job.py [--model tiny] [--jobs 2] [--prompts 4] [--n 4]
        [--new-tokens 32] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

if __name__ == "__main__":   # before torch loads: one thread per torch process on 2 shared cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from swarmrl.node.inference import Sampling
from swarmrl.node.inference.base import GenerateRequest, SampledCompletion
from swarmrl.node.inference.vllm import VLLMBackend
from swarmrl.node.inference.vllm_start import start_vllm_backend
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.models.causal_lm import encode_prompt, lora_config

Outs = list[list[list[SampledCompletion]]]   # [request][prompt][n]


def random_state(template: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A LoRA state far from zero (B too), so each job's adapter changes its outputs."""
    gen = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(v.shape, generator=gen) for k, v in template.items()}


def job_requests(v: VLLMBackend, jobs: int, prompts: int, sampling: Sampling) -> list[GenerateRequest]:
    """Each job's round: its own prompts ("What is a+b?"), its own seed, its own adapter slot."""
    out = []
    for j in range(jobs):
        texts = [f"Question: What is {3 + j + p}+{7 + 2 * p}?\nAnswer:" for p in range(prompts)]
        seeded = Sampling(n=sampling.n, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                          seed=1000 + j)
        out.append(GenerateRequest([encode_prompt(v.tokenizer, t) for t in texts], seeded, adapter=f"job{j}"))
    return out


def tokens(outs: Outs) -> int:
    return sum(len(c.token_ids) for out in outs for group in out for c in group)


def ids(outs: Outs) -> list[list[list[list[int]]]]:
    return [[[c.token_ids for c in group] for group in out] for out in outs]


def rate(run: Callable[[], Outs]) -> tuple[float, Outs]:
    """(tokens/s, outputs) of one run."""
    t0 = time.perf_counter()
    outs = run()
    return tokens(outs) / (time.perf_counter() - t0), outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4, help="prompts per job's lease")
    p.add_argument("--n", type=int, default=4, help="completions per prompt (G)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    cfg = lora_config(8, 16)
    t0 = time.perf_counter()
    v = start_vllm_backend(prepare_base_model(args.model), max_jobs=args.jobs, lora_config=cfg)
    print(f"vLLM server up in {time.perf_counter() - t0:.1f} s (max_loras {args.jobs + 1})")
    try:
        v.add_slot("job0", cfg)
        template = v.adapter_state("job0")
        for j in range(args.jobs):
            v.set_adapter(f"job{j}", random_state(template, j + 1))
        sampling = Sampling(n=args.n, max_new_tokens=args.new_tokens, temperature=1.0)
        reqs = job_requests(v, args.jobs, args.prompts, sampling)
        arms: dict[str, Callable[[], Outs]] = {
            "one batch": lambda: v.generate_batch(reqs),
            "sequential rounds": lambda: [v.generate(r.prompt_token_ids, r.sampling, adapter=r.adapter) for r in reqs],
            "one job alone": lambda: v.generate_batch(reqs[:1]),
        }
        first = {name: run() for name, run in arms.items()}   # warm-up
        same = ids(first["one batch"]) == ids(first["sequential rounds"])
        rates: dict[str, list[float]] = {name: [] for name in arms}
        for rep in range(args.reps):
            order = list(arms) if rep % 2 == 0 else list(reversed(arms))
            for name in order:
                r, outs = rate(arms[name])
                rates[name].append(r)
                if name == "one batch":
                    same &= ids(outs) == ids(first["one batch"])
        med = {name: statistics.median(rs) for name, rs in rates.items()}
        print(f"{args.jobs} jobs x {args.prompts} prompts x {args.n} completions x <= {args.new_tokens} tokens, "
              f"{tokens(first['one batch'])} tokens a round; {args.reps} repetitions")
        for name, rs in rates.items():
            print(f"  {name:18s} median {med[name]:8.1f} tok/s   (runs: {', '.join(f'{x:.0f}' for x in rs)})")
        print(f"  one batch / sequential rounds: {med['one batch'] / med['sequential rounds']:.2f}x")
        print(f"  one batch of {args.jobs} jobs / one job alone: {med['one batch'] / med['one job alone']:.2f}x")
        print(f"  same tokens in both arms (seeded): {'yes' if same else 'NO'}")
    finally:
        v.close()


if __name__ == "__main__":
    main()
