"""Who is in an averaging round: signed tickets that tie each libp2p peer of a round to a trainer key.

hivemind's averaging authenticates a round's members by libp2p peer id only, and anyone can
announce itself under a job's matchmaking key. So each trainer gathers a ticket with its round
metadata: an `AveragingTicket` (job id, round kind, version, the libp2p peer id of its averager,
sha256 of the rest of its gathered metadata), signed with its trainer key (domain
"averaging-ticket"). Every member checks every member's ticket against what it gathered
(`admit_members`), and the check reads only the gathered data and the job's settings, so the
members that share those settings decide alike. A member is refused, with one reason:

- `no_ticket`: it gathered none; `malformed`: the envelope or body does not parse;
- `bad_signature`: the signature does not verify;
- `wrong_job`, `wrong_kind`, `wrong_version`: a ticket made for another round;
- `wrong_peer`: a ticket bound to another libp2p peer (one member replays another's ticket);
- `wrong_info`: the gathered metadata is not what the signer signed;
- `not_cotrainer`: the signer is not among the trainers this job allows (`allowed`; None: any key);
- `duplicate_trainer`: a second peer signed by a trainer key already in the round (the first, in
  the group's peer order, is kept).

A refused member gets no part to reduce and its parts don't enter the average
(`node.swarm.averaging`): the round goes on without it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

TICKET_KEY = "ticket"   # the gathered metadata's field that holds the serialized signed ticket
REASONS = ("no_ticket", "malformed", "bad_signature", "wrong_job", "wrong_kind", "wrong_version", "wrong_peer",
           "wrong_info", "not_cotrainer", "duplicate_trainer")


def info_digest(info: Mapping[str, Any]) -> bytes:
    """sha256 of the gathered metadata without its ticket: canonical JSON (sorted keys, compact).

    Raises:
        TypeError: `info` holds a value JSON can't write (the metadata is plain strings and numbers).
    """
    rest = {k: v for k, v in info.items() if k != TICKET_KEY}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).digest()


def make_ticket(identity: Identity, job_id: str, kind: str, version: int, averager_peer_id: bytes,
                info: Mapping[str, Any]) -> bytes:
    """The serialized signed ticket a trainer gathers with `info` in round (`job_id`, `kind`, `version`)."""
    ticket = pb.AveragingTicket(job_id=job_id, kind=kind, version=version, averager_peer_id=averager_peer_id,
                                info_sha256=info_digest(info))
    return signing.sign(identity, signing.AVERAGING_TICKET, ticket).SerializeToString(deterministic=True)


@dataclass(frozen=True)
class MemberCheck:
    """One member's ticket, checked: the trainer id that signed it, and why it is refused ("" = admitted)."""

    trainer_id: str
    reason: str = ""

    @property
    def admitted(self) -> bool:
        """True when the member's ticket holds."""
        return not self.reason


def check_member(info: Mapping[str, Any], peer_id: bytes, *, job_id: str, kind: str, version: int,
                 allowed: frozenset[str] | None) -> MemberCheck:
    """Check the ticket that the member with libp2p `peer_id` gathered in `info` (module docstring).
    Never raises: a member's bad input is a reason."""
    raw = info.get(TICKET_KEY)
    if raw is None:
        return MemberCheck("", "no_ticket")
    envelope = pb.Signed()
    try:
        envelope.ParseFromString(bytes(raw))
        ticket, signer = signing.open_signed(envelope, signing.AVERAGING_TICKET, pb.AveragingTicket)
    except signing.SignatureError as exc:
        return MemberCheck("", exc.reason)
    except (DecodeError, TypeError, ValueError):
        return MemberCheck("", "malformed")
    try:
        digest = info_digest(info)
    except (TypeError, ValueError):
        return MemberCheck(signer, "malformed")
    for reason, ok in (("wrong_job", ticket.job_id == job_id), ("wrong_kind", ticket.kind == kind),
                       ("wrong_version", ticket.version == version),
                       ("wrong_peer", bytes(ticket.averager_peer_id) == peer_id),
                       ("wrong_info", bytes(ticket.info_sha256) == digest),
                       ("not_cotrainer", allowed is None or signer in allowed)):
        if not ok:
            return MemberCheck(signer, reason)
    return MemberCheck(signer)


def admit_members(gathered: Sequence[tuple[bytes, Mapping[str, Any]]], *, job_id: str, kind: str, version: int,
                  allowed: frozenset[str] | None) -> list[MemberCheck]:
    """Check every member of a round, in the group's peer order: (libp2p peer id, gathered
    metadata) each. A trainer key may stand behind one member only (`duplicate_trainer`)."""
    seen: set[str] = set()
    out = []
    for peer_id, info in gathered:
        got = check_member(info, peer_id, job_id=job_id, kind=kind, version=version, allowed=allowed)
        if got.admitted and got.trainer_id in seen:
            got = MemberCheck(got.trainer_id, "duplicate_trainer")
        if got.admitted:   # a refused member's claim (a replayed ticket's signer) takes no one's seat
            seen.add(got.trainer_id)
        out.append(got)
    return out
