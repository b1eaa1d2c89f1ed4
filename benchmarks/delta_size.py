"""Bytes per adapter version under each delta codec, as a share of the base model's bytes.

Takes N GRPO steps of the built-in job on a base model (default Gemma 3 270M, its LoRA config)
with synthetic groups through the trainer's own Learner; the trainer publishes each version with
`--codec` (error feedback on, as a lone trainer does) and adopts the dequantised state, as the
product does. Each version's raw float32 delta (new - old) is also encoded with every codec, and
the script prints, per codec, the median payload bytes, their share of the base model's bytes
and the relative error of the dequantised delta (||dequantised - delta|| / ||delta||). Usage:

    .venv/bin/python benchmarks/delta_size.py [--model gemma] [--steps 3] [--codec int4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from swarmrl.protocol import adapter as ad
from swarmrl.protocol import delta_codec as dc


def synthetic_groups(learner, spec, env, version: int, gen: torch.Generator) -> list:
    """Two groups of random 8-token completions with alternating rewards (a non-zero gradient)."""
    from swarmrl.node.models.causal_lm import encode_prompt, vocab_size
    from swarmrl.protocol.pb import swarm_pb2 as pb

    top = min(5000, vocab_size(learner.model))
    groups = []
    for i in range(2):
        p = env.prompt(spec.seed, version * 10 + i)
        comps = [pb.Completion(token_ids=torch.randint(10, top, (8,), generator=gen).tolist(), logprobs=[-3.0] * 8,
                               finish_reason="length", policy_version=version - 1, reward=float(j % 2),
                               rewards=[float(j % 2)]) for j in range(spec.group_size)]
        groups.append(pb.Group(prompt_index=version * 10 + i, prompt_token_ids=encode_prompt(learner.tokenizer, p.text),
                               completions=comps))
    return groups


def codec_rows(delta: ad.State) -> dict[str, tuple[int, float]]:
    """codec -> (payload bytes, relative error of the dequantised delta) for one raw delta."""
    norm = torch.sqrt(sum((d.double() ** 2).sum() for d in delta.values())).item() or 1.0
    rows = {}
    for codec in dc.CODECS:
        payload, sent = dc.encode_delta(delta, codec)
        err = torch.sqrt(sum(((sent[k] - delta[k]).double() ** 2).sum() for k in delta)).item()
        rows[codec] = (len(payload), err / norm)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--codec", default=dc.DEFAULT_CODEC, choices=dc.CODECS, help="what the trainer publishes")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from swarmrl.node.models.base_model import prepare_base_model
    from swarmrl.node.swarm.figures import base_model_bytes
    from swarmrl.node.tasks.builtin_jobs import builtin_job
    from swarmrl.node.trainer.learner import Learner
    from swarmrl.protocol.envs import get_environment

    torch.set_num_threads(args.threads)
    spec = builtin_job(args.model)
    path = prepare_base_model(spec.base_model)
    learner, env = Learner(path, spec), get_environment(spec.environment, spec.env_version)
    encoder, gen = dc.DeltaEncoder(args.codec), torch.Generator().manual_seed(0)
    state = learner.state()
    base, adapter = base_model_bytes(path), sum(t.numel() * 4 for t in state.values())
    per_version: list[dict[str, tuple[int, float]]] = []
    for v in range(1, args.steps + 1):
        t0 = time.monotonic()
        learner.step(synthetic_groups(learner, spec, env, v, gen), v - 1)
        new = learner.state()
        per_version.append(codec_rows(ad.make_delta(state, new)[0]))
        payload, state = encoder.encode(state, new)
        learner.load_state(state)
        print(f"step {v}: published {len(payload)} B ({args.codec}), {time.monotonic() - t0:.1f} s", flush=True)
    print(f"\n{args.model}: base model {base} B, adapter {adapter} B float32 (LoRA r{spec.lora.rank} on "
          f"{spec.lora.target_modules}); median over {args.steps} versions")
    print(f"{'codec':>8} {'bytes/version':>14} {'% of base':>10} {'vs float32':>10} {'rel. error':>10}")
    medians = {c: statistics.median(r[c][0] for r in per_version) for c in dc.CODECS}
    for codec in dc.CODECS:
        err = statistics.median(r[codec][1] for r in per_version)
        print(f"{codec:>8} {medians[codec]:>14.0f} {100 * medians[codec] / base:>9.3f}% "
              f"{medians[codec] / medians['float32']:>10.3f} {err:>10.4f}")
    print(json.dumps({"model": args.model, "base_model_bytes": base, "adapter_bytes": adapter,
                      "median_bytes": medians, "versions": per_version}))


if __name__ == "__main__":
    main()
