"""A trainer step's peak memory and seconds against its micro-batch budget, on a long-completion job.

    .venv/bin/python benchmarks/step_memory.py [--job examples/jobs/reasoning_chain_sum_long_gemma.toml]
        [--groups 4] [--budgets 8192,4096,2048] [--min-tokens 100] [--max-tokens 256] [--repeats 2]

Each budget (`Learner(micro_batch_tokens=...)`, the positions per forward/backward pass that
`learner.micro_batches` packs whole groups into) runs in its own child process, so its peak
resident memory (`ru_maxrss`) is its own: the job's model and LoRA are loaded, then the same batch
(`--groups` groups of the job's G completions over the job's real prompts, completion lengths
uniform in [min, max] tokens of random ids, rewards with spread: `learner_step.make_groups`) takes `Learner.compute_gradients`
`--repeats` times (no optimizer step). Prints one JSON line per budget (peak MB, median step s,
passes) and the ratios to the first budget. One torch thread, as a trainer of a local swarm has.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):   # run as a script: benchmarks/ is sys.path[0], the repository root is not
    sys.path.insert(0, str(ROOT))


def one(args: argparse.Namespace, budget: int) -> dict[str, Any]:
    """Measure one budget in this process."""
    import torch

    from benchmarks.learner_step import make_groups
    from swarmrl.node.models.base_model import prepare_base_model
    from swarmrl.node.models.causal_lm import render_prompt
    from swarmrl.node.tasks.job_file import load_job_file
    from swarmrl.node.trainer.learner import Learner, build_step_batch, micro_batches
    from swarmrl.protocol.envs import job_environment

    torch.set_num_threads(1)
    spec = load_job_file(args.job).spec
    learner = Learner(prepare_base_model(spec.base_model, None), spec, micro_batch_tokens=budget)
    groups = make_groups(learner, args.groups, 0, env=job_environment(spec),
                         render=lambda p: render_prompt(learner.tokenizer, p, spec.chat_template),
                         lengths=(args.min_tokens, args.max_tokens))
    batch = build_step_batch(groups, spec, current_version=0)
    loaded_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    seconds = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        learner.compute_gradients(batch)
        seconds.append(time.perf_counter() - t0)
    return {"budget": budget, "passes": len(micro_batches(batch, budget)), "completions": len(batch.completion_ids),
            "prompt_tokens_mean": statistics.fmean(len(g.prompt_token_ids) for g in groups),
            "completion_tokens_mean": statistics.fmean(len(c) for c in batch.completion_ids),
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "loaded_mb": loaded_mb,
            "step_s_median": statistics.median(seconds), "step_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", type=Path, default=ROOT / "examples/jobs/reasoning_chain_sum_long_gemma.toml")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--budgets", default="8192,4096,2048")
    ap.add_argument("--min-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args, args.one)))
        return
    rows = []
    for budget in (int(b) for b in args.budgets.split(",")):
        cmd = [sys.executable, __file__, "--one", str(budget), "--job", str(args.job), "--groups", str(args.groups),
               "--min-tokens", str(args.min_tokens), "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats)]
        row = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    first = rows[0]
    for r in rows[1:]:
        print(f"budget {r['budget']} against {first['budget']}: peak {r['peak_mb'] / first['peak_mb']:.2f}x "
              f"({r['peak_mb']:,.0f} MB against {first['peak_mb']:,.0f}), step {r['step_s_median'] / first['step_s_median']:.2f}x")


if __name__ == "__main__":
    main()
