"""Credit's cost and whether it adds up (issue 27 figures), from a finished `swarmrl up` run.

    .venv/bin/python -m swarmrl.node.cli.main up --model tiny --steps 6 --workers 2 --out /tmp/up --no-eval
    .venv/bin/python benchmarks/credit_cost.py /tmp/up

Reads the trainer's ledger (`<out>/run/.../ledger.sqlite`, found under the run folder) and the
run's metrics.csv, then prints, per version and in total:
- statement bytes: the signed envelope as served (`FetchStatements`), body and signature;
- audit CPU seconds per version: process CPU time of the whole audit's pure work on the
  ledger's copies (the chain's signatures and order, and every credited batch checked against
  its worker's signed batch: `protocol.audit.check_chain` + `check_batch`), divided by the
  versions, next to the trainer's step seconds (metrics.csv `seconds`) as a share;
- credit adds up: the statements' credited groups vs `groups_trained` summed over metrics.csv,
  and per peer. Exit 1 when they differ.
The gRPC transfer of an audit is not in the CPU figure (it is the statement bytes above, plus
the sampled batches' bytes, which a validator's SampleAdmitted moves too).
"""

from __future__ import annotations

import argparse
import csv
import sqlite3
import statistics
import sys
import time
from pathlib import Path

from swarmrl.protocol import audit, signing
from swarmrl.protocol.pb import swarm_pb2 as pb


def main() -> int:
    """Print the figures for the run folder given; returns 1 when the credit does not add up."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the --out folder of a finished `swarmrl up` run")
    args = ap.parse_args()
    ledgers = [p for p in args.out.rglob("ledger.sqlite") if "trainer" in str(p)]
    if not ledgers or not (args.out / "metrics.csv").is_file():
        print(f"credit_cost: no trainer ledger.sqlite and metrics.csv under {args.out}", file=sys.stderr)
        return 2
    db = sqlite3.connect(f"file:{ledgers[0]}?mode=ro", uri=True)
    (job_id,), = db.execute("SELECT job_id FROM statements GROUP BY job_id ORDER BY COUNT(*) DESC LIMIT 1")
    envs = [pb.Signed.FromString(e) for (e,) in db.execute(
        "SELECT envelope FROM statements WHERE job_id = ? ORDER BY version", (job_id,))]
    batches = {b: (pb.Signed.FromString(e) if e else None, lease) for b, e, lease in db.execute(
        "SELECT batch_id, envelope, lease_id FROM batches WHERE job_id = ?", (job_id,))}
    admitted = {}
    for b, i in db.execute("SELECT b.batch_id, g.prompt_index FROM groups g JOIN batches b ON b.seq = g.batch_seq"
                           " WHERE g.job_id = ?", (job_id,)):
        admitted.setdefault(b, []).append(i)
    trainer_id = signing.signer_id(envs[0])
    with open(args.out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))

    t0 = time.process_time()
    statements, findings = audit.check_chain(envs, job_id=job_id, trainer_id=trainer_id)
    checked = unavailable = 0
    for st in statements:
        for b in st.batches:
            env, _ = batches.get(bytes(b.batch_id).hex(), (None, ""))
            if env is None:
                unavailable += 1
                continue
            served = pb.AdmittedBatch(batch=env, admitted_prompt_indices=admitted[bytes(b.batch_id).hex()])
            findings += audit.check_batch(job_id, st.version, b, served)
            checked += 1
    cpu = time.process_time() - t0

    sizes = [len(e.SerializeToString()) for e in envs]
    step_s = statistics.median(float(r["seconds"]) for r in rows)
    print(f"job {job_id[:16]}: {len(envs)} statements, trainer {trainer_id[:16]}")
    print("version  bytes  batches  groups  tokens  dropped")
    for e, n in zip(envs, sizes):
        st = pb.ContributionStatement.FromString(e.body)
        print(f"{st.version:7d}  {n:5d}  {len(st.batches):7d}  {st.groups:6d}  {st.tokens:6d}  "
              f"{sum(len(d.prompt_indices) for d in st.dropped):7d}")
    per_version = cpu / max(1, len(envs))
    print(f"statement bytes per version: median {statistics.median(sizes):.0f}, max {max(sizes)}, "
          f"per credited batch {sum(sizes) / max(1, sum(len(s.batches) for s in statements)):.0f}")
    print(f"audit CPU per version: {per_version * 1000:.2f} ms ({checked} batches checked, {unavailable} compacted), "
          f"{100 * per_version / step_s:.3f}% of the median trainer step ({step_s:.2f} s)")
    print(f"findings: {[f.reason for f in findings] or 'none'}")
    credited = sum(s.groups for s in statements)
    trained = sum(int(float(r["groups_trained"])) for r in rows)
    peers: dict[str, int] = {}
    for s in statements:
        for p in s.peers:
            peers[p.peer_id] = peers.get(p.peer_id, 0) + p.groups
    ledger_peers = dict(db.execute("SELECT peer_id, COUNT(*) FROM groups WHERE job_id = ? AND state = 'trained'"
                                   " GROUP BY peer_id", (job_id,)).fetchall())
    ok = credited == trained and peers == ledger_peers and not findings
    print(f"credit adds up: {ok} (statements credit {credited} groups, metrics.csv trained {trained}; "
          f"per peer {sorted(peers.values())} vs the ledger's {sorted(ledger_peers.values())})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
