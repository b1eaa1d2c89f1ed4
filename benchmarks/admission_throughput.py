"""Admission throughput (issue 11 item 8): signed rollout groups per second through the trainer's
admission path (signature, lease, checks, ledger commit on disk), from one thread or several at
once, against the same path at an older commit in the same run.

    .venv/bin/python benchmarks/admission_throughput.py                 # tiny model, vs 7a25018
    .venv/bin/python benchmarks/admission_throughput.py --threads 8 --old-ref a251370
    .venv/bin/python benchmarks/admission_throughput.py --model gemma --repeats 5

Many peers (`--peers`) each lease `--prompts` prompts and answer with one signed batch of G
completions per prompt; batches are built and signed before the clock starts, with prompt ids
from the worker's own tokenizer (the trainer's prompt-id cache starts cold, as in a live job).
Each repeat runs the old and the new code in fresh processes (the old from `git archive
--old-ref`), alternating, and prints groups per wall second and per CPU second (process time:
the figure "on one core"), their medians and new/old ratios; the new code runs twice, with
the ledger's default synchronous=FULL and with NORMAL (`Ledger` says what each promises).
`--threads N` admits the batches from N threads at once, as the trainer's gRPC threads do when
many workers submit together; the new code's FULL ledger then shares a WAL sync among batches
committed while one runs (`node/runtime/group_commit.py`; syncs per batch are printed). Only the
admission loop is timed: process CPU time from the first `admit` to the last receipt (with
threads: the pool's threads, as the server's would be), nothing of building or signing.
The wall figures move with whatever else the machine runs; CPU seconds much less.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from old_code import OLD_REF, old_tree  # benchmarks/old_code.py (run as a script)


def measure(model: str, peers: int, prompts: int, group_size: int, tokens: int, state: Path,
            sync: str = "full", threads: int = 1) -> dict[str, float]:
    """Admit `peers` signed batches on a fresh ledger under `state` (synchronous `sync`: only
    the new code takes another than "full"), from `threads` threads at once; groups/s (wall
    and CPU) and the ledger's WAL syncs per batch (new code, "full")."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from swarmrl.node.models.base_model import default_cache_dir, find_base_model
    from swarmrl.node.models.causal_lm import load_causal_lm, render_prompt
    from swarmrl.node.tasks.builtin_jobs import builtin_job
    from swarmrl.node.trainer.job import JobRuntime
    from swarmrl.node.trainer.ledger import Ledger
    from swarmrl.protocol import signing
    from swarmrl.protocol.envs import job_environment
    from swarmrl.protocol.identity import Identity
    from swarmrl.protocol.pb import swarm_pb2 as pb

    cache = default_cache_dir()
    spec = builtin_job(model, cache, steps=10**6, batch_groups=4096, prompts_per_lease=prompts, group_size=group_size,
                       lease_ttl_s=3600)
    path = find_base_model(spec.base_model, cache)
    tokens = min(tokens, spec.sampling.max_new_tokens)
    ledger = Ledger(state / "ledger.sqlite") if sync == "full" else Ledger(state / "ledger.sqlite", synchronous=sync)
    job = JobRuntime("job-bench", spec, identity=Identity.from_seed(b"t" * 32), model_path=path, state_dir=state,
                     ledger=ledger)
    _, worker_tok = load_causal_lm(path)   # the worker's tokenizer: its own, not the trainer's cache
    env = job_environment(spec, None)
    n_rewards = len(env.reward_funcs)
    lo, hi = env.reward_range
    envelopes = []
    for k in range(peers):
        who = Identity.from_seed(k.to_bytes(4, "little") * 8)
        reply = job.admission.request_lease(who.peer_id, pb.LeaseRequest(job_id=job.job_id, max_prompts=prompts))
        assert reply.HasField("lease"), reply.reason
        lease = reply.lease
        groups = []
        for i in lease.prompt_indices:
            ids = render_prompt(worker_tok, env.prompt(spec.seed, i), spec.chat_template)
            comps = [pb.Completion(token_ids=[5 + (j % 50) for j in range(tokens)], logprobs=[-1.0] * tokens,
                                   finish_reason="length", policy_version=lease.policy_version,
                                   rewards=[lo] * n_rewards, reward=lo + (hi - lo) * (c % 2)) for c in range(group_size)]
            groups.append(pb.Group(prompt_index=i, prompt_token_ids=ids, completions=comps))
        batch = pb.RolloutBatch(job_id=job.job_id, lease_id=lease.lease_id, peer_id=who.peer_id, groups=groups,
                                created_ms=int(time.time() * 1000), nonce=os.urandom(16))
        envelopes.append(signing.sign(who, signing.ROLLOUT_BATCH, batch))
    profile = None
    if os.environ.get("ADMISSION_PROFILE"):   # print where the admission loop's time goes
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    group = getattr(ledger, "_group", None)   # the new code's group commit (None: old code, or "normal")
    syncs0 = group.syncs if group is not None else 0
    t0, c0 = time.perf_counter(), time.process_time()
    if threads == 1:
        receipts = [job.admission.admit(envelope, 16 << 20) for envelope in envelopes]
    else:   # the gRPC server's threads, each admitting one worker's batch
        with ThreadPoolExecutor(threads) as pool:
            receipts = list(pool.map(lambda envelope: job.admission.admit(envelope, 16 << 20), envelopes))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    syncs = group.syncs - syncs0 if group is not None else float("nan")
    admitted = 0
    for receipt in receipts:
        assert receipt.accepted, receipt.reason
        assert all(g.admitted for g in receipt.groups), [g.reason for g in receipt.groups]
        admitted += sum(g.admitted for g in receipt.groups)
    if profile is not None:
        profile.disable()
        profile.print_stats("tottime")
    assert admitted == peers * prompts, admitted
    ledger.close()
    return {"groups": admitted, "tokens": tokens, "wall_s": wall, "cpu_s": cpu, "per_wall_s": admitted / wall,
            "per_cpu_s": admitted / cpu, "syncs_per_batch": syncs / peers}


def _child(args: argparse.Namespace, pythonpath: Path | None, sync: str = "full") -> dict[str, float]:
    with tempfile.TemporaryDirectory() as state:
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = f"{pythonpath}:{env.get('PYTHONPATH', '')}"
        cmd = [sys.executable, __file__, "--child", "--model", args.model, "--peers", str(args.peers), "--prompts",
               str(args.prompts), "--group-size", str(args.group_size), "--tokens", str(args.tokens), "--state", state,
               "--sync", sync, "--threads", str(args.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=state).stdout
        return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    """Parse the options; as the parent, alternate old/new children and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--peers", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per lease = groups per batch")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32, help="completion tokens (at most the job's max_new_tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="threads admitting at once (the trainer's gRPC threads)")
    ap.add_argument("--old-ref", default=OLD_REF)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sync", default="full", help=argparse.SUPPRESS)
    ap.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.peers, args.prompts, args.group_size, args.tokens, args.state,
                                 args.sync, args.threads)))
        return
    rows: dict[str, list[dict[str, float]]] = {"old": [], "new": [], "new-normal": []}
    with tempfile.TemporaryDirectory() as tmp:
        old = old_tree(args.old_ref, Path(tmp))
        for r in range(args.repeats):
            for name, path, sync in (("old", old, "full"), ("new", None, "full"), ("new-normal", None, "normal")):
                rows[name].append(_child(args, path, sync))
                f = rows[name][-1]
                print(f"repeat {r + 1} {name}: {f['groups']:.0f} groups, {f['per_wall_s']:,.0f}/s wall, "
                      f"{f['per_cpu_s']:,.0f}/CPU-s, WAL syncs per batch {f.get('syncs_per_batch', math.nan):.2f}",
                      flush=True)
    med = {n: {k: statistics.median(x[k] for x in v) for k in ("per_wall_s", "per_cpu_s")} for n, v in rows.items()}
    print(f"\n{args.model}: {args.peers} batches of {args.prompts} groups x G={args.group_size} x {args.tokens} tokens,"
          f" (at most max_new_tokens), {args.threads} thread(s) admitting, median of {args.repeats}")
    print(f"old ({args.old_ref}): {med['old']['per_wall_s']:,.0f} groups/s wall, {med['old']['per_cpu_s']:,.0f} per CPU-s")
    for name in ("new", "new-normal"):
        m = med[name]
        print(f"{name} (ledger synchronous={'NORMAL' if 'normal' in name else 'FULL'}): {m['per_wall_s']:,.0f} groups/s"
              f" wall, {m['per_cpu_s']:,.0f} per CPU-s; vs old: wall x{m['per_wall_s'] / med['old']['per_wall_s']:.2f},"
              f" CPU x{m['per_cpu_s'] / med['old']['per_cpu_s']:.2f}")


if __name__ == "__main__":
    main()
