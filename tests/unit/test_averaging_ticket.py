"""Signed tickets of averaging rounds (issue 26, "bad input"): every reason a member is refused,
decided from the gathered metadata alone (`protocol.averaging_ticket`)."""

from __future__ import annotations

import pytest

from swarmrl.node.trainer.faults import forge
from swarmrl.protocol.averaging_ticket import TICKET_KEY, admit_members, check_member, make_ticket
from swarmrl.protocol.identity import Identity

JOB, KIND, VERSION = "job-a", "outer", 8
A, B = Identity.from_seed(b"a" * 32), Identity.from_seed(b"b" * 32)
PEER_A, PEER_B = b"\x12\x20" + b"a" * 32, b"\x12\x20" + b"b" * 32


def _info(identity: Identity, peer: bytes, *, job: str = JOB, kind: str = KIND, version: int = VERSION,
          start: str = "aa") -> dict[str, object]:
    info: dict[str, object] = {"version": VERSION, "start": start}
    info[TICKET_KEY] = make_ticket(identity, job, kind, version, peer, info)
    return info


def _check(info: dict[str, object], peer: bytes = PEER_A, allowed: frozenset[str] | None = None) -> tuple[str, str]:
    got = check_member(info, peer, job_id=JOB, kind=KIND, version=VERSION, allowed=allowed)
    return got.trainer_id, got.reason


def test_an_honest_ticket_names_its_trainer() -> None:
    assert _check(_info(A, PEER_A)) == (A.peer_id, "")
    assert _check(_info(A, PEER_A), allowed=frozenset({A.peer_id})) == (A.peer_id, "")


@pytest.mark.parametrize(("make", "reason"), [
    (lambda: {"version": VERSION}, "no_ticket"),
    (lambda: {"version": VERSION, TICKET_KEY: b"\xff\x00junk"}, "malformed"),
    (lambda: {**_info(A, PEER_A), TICKET_KEY: forge(_info(A, PEER_A)[TICKET_KEY])}, "bad_signature"),  # type: ignore[arg-type]
    (lambda: _info(A, PEER_A, job="job-b"), "wrong_job"),
    (lambda: _info(A, PEER_A, kind="avg"), "wrong_kind"),
    (lambda: _info(A, PEER_A, version=VERSION - 1), "wrong_version"),
    (lambda: _info(A, PEER_B), "wrong_peer"),                                  # a ticket replayed by another peer
    (lambda: {**_info(A, PEER_A), "start": "bb"}, "wrong_info"),               # metadata changed after signing
])
def test_a_ticket_is_refused_with_its_reason(make, reason) -> None:
    assert _check(make())[1] == reason


def test_a_key_the_job_does_not_allow_is_refused() -> None:
    assert _check(_info(B, PEER_A), allowed=frozenset({A.peer_id})) == (B.peer_id, "not_cotrainer")


def test_one_trainer_key_stands_behind_one_member_only() -> None:
    got = admit_members([(PEER_A, _info(A, PEER_A)), (PEER_B, _info(A, PEER_B)), (b"\x00", {"version": VERSION})],
                        job_id=JOB, kind=KIND, version=VERSION, allowed=None)
    assert [(c.trainer_id, c.reason) for c in got] == [(A.peer_id, ""), (A.peer_id, "duplicate_trainer"),
                                                        ("", "no_ticket")]


def test_a_replayed_ticket_does_not_take_its_trainer_s_seat() -> None:
    replayed = _info(A, PEER_A)   # the member at PEER_B gathered trainer A's ticket, ahead of A in the group
    got = admit_members([(PEER_B, replayed), (PEER_A, _info(A, PEER_A))], job_id=JOB, kind=KIND, version=VERSION,
                        allowed=None)
    assert [c.reason for c in got] == ["wrong_peer", ""]


def test_every_member_decides_alike_from_the_gathered_data() -> None:
    gathered = [(PEER_A, _info(A, PEER_A)), (PEER_B, _info(B, PEER_B, start="bb"))]
    first = admit_members(gathered, job_id=JOB, kind=KIND, version=VERSION, allowed=None)
    second = admit_members(list(gathered), job_id=JOB, kind=KIND, version=VERSION, allowed=None)
    assert first == second and all(c.admitted for c in first)
