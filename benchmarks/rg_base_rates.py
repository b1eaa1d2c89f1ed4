"""What a base model does on reasoning-gym tasks in the reasoning format, before any training.

Per task: the share of sampled completions that are complete in the format, that are correct,
that were truncated (finish "length"), the share of groups of G with reward variance (the groups
that carry a GRPO signal), mean completion tokens, and tokens/s. Used to pick a task and a
difficulty at which the base model sometimes succeeds (benchmarks/README-style figures in
docs/REASONING.md).

    .venv/bin/python benchmarks/rg_base_rates.py --model smollm2 --chat --prompts 16 --group 4 \
        --task 'chain_sum:{"min_terms":2,"max_terms":2,"max_digits":1}' --task 'leg_counting:{}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from swarmrl.node.inference import build_backend
from swarmrl.node.inference.base import Sampling
from swarmrl.node.models.base_model import find_base_model, resolve_model_name
from swarmrl.node.models.causal_lm import render_prompt
from swarmrl.protocol.envs.reasoning_format import STOP, parse_reasoning
from swarmrl.protocol.envs.rg_env import ReasoningGymEnv
from swarmrl.protocol.envs.rg_task import ReasoningGymTask


def task_arg(text: str) -> tuple[str, dict[str, object]]:
    name, _, config = text.partition(":")
    return name, json.loads(config or "{}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--task", action="append", type=task_arg, required=True, help="NAME:JSON_CONFIG")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--format", default="think_answer")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--system-prompt", default=None,
                    help="the job's system_prompt (a worked example for a base model, say); @FILE reads it from FILE")
    args = ap.parse_args()
    system = args.system_prompt
    if system is not None and system.startswith("@"):
        with open(system[1:], encoding="utf-8") as f:
            system = f.read().rstrip("\n")
    torch.set_num_threads(args.threads)
    backend = build_backend("hf", find_base_model(resolve_model_name(args.model)))
    for name, config in args.task:
        task = ReasoningGymTask.model_validate({"reasoning_gym": name, "config": config, "chat_template": args.chat,
                                                "reasoning_format": args.format, "system_prompt": system})
        env = ReasoningGymEnv(task, seed=0)
        prompts = env.prompts(0, range(args.prompts))
        ids = [render_prompt(backend.tokenizer, p, args.chat) for p in prompts]
        sampling = Sampling(n=args.group, max_new_tokens=args.max_new_tokens, temperature=1.0, stop=STOP, seed=1)
        t0 = time.monotonic()
        outs = [c for i in range(0, len(ids), 4) for c in backend.generate(ids[i:i + 4], sampling, adapter=None)]
        wall = time.monotonic() - t0
        tokens = [len(c.token_ids) for group in outs for c in group]
        rows = [env.rewards([p] * len(group), [c.text for c in group]) for p, group in zip(prompts, outs)]
        correct = [r[0] == 1.0 for group in rows for r in group]
        complete = [parse_reasoning(c.text, args.format).complete for group in outs for c in group]
        truncated = [c.finish_reason == "length" for group in outs for c in group]
        variance = [len({env.total(r) for r in group}) > 1 for group in rows]
        print(json.dumps({"task": name, "config": config, "complete": statistics.fmean(complete),
                          "correct": statistics.fmean(correct), "truncated": statistics.fmean(truncated),
                          "groups_with_variance": statistics.fmean(variance), "mean_tokens": statistics.fmean(tokens),
                          "tokens_per_s": sum(tokens) / wall, "example": outs[0][0].text[:300]}), flush=True)


if __name__ == "__main__":
    main()
