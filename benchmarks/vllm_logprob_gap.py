"""Cross-engine log-prob gap: honest rollouts sampled by vLLM, re-scored by the validator's
transformers prefill, checked with the validator's log-prob check; beside the same check on
rollouts sampled by transformers (today's HF-only margin).

The job is the built-in arithmetic job's sampling (G completions per prompt, its max_new_tokens,
stop and temperature) on its prompts, with a small random adapter on both engines (the same
float32 tensors). Prints false positives and the margins: worst group-mean gap / the validator's
mean tolerance, worst token gap / its per-token tolerance. Usage:

    .venv/bin/python benchmarks/vllm_logprob_gap.py [--model gemma] [--rollouts 512] [--hf-threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from swarmrl.node.inference import Sampling
from swarmrl.node.inference.base import InferenceBackend, SampledCompletion
from swarmrl.node.inference.hf import HFBackend
from swarmrl.node.inference.scoring import shared_prompt_logprobs
from swarmrl.node.inference.vllm_start import start_vllm_backend
from swarmrl.node.models.base_model import prepare_base_model, resolve_model_name
from swarmrl.node.models.causal_lm import encode_prompt, load_causal_lm, lora_config
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.protocol.envs import get_environment
from swarmrl.validator.checks import LogprobTolerance, check_logprobs, logprob_gaps


def small_adapter(template: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: (0.02 if "lora_A" in k else 0.002) * torch.randn(v.shape, generator=gen) for k, v in template.items()}


def sample(backend: InferenceBackend, prompts: list[list[int]], sampling: Sampling, batch: int) -> list[list[SampledCompletion]]:
    out: list[list[SampledCompletion]] = []
    for lo in range(0, len(prompts), batch):
        out += backend.generate(prompts[lo: lo + batch], sampling, adapter="job")
    return out


def margins(hf: HFBackend, prompts: list[list[int]], groups: list[list[SampledCompletion]], temperature: float,
            tol: LogprobTolerance) -> dict:
    failures, worst_mean, worst_token = 0, 0.0, 0.0
    for p, group in zip(prompts, groups):
        comps = [c.token_ids for c in group]
        with hf.activated("job") as model, torch.no_grad():
            ref_BT, mask_BT = shared_prompt_logprobs(model, [p] * len(comps), comps, temperature=temperature,
                                                     pad_id=hf.pad_token_id)
        recomputed = [ref_BT[b][mask_BT[b]].tolist() for b in range(len(comps))]
        claimed = [c.logprobs for c in group]
        failures += not check_logprobs(claimed, recomputed, tol).passed
        gaps = [g for c, r in zip(claimed, recomputed) for g in logprob_gaps(c, r)]
        worst_mean = max(worst_mean, sum(gaps) / max(1, len(gaps)))
        worst_token = max([worst_token, *gaps])
    return {"groups": len(groups), "rollouts": sum(map(len, groups)), "false_positives": failures,
            "worst_group_mean": worst_mean, "worst_token": worst_token,
            "mean_margin": worst_mean / tol.mean_abs, "token_margin": worst_token / tol.max_abs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma")
    p.add_argument("--rollouts", type=int, default=512)
    p.add_argument("--hf-threads", type=int, default=1)
    p.add_argument("--batch-prompts", type=int, default=8)
    args = p.parse_args()
    name = resolve_model_name(args.model)
    path = prepare_base_model(name)
    spec = builtin_job(name)
    s = spec.sampling
    g = spec.group_size
    sampling = Sampling(n=g, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                        stop=tuple(s.stop), seed=0)
    cfg = lora_config(spec.lora.rank, spec.lora.alpha)
    env = get_environment(spec.environment, spec.env_version)
    n_prompts = -(-args.rollouts // g)
    model, tokenizer = load_causal_lm(path, num_threads=args.hf_threads)
    hf = HFBackend(model, tokenizer, cfg)
    hf.add_slot("job", cfg)
    state = small_adapter(hf.adapter_state("job"))
    hf.set_adapter("job", state)
    prompts = [encode_prompt(tokenizer, q.text) for q in env.prompts(spec.seed, range(n_prompts))]
    tol = LogprobTolerance.from_mean(0.05).floored(str(hf.dtype).removeprefix("torch."))
    t0 = time.perf_counter()
    v = start_vllm_backend(path, max_jobs=1, lora_config=cfg)
    try:
        v.set_adapter("job", state)
        t1 = time.perf_counter()
        vllm_groups = sample(v, prompts, sampling, args.batch_prompts)
        vllm_s = time.perf_counter() - t1
    finally:
        v.close()
    print(f"vLLM: server {t1 - t0:.0f} s, sampled {sum(map(len, vllm_groups))} rollouts in {vllm_s:.0f} s")
    hf_groups = sample(hf, prompts, sampling, args.batch_prompts)
    rows = {"vLLM-sampled": margins(hf, prompts, vllm_groups, s.temperature, tol),
            "HF-sampled": margins(hf, prompts, hf_groups, s.temperature, tol)}
    print(f"\nmodel={name} dtype={hf.dtype} G={g} max_new_tokens={s.max_new_tokens} T={s.temperature} "
          f"tolerance: group mean {tol.mean_abs:g}, token {tol.max_abs:g}")
    for label, r in rows.items():
        print(f"{label:>13}: {r['rollouts']} rollouts in {r['groups']} groups, false positives {r['false_positives']}, "
              f"worst group mean {r['worst_group_mean']:.4f} (margin {r['mean_margin']:.3f}), worst token "
              f"{r['worst_token']:.4f} (margin {r['token_margin']:.3f})")


if __name__ == "__main__":
    main()
