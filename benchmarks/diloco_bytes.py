"""Bytes between two trainers per N steps: per-step gradient averaging against DiLoCo outer rounds.

Builds the built-in job's learner on `--model` (its LoRA config: the payload's shapes), starts two
hivemind DHT nodes on loopback and, for each mode, runs the real averaging rounds the trainers
run: per-step averaging is one `GradientAveraging` round (kind "avg") per step; DiLoCo with
`--inner-steps` H is one `OuterRounds` round per H steps (the pseudo-gradient, with the start-hash
check). The payload is random float32 tensors of the LoRA parameters' shapes (the rounds send
float32 uncompressed, so bytes depend on the shapes only). Bytes are what each member's all-reduce
runner put on the wire (protobuf-serialized tensor parts out and averaged parts back,
`ExactAllReduceRunner.bytes_sent`), summed over both trainers; matchmaking and libp2p framing
are not counted. Usage:

    .venv/bin/python benchmarks/diloco_bytes.py [--model tiny|gemma] [--steps 60] [--inner-steps 8]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable

import torch


def _pair(fn: Callable[[int], int]) -> int:
    """Run fn(0) and fn(1) at once (one thread each); the sum of what they return."""
    out = [0, 0]

    def run(i: int) -> None:
        out[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(out)


def main() -> None:
    from swarmrl.node.models.base_model import default_cache_dir, find_base_model
    from swarmrl.node.swarm.averaging import GradientAveraging
    from swarmrl.node.swarm.dht import start_dht, visible_maddrs
    from swarmrl.node.swarm.outer_round import OuterRounds
    from swarmrl.node.tasks.builtin_jobs import builtin_job
    from swarmrl.node.trainer.learner import Learner
    from swarmrl.protocol import diloco
    from swarmrl.protocol.identity import Identity

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--inner-steps", type=int, default=8)
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    cache = default_cache_dir()
    spec = builtin_job(args.model, cache)
    learner = Learner(find_base_model(spec.base_model, cache), spec)
    shapes = [tuple(p.shape) for p in learner.params]
    n_params = sum(p.numel() for p in learner.params)
    del learner
    first = start_dht()
    dhts = [first, start_dht(visible_maddrs(first))]
    template = [torch.zeros(s) for s in shapes]
    gen = torch.Generator().manual_seed(0)
    payloads = [[torch.randn(s, generator=gen) * 1e-3 for s in shapes] for _ in (0, 1)]
    keys = [Identity.generate() for _ in dhts]
    avgs = [GradientAveraging(d, "bench", template, identity=k, matchmaking_s=2.0, chunk_timeout_s=60,
                              allreduce_timeout_s=120) for d, k in zip(dhts, keys)]
    outers = [OuterRounds(d, "bench", template, timeout_s=60.0, identity=k) for d, k in zip(dhts, keys)]
    start = diloco.tensors_hash(template)
    figures: dict[str, dict[str, float]] = {}
    try:
        t0 = time.monotonic()
        sent, agreed = 0, 0
        for step in range(args.steps):
            def avg_round(i: int, step: int = step) -> int:
                pending = avgs[i].begin(step, {"i": i}, expected=2)
                got = avgs[i].finish(pending, payloads[i], 1.0)
                return got.bytes_sent + (1 << 40) * int(got.agreed)
            total = _pair(avg_round)
            agreed += total >> 40
            sent += total & ((1 << 40) - 1)
        figures["every_step"] = {"rounds": args.steps, "agreed_member_rounds": agreed, "bytes": sent,
                                 "seconds": time.monotonic() - t0}
        t0 = time.monotonic()
        sent, agreed, rounds = 0, 0, args.steps // args.inner_steps
        for r in range(1, rounds + 1):
            def outer_round(i: int, r: int = r) -> int:
                got = outers[i].run(r * args.inner_steps, start, payloads[i], 1.0, expected=2)
                return got.bytes_sent + (1 << 40) * int(got.agreed)
            total = _pair(outer_round)
            agreed += total >> 40
            sent += total & ((1 << 40) - 1)
        figures[f"diloco_H{args.inner_steps}"] = {"rounds": rounds, "agreed_member_rounds": agreed, "bytes": sent,
                                                  "seconds": time.monotonic() - t0}
    finally:
        for a in avgs:
            a.shutdown()
        for o in outers:
            o.shutdown()
        for d in dhts:
            d.shutdown()
    base = figures["every_step"]["bytes"]
    print(f"model {spec.base_model}: {n_params:,} LoRA parameters ({4 * n_params:,} float32 bytes); "
          f"two trainers, {args.steps} steps")
    print(f"{'mode':<12} {'rounds':>6} {'agreed':>6} {'bytes':>14} {'bytes/step':>12} {'vs per-step':>11} {'wall s':>7}")
    for mode, f in figures.items():
        ratio = base / f["bytes"] if f["bytes"] else float("inf")
        print(f"{mode:<12} {f['rounds']:>6} {f['agreed_member_rounds']:>6} {f['bytes']:>14,} "
              f"{f['bytes'] / args.steps:>12,.0f} {ratio:>10.2f}x {f['seconds']:>7.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": spec.base_model, "lora_params": n_params, "steps": args.steps, **figures}, fh, indent=1)


if __name__ == "__main__":
    main()
