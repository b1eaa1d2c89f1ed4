"""What a trainer's lease book and ledger hold after a long run, old code against new in one run
(the memory-bounds work: LeaseBook forgets closed leases and folds its admitted prefix, the
ledger clears finished batches past `ledger_keep_s`).

    .venv/bin/python benchmarks/long_run_memory.py                    # 100k leases, 20k batches, vs a251370
    .venv/bin/python benchmarks/long_run_memory.py --leases 1000000 --batches 50000

Lease book: `--leases` leases of 2 prompts, one a millisecond, ttl 10 s, 90% answered in full, 5%
in part, 5% never (they expire and come back); the figure is the Python heap the book holds
(tracemalloc, bytes) and its growth in the process's peak RSS. Ledger: `--batches` admitted
batches (one a second, 2 groups of 8 completions of 64 tokens each, on disk with
synchronous=NORMAL), trained 5 s after they arrive, compacted every 10 s with a one-hour window
where the code has `Ledger.compact`; the figures are the database's file size (with its WAL)
and the payload bytes it stores. Each side runs in a fresh process; the old from `git archive`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

from old_code import old_tree  # benchmarks/old_code.py (run as a script)

BASE_REF = "a251370"   # main before the memory-bounds work
KEEP_MS = 3600 * 1000


def lease_book(leases: int) -> dict[str, float]:
    """Drive `leases` leases through a LeaseBook; its heap (tracemalloc) and the RSS growth."""
    from swarmrl.protocol.leases import LeaseBook
    from swarmrl.protocol.pb import swarm_pb2 as pb

    rng, sampling = random.Random(0), pb.SamplingParams(n=8)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    book = LeaseBook("job", ttl_ms=10_000)
    for n in range(leases):
        book.expire(n)
        lease = book.issue(f"peer-{n % 200}", 2, 0, sampling, n)
        roll = rng.random()
        if roll < 0.9:
            book.record_answers(lease.lease_id, list(lease.prompt_indices))
        elif roll < 0.95:
            book.record_answers(lease.lease_id, [lease.prompt_indices[0]])
    heap = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    return {"book_heap_bytes": heap, "book_rss_growth_kib": rss}


def ledger(batches: int, state: Path) -> dict[str, float]:
    """Admit `batches` batches into a ledger under `state`, train them, compact when the code can."""
    from swarmrl.node.trainer.ledger import Ledger
    from swarmrl.protocol.pb import swarm_pb2 as pb

    led = Ledger(state / "ledger.sqlite", synchronous="normal")
    compact = getattr(led, "compact", None)
    comps = [pb.Completion(token_ids=list(range(64)), logprobs=[-0.5] * 64, policy_version=0, reward=0.5)] * 8
    for n in range(batches):
        now = n * 1000
        lease = pb.Lease(lease_id=f"L{n}", job_id="J", peer_id=f"P{n % 200}", prompt_indices=[2 * n, 2 * n + 1],
                         deadline_ms=now + 30_000)
        led.add_lease(lease)
        groups = [pb.Group(prompt_index=i, prompt_token_ids=list(range(40)), completions=comps)
                  for i in lease.prompt_indices]
        batch = pb.RolloutBatch(job_id="J", lease_id=lease.lease_id, peer_id=lease.peer_id, groups=groups)
        led.admit(f"b{n}", batch, pb.Signed(body=batch.SerializeToString()), groups, now, close_lease=True)
        led.mark([p.row_id for p in led.pending("J", 32) if p.group.prompt_index < 2 * (n - 5)], "trained", step=n)
        if compact is not None and n % 10 == 0:
            compact("J", now - KEEP_MS)
    # the payload columns' bytes, read directly: the old code has no Ledger.stored_bytes
    payload = sum(int(led._query(f"SELECT COALESCE(SUM(length({c})), 0) FROM {t}")[0][0])
                  for t, c in (("batches", "envelope"), ("groups", "grp"), ("leases", "lease")))
    led.close()
    files = sum(p.stat().st_size for p in state.glob("ledger.sqlite*"))
    return {"ledger_file_bytes": files, "ledger_payload_bytes": payload}


def _child(args: argparse.Namespace, pythonpath: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as state:
        env = {**os.environ, "PYTHONPATH": f"{pythonpath}:{os.environ.get('PYTHONPATH', '')}"}
        cmd = [sys.executable, __file__, "--child", "--leases", str(args.leases), "--batches", str(args.batches),
               "--state", state]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=state).stdout
        return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    """Parse the options; as the parent, run the old and the new code and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--leases", type=int, default=100_000)
    ap.add_argument("--batches", type=int, default=20_000)
    ap.add_argument("--old-ref", default=BASE_REF)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps({**lease_book(args.leases), **ledger(args.batches, args.state)}))
        return
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        old = _child(args, old_tree(args.old_ref, Path(tmp)))
    new = _child(args, root)   # this checkout: its swarmrl/ links to node/, protocol/, ...
    print(f"{args.leases} leases, {args.batches} batches: old {args.old_ref} -> new")
    for key in old:
        ratio = new[key] / old[key] if old[key] else float("nan")
        print(f"  {key:24s} {old[key]:>14,.0f} -> {new[key]:>14,.0f}   new/old {ratio:.3f}")


if __name__ == "__main__":
    main()
