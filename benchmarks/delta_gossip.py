"""Delta gossip: trainer upload per version and publish-to-everyone latency for 1, 2, 4, 8 workers.

Part 1 runs `swarmrl up --model tiny` (real processes on loopback: bootstrap, trainer, validator,
N workers gossiping adapter deltas) once per worker count and prints, per count:
  - trainer upload / version: adapter bytes the trainer served to workers (initial snapshots
    included) divided by the number of versions;
  - star / version: what a trainer serving every worker every delta would send (N x delta);
  - vs star: their ratio (above 1 when snapshots or re-fetches cost more than the star's deltas);
  - share: of the bytes the workers received, the share a trainer sent; peers: bytes workers served each other;
  - publish -> all: seconds from a version's publish until the last worker holds it (median, max).
`--star` adds a run per count with gossip off (every worker pulls from the trainer) to compare.

Part 2 (`--gemma-steps N`, N > 0) measures real deltas of Gemma 3 270M with the built-in job's
LoRA config: N GRPO steps on synthetic groups through the trainer's own Learner and AdapterStore
(the built-in job's delta codec), each delta's payload next to the base model's bytes, and the
same deltas under swarmrl's codecs (int4, int8, float32) and other lossless codecs (raw float32,
zstd, byte-shuffled zstd, XOR against the previous version + shuffle). `benchmarks/delta_size.py`
measures the codecs alone.

    .venv/bin/python benchmarks/delta_gossip.py [--workers 1,2,4,8] [--steps 8] [--star] [--gemma-steps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from swarmrl.node.local.up import UpOptions, run_up


def swarm_row(n: int, steps: int, root: Path, gossip: bool) -> dict:
    out = root / f"w{n}{'' if gossip else '-star'}"
    s = run_up(UpOptions(out=out, model="tiny", steps=steps, workers=n,
                         worker_overrides=[] if gossip else ["gossip=false"], eval_n=0))
    versions = max(1, int(s["final_version"]))
    return {"workers": n, "gossip": gossip, "versions": versions, "delta_bytes": s["delta_bytes_per_version"],
            "trainer_per_version": s["trainer_upload_bytes"] / versions,
            "star_per_version": n * s["delta_bytes_per_version"], "vs_star": s["trainer_upload_vs_star"],
            "share": s["trainer_upload_share"],
            "peer_bytes": s["peer_upload_bytes"], "lat_median": s["propagation_s_median"],
            "lat_max": s["propagation_s_max"], "agree": s["adapter_hash_agreement"]}


def print_swarm(rows: list[dict]) -> None:
    print(f"\n{'workers':>7} {'gossip':>6} {'versions':>8} {'delta B':>8} {'trainer B/ver':>13} {'star B/ver':>10} "
          f"{'vs star':>7} {'share':>6} {'peer B':>9} {'publish->all s (med/max)':>25} {'agree':>5}")
    for r in rows:
        lat = "-" if r["lat_median"] is None else f"{r['lat_median']:.2f} / {r['lat_max']:.2f}"
        print(f"{r['workers']:>7} {r['gossip']!s:>6} {r['versions']:>8} {r['delta_bytes']:>8} "
              f"{r['trainer_per_version']:>13.0f} {r['star_per_version']:>10} {r['vs_star']:>7.2f} {r['share']:>6.2f} "
              f"{r['peer_bytes']:>9} {lat:>25} {r['agree']!s:>5}")


# ---- part 2: Gemma deltas and codecs

def _shuffle(raw: bytes) -> bytes:
    """Byte-plane shuffle of float32 data (all 4th bytes, then all 3rd, ...)."""
    a = np.frombuffer(raw, dtype=np.uint8)
    return a.reshape(-1, 4).T.copy().tobytes()


def codec_sizes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, int]:
    """Payload bytes of one version's delta (`new`: the learner's state after the step) under
    swarmrl's codecs (int4 and int8 are lossy: replicas get the dequantised delta) and several
    lossless ones (which reconstruct `new` exactly from `old`)."""
    from swarmrl.protocol import adapter as ad
    from swarmrl.protocol import delta_codec as dc

    names = sorted(old)
    delta, _ = ad.make_delta(old, new)
    ours = {f"swarmrl {c}": len(dc.encode_delta(delta, c)[0]) for c in dc.CODECS}
    raw_delta = b"".join(delta[k].numpy().tobytes() for k in names)
    xor = b"".join((new[k].view(torch.int32) ^ old[k].view(torch.int32)).numpy().tobytes() for k in names)
    z3, z19 = zstandard.ZstdCompressor(level=3), zstandard.ZstdCompressor(level=19)
    return {**ours, "raw float32": len(raw_delta),
            "zstd-19 delta": len(z19.compress(raw_delta)), "shuffle + zstd-3 delta": len(z3.compress(_shuffle(raw_delta))),
            "xor prev + shuffle + zstd-3": len(z3.compress(_shuffle(xor)))}


def gemma_deltas(steps: int, root: Path) -> None:
    from swarmrl.node.models.base_model import prepare_base_model
    from swarmrl.node.models.causal_lm import encode_prompt
    from swarmrl.node.swarm.figures import base_model_bytes
    from swarmrl.node.tasks.builtin_jobs import builtin_job
    from swarmrl.node.trainer.adapter_store import AdapterStore
    from swarmrl.node.trainer.learner import Learner
    from swarmrl.protocol.envs import get_environment
    from swarmrl.protocol.identity import Identity
    from swarmrl.protocol.pb import swarm_pb2 as pb

    torch.set_num_threads(2)
    spec = builtin_job("gemma")
    path = prepare_base_model(spec.base_model)
    learner = Learner(path, spec)
    store = AdapterStore(root / "gemma-adapters", "gemma", Identity.generate())
    env = get_environment(spec.environment, spec.env_version)
    gen = torch.Generator().manual_seed(0)
    state = learner.state()
    store.put_snapshot(0, state)
    raw_adapter = sum(t.numel() * 4 for t in state.values())
    rows, sizes = [], []
    for v in range(1, steps + 1):
        groups = []
        for i in range(2):
            p = env.prompt(spec.seed, v * 10 + i)
            ids = encode_prompt(learner.tokenizer, p.text)
            comps = [pb.Completion(token_ids=torch.randint(10, 5000, (8,), generator=gen).tolist(), logprobs=[-3.0] * 8,
                                   finish_reason="length", policy_version=v - 1, reward=float(j % 2),
                                   rewards=[float(j % 2)]) for j in range(spec.group_size)]
            groups.append(pb.Group(prompt_index=v * 10 + i, prompt_token_ids=ids, completions=comps))
        t0 = time.monotonic()
        learner.step(groups, v - 1)
        new = learner.state()
        exact, update = store.publish(v, state, new)
        learner.load_state(exact)
        rows.append(codec_sizes(state, new))
        sizes.append(len(update.payload))
        state = exact
        print(f"gemma step {v}: delta {len(update.payload)} B ({time.monotonic() - t0:.1f}s)", flush=True)
    base = base_model_bytes(path)
    median = statistics.median(sizes)
    print(f"\nGemma 3 270M, LoRA rank {spec.lora.rank} alpha {spec.lora.alpha} on {spec.lora.target_modules}: "
          f"adapter {raw_adapter} B raw float32, base model {base} B")
    print(f"delta_bytes_per_version (median of {steps}) = {median:.0f} B; "
          f"delta / base model = {median / base:.5f}; delta / raw adapter = {median / raw_adapter:.3f}")
    print(f"{'codec':<40} " + " ".join(f"{'v' + str(i + 1):>10}" for i in range(steps)) + f" {'/ raw':>7}")
    for codec in rows[0]:
        vals = [r[codec] for r in rows]
        print(f"{codec:<40} " + " ".join(f"{x:>10}" for x in vals) + f" {statistics.median(vals) / raw_adapter:>7.3f}")
    print(json.dumps({"gemma_delta_bytes": sizes, "base_model_bytes": base, "adapter_bytes": raw_adapter,
                      "codecs": rows}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--star", action="store_true", help="also run with gossip off (every worker asks the trainer)")
    p.add_argument("--gemma-steps", type=int, default=0, help="measure N real Gemma deltas (part 2)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarmrl-gossip-") as tmp:
        rows = []
        for n in (int(x) for x in args.workers.split(",") if x):
            rows.append(swarm_row(n, args.steps, Path(tmp), gossip=True))
            if args.star:
                rows.append(swarm_row(n, args.steps, Path(tmp), gossip=False))
        if rows:
            print_swarm(rows)
            print(json.dumps(rows))
        if args.gemma_steps > 0:
            gemma_deltas(args.gemma_steps, Path(tmp))


if __name__ == "__main__":
    main()
