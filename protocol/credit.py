"""Contribution statements: what a trainer trained into each version it published, signed and
chained, so that anyone can re-check a job's credit (issue 27 item 2, docs/CREDIT.md).

With each version it publishes, a trainer signs a `ContributionStatement` (domain
"contribution"): the batches whose groups it trained into the version (batch id, the worker that
signed the batch, the admitted prompt indices trained, their model-sampled token count), the
groups it consumed without credit since its previous statement (`dropped`, with the ledger's
reason), per-peer totals derived from the batches, and the version's adapter hash and delta
sha256. Each statement names the sha256 of its predecessor's signed body (`prev_sha256`), so a
trainer's statements form a hash chain from its first one (`first_version`); a chain has one
statement per version, none skipped.

Lists are sorted (batches and dropped entries by batch id, then reason; peers by peer id;
prompt indices ascending), so one set of facts has one encoding; the body is serialized
deterministically and signed as every `Signed` is (`protocol.signing`). Its content address is
`statement_sha256`.

`verify_statement` and `verify_chain` refuse a statement with a named reason (`REASONS`) as a
`CreditError`; `check_adapter` ties a statement to the signed update of its version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

BAD_SIGNATURE = "bad_signature"        # the envelope's signature does not verify
MALFORMED = "malformed"                # the body does not parse
WRONG_TRAINER = "wrong_trainer"        # signed by another key than the job's trainer
WRONG_JOB = "wrong_job"                # about another job
UNSORTED = "unsorted"                  # a list out of its canonical order, or a repeat inside one
BAD_BATCH_ID = "bad_batch_id"          # a batch id that is not 32 bytes
COUNTS_MISMATCH = "counts_mismatch"    # peers or totals that don't add up from the batches
BROKEN_CHAIN = "broken_chain"          # prev_sha256, version order or first_version wrong
DUPLICATE_CREDIT = "duplicate_credit"  # a prompt index credited or dropped twice in the chain
ADAPTER_MISMATCH = "adapter_mismatch"  # adapter_hash / delta_sha256 differ from the version's signed update
REASONS = frozenset({BAD_SIGNATURE, MALFORMED, WRONG_TRAINER, WRONG_JOB, UNSORTED, BAD_BATCH_ID, COUNTS_MISMATCH,
                     BROKEN_CHAIN, DUPLICATE_CREDIT, ADAPTER_MISMATCH})


class CreditError(ValueError):
    """A contribution statement that must be refused; `reason` is one of `REASONS`, `version`
    the statement's version (0 when it could not be read)."""

    def __init__(self, reason: str, detail: str = "", version: int = 0) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail, self.version = reason, detail, version


@dataclass(frozen=True)
class ConsumedGroup:
    """One admitted group a trainer consumed: trained into a version, or dropped (`reason`).

    batch_id: hex sha256 of the batch's signed body (as receipts name it); tokens: its
    model-sampled completion tokens (`model_tokens`)."""

    batch_id: str
    peer_id: str
    prompt_index: int
    tokens: int = 0
    reason: str = ""


def model_tokens(group: pb.Group) -> int:
    """Completion tokens the model sampled in `group`: those with token_mask 1 (every token when a
    completion carries no mask; environment tokens of an episode are not the worker's work)."""
    return sum(sum(1 for m in c.token_mask if m == 1) if c.token_mask else len(c.token_ids)
               for c in group.completions)


def statement_sha256(envelope: pb.Signed) -> bytes:
    """The content address of a signed statement: sha256 of its body (32 bytes)."""
    return hashlib.sha256(envelope.body).digest()


def peer_totals(batches: Iterable[pb.CreditedBatch]) -> list[pb.PeerCredit]:
    """Per-peer groups, tokens and batches of `batches`, sorted by peer id."""
    totals: dict[str, pb.PeerCredit] = {}
    for b in batches:
        p = totals.setdefault(b.peer_id, pb.PeerCredit(peer_id=b.peer_id))
        p.groups += len(b.prompt_indices)
        p.tokens += b.tokens
        p.batches += 1
    return [totals[k] for k in sorted(totals)]


def build_statement(job_id: str, version: int, update: pb.AdapterUpdate, prev: pb.Signed | None,
                    trained: Iterable[ConsumedGroup], dropped: Iterable[ConsumedGroup], created_ms: int,
                    ) -> pb.ContributionStatement:
    """The statement of `version`, published as `update` (its signed header's body), crediting
    the `trained` groups and listing the `dropped` ones, chained to `prev` (this trainer's
    previous signed statement; None for its first).

    Raises:
        ValueError: a batch id that is not 64 hex digits, or `prev` not the statement of
            version - 1 (a chain has no gaps).
    """
    first = version
    prev_sha = b""
    if prev is not None:
        before = pb.ContributionStatement.FromString(prev.body)
        if before.version + 1 != version:
            raise ValueError(f"statement of version {version} after one of version {before.version}")
        first, prev_sha = before.first_version, statement_sha256(prev)
    by_batch: dict[str, list[ConsumedGroup]] = {}
    for g in trained:
        by_batch.setdefault(g.batch_id, []).append(g)
    batches = [pb.CreditedBatch(batch_id=_raw_id(b), peer_id=gs[0].peer_id,
                                prompt_indices=sorted(g.prompt_index for g in gs), tokens=sum(g.tokens for g in gs))
               for b, gs in sorted(by_batch.items())]
    by_drop: dict[tuple[str, str], list[ConsumedGroup]] = {}
    for g in dropped:
        by_drop.setdefault((g.batch_id, g.reason), []).append(g)
    drops = [pb.DroppedGroups(batch_id=_raw_id(b), peer_id=gs[0].peer_id,
                              prompt_indices=sorted(g.prompt_index for g in gs), reason=r)
             for (b, r), gs in sorted(by_drop.items())]
    return pb.ContributionStatement(
        job_id=job_id, version=version, adapter_hash=update.to_hash, delta_sha256=update.payload_sha256,
        prev_sha256=prev_sha, first_version=first, batches=batches, dropped=drops, peers=peer_totals(batches),
        groups=sum(len(b.prompt_indices) for b in batches), tokens=sum(b.tokens for b in batches),
        created_ms=created_ms)


def _raw_id(batch_id: str) -> bytes:
    raw = bytes.fromhex(batch_id)
    if len(raw) != 32:
        raise ValueError(f"batch id {batch_id[:16]!r} is not a sha256")
    return raw


def sign_statement(identity: Identity, statement: pb.ContributionStatement) -> pb.Signed:
    """`statement` signed by the trainer `identity` under the contribution domain."""
    return signing.sign(identity, signing.CONTRIBUTION, statement)


def verify_statement(envelope: pb.Signed, *, job_id: str, trainer_id: str) -> pb.ContributionStatement:
    """Check one signed statement on its own: signature, signer `trainer_id`, job `job_id`,
    canonical order, 32-byte batch ids, and that `peers`, `groups` and `tokens` add up from
    `batches`. Returns the statement.

    Raises:
        CreditError: BAD_SIGNATURE, MALFORMED, WRONG_TRAINER, WRONG_JOB, UNSORTED, BAD_BATCH_ID
            or COUNTS_MISMATCH.
    """
    try:
        st, signer = signing.open_signed(envelope, signing.CONTRIBUTION, pb.ContributionStatement)
    except signing.SignatureError as exc:
        raise CreditError(BAD_SIGNATURE if exc.reason == "bad_signature" else MALFORMED, str(exc)) from exc
    v = st.version
    if signer != trainer_id:
        raise CreditError(WRONG_TRAINER, f"signed by {signer[:16]}, the job's trainer is {trainer_id[:16]}", v)
    if st.job_id != job_id:
        raise CreditError(WRONG_JOB, f"statement of job {st.job_id[:16]!r}, audited {job_id[:16]!r}", v)
    for entry in entries(st):
        if len(entry.batch_id) != 32:
            raise CreditError(BAD_BATCH_ID, f"batch id of {len(entry.batch_id)} bytes", v)
        if not _strictly_ascending(entry.prompt_indices) or not entry.prompt_indices:
            raise CreditError(UNSORTED, f"prompt indices of batch {entry.batch_id.hex()[:12]} are empty, "
                                        "out of order or repeated", v)
    if not _strictly_ascending([b.batch_id for b in st.batches]):
        raise CreditError(UNSORTED, "batches are not in ascending batch id order (or one is repeated)", v)
    if not _strictly_ascending([(d.batch_id, d.reason) for d in st.dropped]):
        raise CreditError(UNSORTED, "dropped entries are not in ascending (batch id, reason) order", v)
    if not _strictly_ascending([p.peer_id for p in st.peers]):
        raise CreditError(UNSORTED, "peers are not in ascending peer id order", v)
    if list(st.peers) != peer_totals(st.batches):
        raise CreditError(COUNTS_MISMATCH, "per-peer totals differ from the credited batches", v)
    groups, tokens = sum(len(b.prompt_indices) for b in st.batches), sum(b.tokens for b in st.batches)
    if (st.groups, st.tokens) != (groups, tokens):
        raise CreditError(COUNTS_MISMATCH, f"totals say {st.groups} groups / {st.tokens} tokens, the batches "
                                           f"{groups} / {tokens}", v)
    return st


def entries(statement: pb.ContributionStatement) -> list[pb.CreditedBatch | pb.DroppedGroups]:
    """The statement's credited batches, then its dropped entries (each names a batch id, a
    peer and prompt indices)."""
    return [*statement.batches, *statement.dropped]


def _strictly_ascending(items: Sequence[Any]) -> bool:
    return all(a < b for a, b in pairwise(items))


def verify_chain(envelopes: Sequence[pb.Signed], *, job_id: str, trainer_id: str,
                 prev: pb.Signed | None = None) -> list[pb.ContributionStatement]:
    """Check a run of one trainer's signed statements, ascending: each on its own
    (`verify_statement`), then the chain: consecutive versions, each naming the sha256 of the
    one before (`prev`, already checked, before the first; with no `prev` the first must be the
    trainer's first statement: no predecessor, version = first_version), one first_version
    throughout, and no prompt index credited or dropped twice. Returns the statements.

    Raises:
        CreditError: the first failure, as `verify_statement` or BROKEN_CHAIN / DUPLICATE_CREDIT.
    """
    out: list[pb.ContributionStatement] = []
    before = pb.ContributionStatement.FromString(prev.body) if prev is not None else None
    before_sha = statement_sha256(prev) if prev is not None else b""
    seen: dict[int, int] = {}   # prompt index -> version that credited or dropped it
    for env in envelopes:
        st = verify_statement(env, job_id=job_id, trainer_id=trainer_id)
        v = st.version
        if before is None:
            if st.prev_sha256 or st.first_version != v:
                raise CreditError(BROKEN_CHAIN, f"version {v} names a predecessor, but none was given (first "
                                                f"version {st.first_version})", v)
        else:
            if v != before.version + 1:
                raise CreditError(BROKEN_CHAIN, f"version {v} follows version {before.version}", v)
            if bytes(st.prev_sha256) != before_sha:
                raise CreditError(BROKEN_CHAIN, f"version {v}'s prev_sha256 {bytes(st.prev_sha256).hex()[:12]} is "
                                                f"not version {before.version}'s {before_sha.hex()[:12]}", v)
            if st.first_version != before.first_version:
                raise CreditError(BROKEN_CHAIN, f"first_version changed from {before.first_version} to "
                                                f"{st.first_version}", v)
        for entry in entries(st):
            for i in entry.prompt_indices:
                if i in seen:
                    raise CreditError(DUPLICATE_CREDIT, f"prompt index {i} in version {v}, already in version "
                                                        f"{seen[i]}", v)
                seen[i] = v
        out.append(st)
        before, before_sha = st, statement_sha256(env)
    return out


def check_adapter(statement: pb.ContributionStatement, update: pb.AdapterUpdate) -> None:
    """Check that `statement` names the signed update of its version (`update`: the body of the
    trainer's signed AdapterUpdate header to that version): the adapter hash, and the delta's
    sha256 when `update` is the delta (a snapshot header, served once the delta is pruned, carries
    the snapshot's bytes: only the hash is compared).

    Raises:
        CreditError: ADAPTER_MISMATCH.
    """
    v = statement.version
    if update.to_version != v:
        raise CreditError(ADAPTER_MISMATCH, f"update to version {update.to_version} given for statement {v}", v)
    if bytes(update.to_hash) != bytes(statement.adapter_hash):
        raise CreditError(ADAPTER_MISMATCH, f"adapter hash {bytes(statement.adapter_hash).hex()[:12]}, the signed "
                                            f"update's {bytes(update.to_hash).hex()[:12]}", v)
    if update.snapshot:   # only the version's snapshot is kept (the trainer's retention floor, a rebuilt
        return            # version): it proves the adapter's hash, not the delta's bytes
    if bytes(update.payload_sha256) != bytes(statement.delta_sha256):
        raise CreditError(ADAPTER_MISMATCH, "delta sha256 differs from the signed update's payload", v)
