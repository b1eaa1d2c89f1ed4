"""Per-peer credit of one job from its trainer's signed contribution statements (issue 27 item 5,
docs/CREDIT.md): the leaderboard `swarmrl status JOB --peers` prints and the job page shows.

Every figure comes from the public record: the statements (signed by the trainer, chained; the
caller passes only those `protocol.audit.check_chain` verified) and, for the verified share, the
credited batches the reader fetched and checked against their workers' signatures
(`protocol.audit.check_batch`). Per peer:

- groups, tokens, batches: credited into versions (`CreditedBatch`), summed over the chain;
- share: its groups over all groups credited in the chain;
- versions: statements that credit it (first and last version);
- dropped: groups consumed without credit, by reason (`DroppedGroups.reason`: "stale_at_step",
  "no_signal", "banned: ...");
- banned: the reason of a ban, from a dropped entry "banned: ..." (the trainer's own word,
  signed), else from `bans` (the trainer's status: unsigned, marked "(status)");
- checked / verified: credited groups in batches the reader checked, and in those whose check
  passed; verified share = verified / checked (None when none was checked: compacted batches,
  or a reader that checks none).

`board` is pure; `read_board` reads a trainer's books through the small `Books` interface (its
gRPC client, `node.audit.client.AuditClient`, or a trainer's own, `node.trainer.ops.
LocalBooks`) and checks them (`protocol.audit`). Rows are sorted by groups (most first), then
peer id.
"""

from __future__ import annotations

import csv
import io
import random
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from swarmrl.protocol import audit, audit_sampling
from swarmrl.protocol.pb import swarm_pb2 as pb

BANNED_PREFIX = "banned"   # the ledger's reason for groups dropped by a ban ("banned: <why>")
CSV_FIELDS = ("peer_id", "groups", "share", "tokens", "batches", "versions", "first_version", "last_version",
              "dropped", "checked", "verified", "verified_share", "banned")


@dataclass
class Standing:
    """One peer's line on the board (see the module docstring for each figure)."""

    peer_id: str
    groups: int = 0
    tokens: int = 0
    batches: int = 0
    versions: int = 0
    first_version: int = 0
    last_version: int = 0
    dropped: Counter[str] = field(default_factory=Counter)   # reason -> groups
    checked: int = 0
    verified: int = 0
    banned: str = ""
    share: float = 0.0

    @property
    def verified_share(self) -> float | None:
        """verified / checked groups; None when none was checked."""
        return self.verified / self.checked if self.checked else None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, `dropped` as {reason: groups}, `verified_share` included."""
        return {"peer_id": self.peer_id, "groups": self.groups, "share": round(self.share, 6), "tokens": self.tokens,
                "batches": self.batches, "versions": self.versions, "first_version": self.first_version,
                "last_version": self.last_version, "dropped": dict(sorted(self.dropped.items())),
                "checked": self.checked, "verified": self.verified,
                "verified_share": None if self.verified_share is None else round(self.verified_share, 6),
                "banned": self.banned}


@dataclass(frozen=True)
class Board:
    """A job's leaderboard. statements: how many verified statements it sums (versions
    `first_version`..`head_version`); findings: the reasons the reader's checks found (a
    broken chain, a credited batch that did not check), by count."""

    job_id: str
    trainer_id: str
    statements: int
    first_version: int
    head_version: int
    groups: int
    tokens: int
    rows: list[Standing]
    findings: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (`swarmrl status JOB --peers --json`)."""
        return {"job_id": self.job_id, "trainer_id": self.trainer_id, "statements": self.statements,
                "first_version": self.first_version, "head_version": self.head_version, "groups": self.groups,
                "tokens": self.tokens, "findings": dict(self.findings), "peers": [r.as_dict() for r in self.rows]}

    def csv_text(self) -> str:
        """One CSV row per peer (`CSV_FIELDS`; dropped as `reason=groups;...`, an unknown verified
        share empty)."""
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(CSV_FIELDS)
        for r in self.rows:
            d = r.as_dict()
            d["dropped"] = ";".join(f"{k}={v}" for k, v in d["dropped"].items())
            d["verified_share"] = "" if d["verified_share"] is None else d["verified_share"]
            w.writerow([d[k] for k in CSV_FIELDS])
        return out.getvalue()


def board(job_id: str, trainer_id: str, statements: Sequence[pb.ContributionStatement], *,
          checks: Mapping[bytes, bool] | None = None, bans: Mapping[str, str] | None = None,
          findings: Mapping[str, int] | None = None) -> Board:
    """The leaderboard of `statements` (verified, ascending versions).

    checks: raw batch id (32 bytes) -> whether that credited batch passed the reader's check
    (batches not in it were not checked). bans: peer id -> ban reason from the trainer's status
    (unsigned; used where no statement names the ban). findings: reason -> count, carried over."""
    checks, bans = checks or {}, bans or {}
    rows: dict[str, Standing] = {}

    def row(peer_id: str) -> Standing:
        return rows.setdefault(peer_id, Standing(peer_id))

    for st in statements:
        credited: set[str] = set()
        for b in st.batches:
            r, n = row(b.peer_id), len(b.prompt_indices)
            r.groups, r.tokens, r.batches = r.groups + n, r.tokens + int(b.tokens), r.batches + 1
            credited.add(b.peer_id)
            ok = checks.get(bytes(b.batch_id))
            if ok is not None:
                r.checked += n
                r.verified += n if ok else 0
        for peer_id in credited:
            r = row(peer_id)
            r.first_version = r.first_version or int(st.version)
            r.last_version, r.versions = int(st.version), r.versions + 1
        for d in st.dropped:
            r = row(d.peer_id)
            r.dropped[d.reason] += len(d.prompt_indices)
            if d.reason.startswith(BANNED_PREFIX) and not r.banned:
                r.banned = d.reason.partition(":")[2].strip() or d.reason
    for peer_id, reason in bans.items():
        if peer_id in rows and not rows[peer_id].banned:
            rows[peer_id].banned = f"{reason} (status)"
    total = sum(r.groups for r in rows.values())
    for r in rows.values():
        r.share = r.groups / total if total else 0.0
    return Board(job_id=job_id, trainer_id=trainer_id, statements=len(statements),
                 first_version=int(statements[0].version) if statements else 0,
                 head_version=int(statements[-1].version) if statements else 0,
                 groups=total, tokens=sum(r.tokens for r in rows.values()),
                 rows=sorted(rows.values(), key=lambda r: (-r.groups, r.peer_id)), findings=dict(findings or {}))


SAMPLE = 64   # credited batches checked per read (0: all)


class Books(Protocol):
    """What a leaderboard reads of a trainer (`audit_client.AuditClient` over gRPC is one)."""

    def status(self, job_id: str) -> pb.JobStatus:
        """The trainer's status of the job (state "unknown" when it does not host it)."""

    def statements(self, job_id: str) -> list[pb.Signed]:
        """Every signed statement of the job, ascending versions."""

    def batches(self, job_id: str, batch_ids: Iterable[str]) -> dict[str, pb.AdmittedBatch]:
        """The named credited batches (hex ids) the trainer still keeps, by the id it claims."""


class UnknownJobBooks(ValueError):
    """The trainer does not host the job."""


def read_board(books: Books, job_id: str, *, sample: int = SAMPLE, seed: int | None = None) -> Board:
    """The job's leaderboard: statements verified as a chain (a break is a finding; the board
    sums the statements before it), `sample` credited batches (0: all) fetched and checked (a
    failed check is a finding, and its groups count as checked but not verified; a batch the
    trainer no longer keeps is not checked), bans from the trainer's status where no statement
    names one.

    Raises:
        UnknownJobBooks: the trainer does not host the job.
        grpc.RpcError: the trainer can't be reached.
    """
    status = books.status(job_id)
    if status.state == "unknown":
        raise UnknownJobBooks(f"the trainer does not host job {job_id!r}")
    statements, broken = audit.check_chain(books.statements(job_id), job_id=job_id, trainer_id=status.trainer_id)
    findings = Counter(f.reason for f in broken)
    rng = random.Random(seed if seed is not None else time.monotonic_ns())
    draw = audit_sampling.pick_checks([s.version for s in statements], [len(s.batches) for s in statements], rng,
                                      sample=sample, adapters=0)   # the audit's draw; no update is checked here
    picked = [(statements[i].version, statements[i].batches[j]) for i, j in draw.batches]
    served = books.batches(job_id, [bytes(b.batch_id).hex() for _, b in picked])
    checks: dict[bytes, bool] = {}
    for version, b in picked:
        got = served.get(bytes(b.batch_id).hex())
        if got is None:
            continue   # compacted (or never there: `swarmrl audit` tells which by the statement's age)
        bad = audit.check_batch(job_id, version, b, got)
        findings.update(f.reason for f in bad)
        checks[bytes(b.batch_id)] = not bad
    bans = {p.peer_id: p.ban_reason or "banned" for p in status.peers if p.banned}
    return board(job_id, status.trainer_id, statements, checks=checks, bans=bans, findings=findings)
