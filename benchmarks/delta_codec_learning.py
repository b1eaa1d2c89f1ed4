"""Does a lossy delta codec slow GRPO down? On-policy learning curves per codec, over seeds, in one process.

The tiny model can't learn arithmetic, so the swarm's own job shows nothing here; this takes a
task it can learn: reward = the share of completion tokens whose id is in a fixed tenth of the
vocabulary (about 0.1 at the random start). Each step samples G completions for a few prompts
from the current adapter (on-policy, temperature 1, sampling log-probs recorded), takes one step
through the trainer's own `Learner`, publishes the new state with the codec under test
(`DeltaEncoder`, as the trainer's store does) and adopts the dequantised state. Arms: `float32`
(lossless), `int4` (the default, error feedback on as a lone trainer), `int4-noef` (int4 without
error feedback, as with cotrainers), `int8`. Prints, per arm, the mean reward over the first and
last steps for each seed, and the seeds' mean and spread. Usage:

    .venv/bin/python benchmarks/delta_codec_learning.py [--steps 20] [--seeds 0,1,2] [--lr 0.01] [--arms float32,int4,int4-noef,int8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from swarmrl.protocol import delta_codec as dc

ARMS = {"float32": ("float32", True), "int4": ("int4", True), "int4-noef": ("int4", False), "int8": ("int8", True)}


@torch.no_grad()
def sample(model: Any, prompt: list[int], g: int, new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """G completions of `new_tokens` tokens at temperature 1, with their sampling log-probs."""
    ids = torch.tensor([prompt] * g)
    toks, lps = [], []
    for _ in range(new_tokens):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
        nxt = torch.multinomial(logp.exp(), 1)
        toks.append(nxt)
        lps.append(logp.gather(1, nxt))
        ids = torch.cat([ids, nxt], dim=1)
    return torch.cat(toks, 1).tolist(), torch.cat(lps, 1).tolist()


def run_arm(arm: str, seed: int, args: argparse.Namespace) -> list[float]:
    from swarmrl.node.models.base_model import prepare_base_model
    from swarmrl.node.models.causal_lm import encode_prompt, vocab_size
    from swarmrl.node.tasks.builtin_jobs import builtin_job
    from swarmrl.node.trainer.learner import Learner
    from swarmrl.protocol.envs import get_environment
    from swarmrl.protocol.pb import swarm_pb2 as pb

    codec, carry = ARMS[arm]
    spec = builtin_job(args.model).model_copy(update={"seed": seed, "learning_rate": args.lr})
    learner, env = Learner(prepare_base_model(spec.base_model), spec), get_environment(spec.environment, spec.env_version)
    target = vocab_size(learner.model) // 10
    encoder, state, rewards = dc.DeltaEncoder(codec), learner.state(), []
    torch.manual_seed(seed)
    for v in range(args.steps):
        groups, step_rewards = [], []
        for i in range(args.prompts):
            idx = v * args.prompts + i
            prompt = encode_prompt(learner.tokenizer, env.prompt(seed, idx).text)
            learner.model.eval()
            toks, lps = sample(learner.model, prompt, args.group, args.new_tokens)
            rs = [sum(t < target for t in c) / len(c) for c in toks]
            step_rewards += rs
            groups.append(pb.Group(prompt_index=idx, prompt_token_ids=prompt, completions=[
                pb.Completion(token_ids=c, logprobs=lp, finish_reason="length", policy_version=v, reward=r, rewards=[r])
                for c, lp, r in zip(toks, lps, rs)]))
        rewards.append(statistics.mean(step_rewards))
        learner.step(groups, v)
        _, state = encoder.encode(state, learner.state(), carry=carry)
        learner.load_state(state)
    return rewards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--window", type=int, default=5, help="steps averaged at the start and at the end")
    args = p.parse_args()
    torch.set_num_threads(1)
    seeds, w, curves = [int(s) for s in args.seeds.split(",")], args.window, {}
    for arm in args.arms.split(","):
        for seed in seeds:
            t0 = time.monotonic()
            curves[(arm, seed)] = run_arm(arm, seed, args)
            c = curves[(arm, seed)]
            print(f"{arm:>10} seed {seed}: reward first {statistics.mean(c[:w]):.3f} last {statistics.mean(c[-w:]):.3f}"
                  f" all steps {statistics.mean(c):.3f} ({time.monotonic() - t0:.0f} s)", flush=True)
    print(f"\nmodel={args.model} steps={args.steps} lr={args.lr} {args.prompts} prompts x G={args.group} x "
          f"{args.new_tokens} tokens; reward = share of tokens in the target tenth of the vocabulary")
    for arm in args.arms.split(","):
        last = [statistics.mean(curves[(arm, s)][-w:]) for s in seeds]
        whole = [statistics.mean(curves[(arm, s)]) for s in seeds]
        print(f"{arm:>10}: reward last {w} steps: mean {statistics.mean(last):.3f}, seeds {min(last):.3f}..{max(last):.3f}; "
              f"all steps (area under the curve): mean {statistics.mean(whole):.3f}, seeds {min(whole):.3f}..{max(whole):.3f}")
    print(json.dumps({f"{a}/{s}": [round(r, 4) for r in c] for (a, s), c in curves.items()}))


if __name__ == "__main__":
    main()
