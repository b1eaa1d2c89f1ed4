"""`swarmrl status`'s output: a job's status as tables (rich) or as JSON with hashes in hex; without
a job id, the table of every job the swarm announces."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from swarmrl.node.cli.checks import UsageError, endpoint, int_at_least, nonempty, sha256_hex

if TYPE_CHECKING:
    from google.protobuf.message import Message
    from rich.table import Table

    from swarmrl.node.swarm.listing import JobListing
    from swarmrl.protocol.leaderboard import Board
    from swarmrl.protocol.pb import swarm_pb2 as pb


def add_parser(sub: Any, make: Any) -> None:
    """Add the `status` subcommand to `sub` (`make(sub, name, help)` builds a subparser)."""
    st = make(sub, "status", "show a job's progress and peers; without a job id, every job the swarm announces")
    st.add_argument("job_id", nargs="?", type=nonempty, help="the id `swarmrl submit` printed (omit: list every job)")
    st.add_argument("--trainer", type=endpoint, metavar="HOST:PORT",
                    help="the gRPC endpoint of a trainer of the job (with a job id)")
    st.add_argument("--initial-peers", nargs="+", default=None, metavar="MADDR",
                    help="without a job id: a peer of the swarm to read the job records through (e.g. the "
                         "bootstrap's multiaddr, which `swarmrl up` prints)")
    st.add_argument("--tls-sha256", type=sha256_hex, default=b"", metavar="HEX",
                    help="the trainer serves TLS: pin its certificate (tls_sha256 in its ready file); without it, plaintext")
    st.add_argument("--history", type=int_at_least(0), default=10, help="recent steps to show")
    st.add_argument("--json", action="store_true", help="print the raw status as JSON (hashes in hex)")
    st.add_argument("--peers", action="store_true",
                    help="with a job id: the per-peer credit from the trainer's signed statements (a leaderboard)")
    st.add_argument("--csv", action="store_true", help="with --peers: one CSV row per peer")
    st.add_argument("--sample", type=int_at_least(0), default=64,
                    help="with --peers: credited batches checked against their workers' signatures (0: all)")


def message_dict(msg: Message) -> dict[str, Any]:
    """A protobuf message as JSON-ready data, like `MessageToDict` but with bytes fields in hex (as
    `fetch` and summary.json print hashes) instead of base64."""
    from google.protobuf.json_format import MessageToDict

    out = MessageToDict(msg)
    for field, value in msg.ListFields():
        if field.type == field.TYPE_BYTES:
            out[field.json_name] = [v.hex() for v in value] if field.is_repeated else value.hex()
        elif (field.type == field.TYPE_MESSAGE and field.message_type is not None
              and not field.message_type.GetOptions().map_entry):
            out[field.json_name] = [message_dict(v) for v in value] if field.is_repeated else message_dict(value)
    return out


def print_status(st: pb.JobStatus) -> None:
    """Print a job's status to stdout: one line of totals, then its recent steps and its peers
    (admitted, trained, no signal, rejected, verdicts, strikes, reputation, ban) as tables, each
    saying which steps its counts cover."""
    from rich.console import Console

    console = Console()
    console.print(f"job {st.job_id}: {st.state}, step {st.step}/{st.total_steps}, version {st.policy_version}, "
                  f"admitted {st.groups_admitted}, trained {st.groups_trained}, no signal {st.groups_no_signal}, "
                  f"dropped {st.groups_dropped}, rejected {dict(st.groups_rejected)}, "
                  f"validator checked {st.validator_checked} failed {st.validator_failed}, "
                  f"on probation {st.groups_on_probation}")
    if st.HasField("serving_workers"):
        console.print(f"workers serving it: {st.serving_workers}" + (
            f" - no worker can serve this job: {st.unserved_reason}" if st.unserved_reason else ""),
            markup=False, style="bold red" if st.unserved_reason else None)
    console.print(steps_table(st))
    console.print(peers_table(st))


def steps_table(st: pb.JobStatus) -> Table:
    """The recent steps (JobStatus.history), titled with how many of all the steps they are."""
    from rich.table import Table

    steps = Table("step", "reward", "loss", "staleness", "groups trained", "rejected", "seconds",
                  title=f"recent steps (the last {len(st.history)} of {st.step})")
    for h in st.history:
        steps.add_row(str(h.step), f"{h.reward_mean:.3f}", f"{h.loss:.4f}", f"{h.staleness_mean:.2f}",
                      str(h.groups_trained), str(h.groups_rejected), f"{h.seconds:.1f}")
    return steps


def peers_table(st: pb.JobStatus) -> Table:
    """Per-peer counts over the whole job: groups trained into versions, groups consumed by
    batches with no learning signal (no version made from them), rejected, verdicts, bans."""
    from rich.table import Table

    peers = Table("peer", "admitted", "groups trained into versions", "no signal", "rejected", "verdicts (failed)",
                  "strikes", "reputation", "banned",
                  title=f"peers, over all {st.step} steps (groups dropped by bans: {st.groups_dropped_banned})")
    for p in st.peers:
        peers.add_row(p.peer_id, str(p.groups_admitted), str(p.groups_trained), str(p.groups_no_signal),
                      str(p.groups_rejected), f"{p.verdicts_checked} ({p.verdicts_failed})", str(p.strikes),
                      f"{p.reputation:.2f}", p.ban_reason if p.banned else "")
    return peers


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def listing_table(rows: Sequence[JobListing]) -> Table:
    """One row per announced job (node/swarm/listing.py): state and head version, demand
    (capacity, intake per minute, weight), the workers able to serve it, its share of the running
    jobs' intake and its weighted share."""
    from rich.table import Table

    table = Table("job", "name", "state", "version", "trainers", "capacity", "intake/min", "weight",
                  "serving workers", "share", "weighted share", "note",
                  title=f"jobs the swarm announces ({len(rows)}); base models: "
                        f"{', '.join(sorted({r.base_model for r in rows})) or '-'}")
    for r in rows:
        state = "done" if r.done else "running"
        table.add_row(r.job_id[:12], r.name, state, f"{r.head_version}/{r.total_steps}", str(r.trainers),
                      str(r.capacity), f"{r.intake_per_min:.1f}", f"{r.weight:g}", str(r.serving_workers),
                      _pct(r.share), _pct(r.fair_share), r.problem or r.unserved_reason)
    return table


def credit_table(b: Board) -> Table:
    """The leaderboard (`protocol.leaderboard`) as a rich table, titled with what it sums."""
    from rich.table import Table

    table = Table("peer", "groups", "share", "tokens", "batches", "versions", "dropped", "checked", "verified share",
                  "banned", title=f"credit of job {b.job_id[:12]} from {b.statements} signed statements of trainer "
                                  f"{b.trainer_id[:12]} (versions {b.first_version}-{b.head_version}): "
                                  f"{b.groups} groups, {b.tokens} tokens")
    for r in b.rows:
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(r.dropped.items())) or "-"
        table.add_row(r.peer_id[:16], str(r.groups), _pct(r.share), str(r.tokens), str(r.batches),
                      f"{r.versions} ({r.first_version}-{r.last_version})" if r.versions else "0", dropped,
                      str(r.checked), _pct(r.verified_share), r.banned)
    return table


def print_board(b: Board, args: argparse.Namespace) -> None:
    """Print the leaderboard: a table and what the checks found, or `--json`, or `--csv`."""
    if args.json:
        print(json.dumps(b.as_dict(), indent=2))
        return
    if args.csv:
        print(b.csv_text(), end="")
        return
    from rich.console import Console

    console = Console()
    console = Console(width=max(console.width, 150))
    console.print(credit_table(b))
    if b.findings:
        console.print(f"the checks found {dict(b.findings)}: run `swarmrl audit {b.job_id} --trainer ...` for "
                      "the details", markup=False, style="bold red")


def print_listing(rows: Sequence[JobListing]) -> None:
    """Print the listing to stdout (a line saying so when the swarm announces no job)."""
    from rich.console import Console

    console = Console()
    console = Console(width=max(console.width, 150))   # a pipe's 80 columns would cut the figures
    if not rows:
        console.print("the swarm announces no job (a record expires within a minute of its trainer stopping)")
        return
    console.print(listing_table(rows))


def cmd_status(args: argparse.Namespace) -> int:
    """Print a job's status, as tables or (--json) as JSON; with --peers its leaderboard (table,
    --json or --csv; protocol/leaderboard.py); without a job id, list every job the swarm
    announces (node/swarm/listing.py).

    Raises:
        UsageError: a job id without --trainer, neither a job id nor --initial-peers, --peers
            without a job id, --csv without --peers or with --json.
        UnknownJob, UnknownJobBooks: the trainer does not host the job.
    """
    if args.csv and not args.peers:
        raise UsageError("--csv is for the leaderboard: add --peers")
    if args.csv and args.json:
        raise UsageError("--peers takes --json or --csv, not both")
    if args.job_id is None:
        if args.peers:
            raise UsageError("--peers shows one job's credit: give a job id and --trainer")
        if not args.initial_peers:
            raise UsageError("status without a job id lists the swarm's jobs: give --initial-peers MADDR (a peer "
                             "of the swarm, e.g. the bootstrap's, which `swarmrl up` prints), or a job id and --trainer")
        from swarmrl.node.swarm.listing import read_jobs

        rows = read_jobs(args.initial_peers)
        if args.json:
            print(json.dumps([r.as_dict() for r in rows], indent=2))
            return 0
        print_listing(rows)
        return 0
    if args.trainer is None:
        raise UsageError(f"status {args.job_id}: give --trainer HOST:PORT (a trainer of the job)")
    if args.peers:
        from swarmrl.node.audit.client import AuditClient
        from swarmrl.protocol.leaderboard import read_board

        print_board(read_board(AuditClient(args.trainer, args.tls_sha256), args.job_id, sample=args.sample), args)
        return 0
    from swarmrl.node.submitter.client import UnknownJob, job_status

    st = job_status(args.trainer, args.job_id, history=args.history, tls_sha256=args.tls_sha256)
    if st.state == "unknown":
        raise UnknownJob(f"unknown job {args.job_id!r}: the trainer at {args.trainer} does not host it "
                         "(use the id `swarmrl submit` printed)")
    if args.json:
        print(json.dumps(message_dict(st), indent=2))
        return 0
    print_status(st)
    return 0
