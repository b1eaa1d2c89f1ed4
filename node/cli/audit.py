"""`swarmrl audit JOB --trainer HOST:PORT`: re-check a trainer's books from what others signed
(issue 27 item 3, docs/CREDIT.md). Fetches the trainer's contribution statements and checks
them as a chain (with `--initial-peers MADDR` and no `--trainer`: from the public record, the
statements peer to peer from any holder, the trainer found by its job record: `audit.public`);
checks the signed update of the head version (and `--adapters` more) against its statement;
samples credited batches from the trainer and checks each against its worker's signature (with
`--recheck`, also through the validator's ladder: `audit_ladder`); with `--receipts`, checks a
worker's receipts are credited or listed dropped. Prints the findings (a rich table, or `--json`), writes the signed `AuditReport` with `--report`, and
with `--publish --initial-peers MADDR` puts it in the swarm's DHT (`swarm.audit_records`);
`swarmrl audit JOB --published --initial-peers MADDR` lists what auditors published.

Exit: 0 the books add up (every published report clean), 1 findings, 2 bad arguments or a job it
can't reach (one line).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmrl.node.cli.checks import UsageError, endpoint, int_at_least, nonempty, positive_float, sha256_hex
from swarmrl.protocol.audit import FRESH_S

if TYPE_CHECKING:
    from swarmrl.node.audit.books import AuditPlan
    from swarmrl.node.audit.client import AuditClient
    from swarmrl.protocol.identity import Identity
    from swarmrl.protocol.pb import swarm_pb2 as pb

EXIT_CLEAN, EXIT_FINDINGS = 0, 1


def _adapters(text: str) -> int | None:
    """An argparse type: "all" (None) or an integer >= 0."""
    if text == "all":
        return None
    try:
        return int_at_least(0)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or all, got {text!r}") from None


_adapters.__name__ = "N or all"


def add_parser(sub: Any, make: Any) -> None:
    """Add the `audit` subcommand to `sub` (`make(sub, name, help)` builds a subparser)."""
    a = make(sub, "audit", "re-check a trainer's credit books: statements, batches, receipts")
    a.add_argument("job_id", type=nonempty, help="the job's id")
    a.add_argument("--trainer", type=endpoint, metavar="HOST:PORT",
                   help="the trainer's gRPC endpoint; without it, --initial-peers reads the public record (the "
                        "trainer's job record, its statements from any peer that holds them)")
    a.add_argument("--tls-sha256", type=sha256_hex, default=b"", metavar="HEX",
                   help="the trainer serves TLS: pin its certificate; without it, plaintext")
    a.add_argument("--trainer-id", default="", metavar="PEER_ID",
                   help="the trainer's peer id (from its signed job record); default: the one its status names")
    a.add_argument("--sample", type=int_at_least(0), default=64, help="credited batches to check (0: all)")
    a.add_argument("--adapters", type=_adapters, default=1, metavar="N|all",
                   help="versions besides the head whose signed update is checked against the statement "
                        "(all: every one in the window the trainer still keeps)")
    a.add_argument("--window-s", type=positive_float, default=None, metavar="SECONDS",
                   help="draw the batches and updates only among the statements of the last SECONDS (the "
                        "chain is checked whole either way); an auditor that audits every few minutes catches "
                        "more with --window-s 600 --adapters all (docs/CREDIT.md section 6)")
    a.add_argument("--seed", type=int, default=None, help="the sample's seed (default: random)")
    a.add_argument("--fresh-s", type=positive_float, default=FRESH_S, metavar="SECONDS",
                   help="a credited batch of a statement newer than this the trainer must still serve, else "
                        "unknown_batch (older ones may be compacted; default: half the trainer's default "
                        "ledger_keep_s)")
    a.add_argument("--receipts", type=Path, default=None, metavar="PATH",
                   help="a worker's receipt store (a <peer id>.sqlite file, or the receipts/ folder of its cache)")
    a.add_argument("--recheck", action="store_true",
                   help="also run the validator's ladder on each sampled credited batch (re-grading, recomputed "
                        "log-probs of the sampled tokens, ...): loads the job's base model from --cache-dir")
    a.add_argument("--replay", type=_adapters, default=0, metavar="N|all",
                   help="recompute the job's first N versions (all: every one) from version 0 on the groups its "
                        "statements credit, and check each published version is that step (needs --trainer and "
                        "the base model in --cache-dir; costs the trainer's compute for those steps)")
    a.add_argument("--cache-dir", type=Path, help="base model cache for --recheck (default: $SWARMRL_CACHE or "
                                                  "~/.cache/swarmrl)")
    a.add_argument("--key", type=Path, default=None, help="the auditor's key file, to sign the report (created)")
    a.add_argument("--report", type=Path, default=None, help="write the signed AuditReport (binary Signed) here")
    a.add_argument("--json", action="store_true", help="print the report as JSON")
    a.add_argument("--initial-peers", nargs="+", default=None, metavar="MADDR",
                   help="the swarm to audit from (no --trainer), publish the report to (--publish) or read "
                        "reports from (--published)")
    a.add_argument("--publish", action="store_true",
                   help="publish the signed report in the swarm's DHT, under the job and this auditor's key "
                        "(with --key: the same auditor's next report replaces it)")
    a.add_argument("--published", action="store_true",
                   help="audit nothing: list the reports auditors published for the job (signatures checked)")


def _receipt_envelopes(path: Path, job_id: str) -> list[pb.Signed]:
    from swarmrl.node.worker.receipts import job_receipts

    files = sorted(path.glob("*.sqlite")) if path.is_dir() else [path]
    if not path.exists() or not files:
        raise UsageError(f"--receipts {str(path)!r}: no receipt store there")
    out: list[pb.Signed] = []
    for f in files:
        try:
            out += job_receipts([f], job_id)
        except sqlite3.DatabaseError as exc:
            raise UsageError(f"--receipts {str(f)!r} is not a receipts file ({exc})") from exc
    return out


def run_audit(args: argparse.Namespace) -> int:
    """Audit the job (module docstring, `audit.books.audit_job`); returns the exit code.

    Raises:
        AuditUnreachable: the trainer or the job's public record can't be reached.
        UsageError: a bad --receipts path, or options that don't go together.
    """
    if (args.publish or args.published) and not args.initial_peers:
        raise UsageError(f"--{'publish' if args.publish else 'published'} needs --initial-peers MADDR: the swarm's DHT")
    if args.published:
        return _print_published(args)
    if args.replay != 0 and args.trainer is None:
        raise UsageError("--replay needs --trainer HOST:PORT (the credited batches and every version's delta)")
    if args.trainer is None and not args.initial_peers:
        raise UsageError("--trainer HOST:PORT or --initial-peers MADDR is required (the trainer, or the swarm "
                         "whose public record to audit)")
    from swarmrl.node.audit.books import AuditPlan
    from swarmrl.protocol.identity import Identity

    receipts = _receipt_envelopes(args.receipts, args.job_id) if args.receipts is not None else None
    auditor = Identity.load_or_create(args.key) if args.key is not None else Identity.generate()
    plan = AuditPlan(sample=args.sample, adapters=args.adapters, seed=args.seed, fresh_s=args.fresh_s,
                     window_s=args.window_s or 0.0)
    audit = _audit_public if args.trainer is None else _audit_trainer
    report = audit(args, plan, auditor, receipts)
    _output(args, report)
    if args.report is not None or args.publish:
        from swarmrl.protocol.audit import sign_report

        signed = sign_report(auditor, report)
        if args.report is not None:
            write_report(args.report, signed)
        if args.publish:
            _publish(args.initial_peers, signed)
    return EXIT_FINDINGS if report.findings else EXIT_CLEAN


def _audit_trainer(args: argparse.Namespace, plan: AuditPlan, auditor: Identity,
                   receipts: list[pb.Signed] | None) -> pb.AuditReport:
    """Audit the job at the trainer `--trainer` names (gRPC), with the ladder (`--recheck`) and
    the replay (`--replay`) when asked.

    Raises:
        AuditUnreachable: the trainer can't be reached or does not host the job.
        UsageError: `--recheck` or `--replay` can't judge the job here.
    """
    import grpc

    from swarmrl.node.audit.books import AuditUnreachable, audit_job
    from swarmrl.node.audit.client import AuditClient
    from swarmrl.node.net.call_status import code_name

    client = AuditClient(args.trainer, args.tls_sha256)
    chain: list[pb.Signed] = []   # the statements that verified as a chain (the replay's input)
    try:
        with ExitStack() as stack:
            recheck = None
            if args.recheck:
                from swarmrl.node.cli.audit_ladder import ladder, record_over_grpc
                rec = record_over_grpc(client, args.job_id, args.trainer, args.tls_sha256, args.trainer_id)
                recheck = stack.enter_context(ladder(rec, auditor, args.cache_dir))
            report = audit_job(client, args.job_id, plan, auditor, trainer_id=args.trainer_id, receipts=receipts,
                               recheck=recheck, on_chain=chain.extend)
        if args.replay != 0:
            _replay(args, client, report, chain)
        return report
    except grpc.RpcError as exc:
        raise AuditUnreachable(f"cannot reach the trainer at {args.trainer} ({code_name(exc)}); is it running, "
                               "and is --trainer its HOST:PORT?") from exc
    finally:
        client.close()


def _replay(args: argparse.Namespace, client: AuditClient, report: pb.AuditReport, chain: list[pb.Signed]) -> None:
    """Replay the job's first `--replay` versions of `chain` (the statements the audit verified,
    `audit_replay`); its findings join the report.

    Raises:
        UsageError: a job whose trainer did not step alone, or a base model not here.
    """
    from swarmrl.node.cli.audit_replay import check_replayable, model_for, replay
    from swarmrl.protocol.jobspec import JobSpec
    from swarmrl.protocol.pb import swarm_pb2 as pb

    status = client.status(args.job_id)
    spec = JobSpec.from_json(status.spec_json)
    check_replayable(status, spec)
    statements = [pb.ContributionStatement.FromString(e.body) for e in chain]
    done = replay(client, args.job_id, report.trainer_id, statements, spec, model_for(spec, args.cache_dir),
                  args.replay)
    report.findings.extend(done.findings)
    print(f"replayed {done.versions} version(s) from version 0: {len(done.findings)} not the credited step, the "
          f"others within {done.worst:.2g} of it ({done.step_s:.2f} CPU-s per step)"
          + (f"; stopped: {done.stopped}" if done.stopped else ""), file=sys.stderr)


def _audit_public(args: argparse.Namespace, plan: AuditPlan, auditor: Identity,
                  receipts: list[pb.Signed] | None) -> pb.AuditReport:
    """Audit the job from the public record of the swarm at `--initial-peers` (`audit.public`).

    Raises:
        AuditUnreachable: no trainer, holder or statement of the job could be found or read.
        SwarmError: none of the initial peers could be reached.
    """
    from swarmrl.node.audit.books import AuditUnreachable, audit_job
    from swarmrl.node.audit.public import PublicBooks
    from swarmrl.node.swarm.dht import start_dht

    dht = start_dht(args.initial_peers, client_mode=True)
    try:
        books = PublicBooks(dht, args.job_id, args.trainer_id)
        try:
            if (receipts is not None or args.recheck) and books.verified is None:
                raise AuditUnreachable(f"{'--receipts' if receipts is not None else '--recheck'} needs the trainer's "
                                       "job record (the job's spec), and the swarm has none any more")
            with ExitStack() as stack:
                recheck = None
                if args.recheck:
                    from swarmrl.node.cli.audit_ladder import ladder
                    assert books.verified is not None
                    recheck = stack.enter_context(ladder(books.verified, auditor, args.cache_dir))
                report = audit_job(books, args.job_id, plan, auditor, trainer_id=books.trainer_id, receipts=receipts,
                                   record=books.record, recheck=recheck)
            held = books.holder
            assert held is not None   # statements() succeeded
            print(f"statements from {'the trainer' if held.is_trainer else 'mirror ' + held.holder_id[:16]} over "
                  f"libp2p (head version {held.head_version}); batches and updates "
                  f"{'from the trainer' if report.batches_checked else 'not served'}"
                  + (f"; {len(books.holders_tried)} holder(s) failed" if books.holders_tried else ""), file=sys.stderr)
            return report
        finally:
            books.close()
    finally:
        dht.shutdown()


def _publish(initial_peers: list[str], signed: pb.Signed) -> None:
    """Store the signed report in the swarm's DHT (`swarm.audit_records`).

    Raises:
        SwarmError: none of the initial peers could be reached, or the DHT did not store it."""
    from swarmrl.node.swarm.audit_records import publish_report
    from swarmrl.node.swarm.dht import SwarmError, start_dht

    dht = start_dht(initial_peers, client_mode=True)
    try:
        if not publish_report(dht, signed):
            raise SwarmError("the swarm's DHT did not store the audit report (no peer took it)")
    finally:
        dht.shutdown()
    print("audit report published in the swarm's DHT", file=sys.stderr)


def _print_published(args: argparse.Namespace) -> int:
    """List the job's published reports (`--published`): 0 when every report is clean, 1 when
    any names a finding, 2 (UsageError) when none was published."""
    from swarmrl.node.cli.status import message_dict
    from swarmrl.node.swarm.audit_records import published_reports
    from swarmrl.node.swarm.dht import start_dht

    dht = start_dht(args.initial_peers, client_mode=True)
    try:
        found = published_reports(dht, args.job_id)
    finally:
        dht.shutdown()
    if not found:
        raise UsageError(f"no auditor has published a report of job {args.job_id} in this swarm")
    if args.json:
        print(json.dumps([message_dict(p.report) for p in found], indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table("auditor", "trainer", "head version", "statements", "batches checked", "findings", "age",
                      title=f"published audits of job {args.job_id}")
        now_ms = time.time() * 1000
        for p in found:
            r = p.report
            reasons = Counter(f.reason for f in r.findings)
            table.add_row(r.auditor_id[:16], r.trainer_id[:16], str(r.head_version), str(r.statements),
                          str(r.batches_checked), ", ".join(f"{k} {n}" for k, n in sorted(reasons.items())) or "none",
                          f"{max(0.0, now_ms - r.created_ms) / 1000:.0f} s")
        Console().print(table)
    return EXIT_FINDINGS if any(p.report.findings for p in found) else EXIT_CLEAN


def _output(args: argparse.Namespace, report: pb.AuditReport) -> None:
    from swarmrl.node.cli.status import message_dict

    if args.json:
        print(json.dumps(message_dict(report), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"audit of job {report.job_id} at trainer {report.trainer_id[:16]}: {report.statements} statements "
                  f"(head version {report.head_version}), {report.batches_checked} batches checked "
                  f"({report.batches_unavailable} not served: compacted, or the trainer is gone), {report.receipts_checked} receipts checked "
                  f"({report.receipts_pending} groups not due yet)", markup=False)
    if not report.findings:
        console.print("no findings: the books add up")
        return
    table = Table("reason", "version", "peer", "batch", "detail", title=f"{len(report.findings)} findings")
    for f in report.findings:
        table.add_row(f.reason, str(f.version), f.peer_id[:16], f.batch_id[:16], f.detail)
    console.print(table)


def write_report(path: Path, envelope: pb.Signed) -> None:
    """Write the signed report to `path` (binary `Signed`)."""
    path.write_bytes(envelope.SerializeToString())
    print(f"signed audit report written to {path}", file=sys.stderr)
