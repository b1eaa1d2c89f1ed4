"""Base-model accuracy on an environment's held-out prompts: is there reward variance for GRPO?

For each model: greedy accuracy, temperature-1 accuracy over G samples per prompt, the fraction
of groups of G whose rewards are not all equal (the groups that give GRPO a gradient), a
per-family breakdown and generation tokens/s (HF `generate`, batched, CPU).

    .venv/bin/python benchmarks/base_accuracy.py --models gemma,tiny --n 40 --g 8

Legend: ids_BT prompt/completion token ids (B sequences, T positions), mask_BT attention mask.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarmrl.node.models.base_model import prepare_base_model, resolve_model_name
from swarmrl.node.models.causal_lm import encode_prompt, load_causal_lm
from swarmrl.protocol.envs import Environment, PromptSpec, get_environment, heldout_prompts


@dataclass
class Generated:
    """Completions (text cut after the first stop string) and the tokens each one used."""

    texts: list[str]
    n_tokens: list[int]
    seconds: float


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """Text up to and including the earliest stop string (all of it if none occurs)."""
    ends = [text.index(s) + len(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


def generate(
    model,
    tokenizer,
    prompts: list[str],
    env: Environment,
    *,
    sample: bool,
    max_new_tokens: int,
    batch_size: int,
) -> Generated:
    """Batched HF generate (left padding); greedy, or pure temperature-1 sampling (no top-k/top-p)."""
    texts: list[str] = []
    n_tokens: list[int] = []
    start = time.perf_counter()
    for lo in range(0, len(prompts), batch_size):
        chunk = [encode_prompt(tokenizer, p) for p in prompts[lo : lo + batch_size]]
        padded = tokenizer.pad({"input_ids": chunk}, padding=True, return_tensors="pt")
        ids_BT, mask_BT = padded["input_ids"], padded["attention_mask"]
        sampling = (
            {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
            if sample
            else {"do_sample": False}
        )
        with torch.no_grad():
            out_BT = model.generate(
                input_ids=ids_BT,
                attention_mask=mask_BT,
                max_new_tokens=max_new_tokens,
                stop_strings=list(env.stop),
                tokenizer=tokenizer,
                pad_token_id=tokenizer.pad_token_id,
                **sampling,
            )
        for row in out_BT[:, ids_BT.shape[1] :].tolist():
            text, used = _decode_until_stop(tokenizer, row, env.stop)
            texts.append(text)
            n_tokens.append(used)
    return Generated(texts, n_tokens, time.perf_counter() - start)


def _decode_until_stop(tokenizer, row: list[int], stop: Sequence[str]) -> tuple[str, int]:
    """The completion text and its token count: up to EOS or the token that completes a stop string."""
    for used in range(1, len(row) + 1):
        if row[used - 1] == tokenizer.eos_token_id:
            return tokenizer.decode(row[: used - 1], skip_special_tokens=True), used
        text = tokenizer.decode(row[:used], skip_special_tokens=True)
        if any(s in text for s in stop):
            return cut_at_stop(text, stop), used
    return tokenizer.decode(row, skip_special_tokens=True), len(row)


def correctness(env: Environment, specs: list[PromptSpec], texts: list[str]) -> list[float]:
    """The first reward function's value (correctness) for each completion; None counts as 0."""
    return [row[0] or 0.0 for row in env.rewards(specs, texts)]


def totals(env: Environment, specs: list[PromptSpec], texts: list[str]) -> list[float]:
    """Weighted total reward per completion; None counts as 0."""
    return [env.total(row) or 0.0 for row in env.rewards(specs, texts)]


def varied_fraction(values: list[float], g: int) -> float:
    """Fraction of consecutive groups of g values that are not all equal."""
    groups = [values[i : i + g] for i in range(0, len(values), g)]
    return sum(max(gr) > min(gr) for gr in groups) / len(groups)


def run_model(name: str, env: Environment, specs: list[PromptSpec], args: argparse.Namespace) -> None:
    """Prepare, load, generate greedy and sampled, print the figures for one model."""
    t0 = time.perf_counter()
    folder = prepare_base_model(name)
    prep_s = time.perf_counter() - t0
    model, tokenizer = load_causal_lm(folder, num_threads=args.threads)
    prompts = [s.text for s in specs]
    greedy = generate(
        model,
        tokenizer,
        prompts,
        env,
        sample=False,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
    )
    torch.manual_seed(args.seed)
    group_specs = [s for s in specs for _ in range(args.g)]
    sampled = generate(
        model,
        tokenizer,
        [s.text for s in group_specs],
        env,
        sample=True,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
    )
    greedy_ok = correctness(env, specs, greedy.texts)
    sampled_ok = correctness(env, group_specs, sampled.texts)
    sampled_total = totals(env, group_specs, sampled.texts)
    print(f"\n== {resolve_model_name(name)}  ({folder}; prepare {prep_s:.1f}s)")
    print(
        f"prompts {len(specs)} held-out, G={args.g}, max_new_tokens={args.max_new_tokens}, "
        f"threads={args.threads}, batch={args.batch_size}"
    )
    print(f"greedy accuracy            {statistics.mean(greedy_ok):.3f}")
    print(f"sampled accuracy (T=1)     {statistics.mean(sampled_ok):.3f}")
    print(f"groups with reward variance (correctness) {varied_fraction(sampled_ok, args.g):.3f}")
    print(f"groups with reward variance (total)       {varied_fraction(sampled_total, args.g):.3f}")
    print(
        f"parseable (format) rate    {statistics.mean(r[1] or 0.0 for r in env.rewards(group_specs, sampled.texts)):.3f}"
    )
    for label, gen in (("greedy", greedy), ("sampled", sampled)):
        tokens = sum(gen.n_tokens)
        print(
            f"{label:8s} tokens/s {tokens / gen.seconds:7.1f}  completions/s {len(gen.texts) / gen.seconds:6.1f}  "
            f"({tokens} new tokens, {gen.seconds:.1f}s, mean {tokens / len(gen.n_tokens):.2f} per completion; "
            "prompt prefill included in the time)"
        )
    _print_families(specs, greedy_ok, sampled_ok, args.g)
    print("examples (greedy):", [(s.text.rsplit("\n", 1)[-1], t) for s, t in zip(specs[:6], greedy.texts)])
    print(
        "examples (sampled):",
        [
            (group_specs[i].text.rsplit("\n", 1)[-1], sampled.texts[i])
            for i in range(0, min(len(sampled.texts), 6 * args.g), args.g)
        ],
    )


def _print_families(specs: list[PromptSpec], greedy_ok: list[float], sampled_ok: list[float], g: int) -> None:
    by_family: dict[str, list[int]] = defaultdict(list)
    for i, spec in enumerate(specs):
        by_family[str(spec.info.get("family", "-"))].append(i)
    for family, idx in sorted(by_family.items()):
        groups = [sampled_ok[i * g : (i + 1) * g] for i in idx]
        varied = sum(max(gr) > min(gr) for gr in groups) / len(groups)
        acc = statistics.mean(v for gr in groups for v in gr)
        print(
            f"  {family:10s} n={len(idx):3d} greedy {statistics.mean(greedy_ok[i] for i in idx):.2f} "
            f"sampled {acc:.2f} varied {varied:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gemma,tiny", help="comma-separated model names")
    parser.add_argument("--env", default="arithmetic")
    parser.add_argument("--n", type=int, default=40, help="held-out prompts")
    parser.add_argument("--g", type=int, default=8, help="samples per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the environment's")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per generate call")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    env = get_environment(args.env)
    if args.max_new_tokens is None:
        args.max_new_tokens = env.max_new_tokens
    torch.set_num_threads(args.threads)
    specs = heldout_prompts(env, args.n, args.seed)
    print(f"env {env.name} v{env.version}; prompt example:\n{specs[0].text!r}")
    for name in args.models.split(","):
        run_model(name.strip(), env, specs, args)


if __name__ == "__main__":
    main()
