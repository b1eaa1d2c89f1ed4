"""The leaderboard's sums (protocol/leaderboard.py): per-peer groups, tokens, share, versions,
dropped groups by reason, bans from the signed record before the trainer's status, verified
share from the reader's batch checks, and the CSV and JSON forms."""

from __future__ import annotations

import csv
import io
import json

import grpc

from swarmrl.node.ops.dashboard import books_credit
from swarmrl.protocol.leaderboard import CSV_FIELDS, board
from swarmrl.protocol.pb import swarm_pb2 as pb

A, B, C = "peerA", "peerB", "peerC"


def _batch(n: int, peer: str, indices: list[int], tokens: int) -> pb.CreditedBatch:
    return pb.CreditedBatch(batch_id=bytes([n]) * 32, peer_id=peer, prompt_indices=indices, tokens=tokens)


def _statements() -> list[pb.ContributionStatement]:
    v1 = pb.ContributionStatement(job_id="j", version=1, batches=[_batch(1, A, [0, 1], 30), _batch(2, B, [2], 10)])
    v2 = pb.ContributionStatement(job_id="j", version=2, batches=[_batch(3, A, [3], 12)], dropped=[
        pb.DroppedGroups(batch_id=bytes([4]) * 32, peer_id=B, prompt_indices=[4, 5], reason="stale_at_step"),
        pb.DroppedGroups(batch_id=bytes([5]) * 32, peer_id=C, prompt_indices=[6], reason="banned: logprob mismatch")])
    v3 = pb.ContributionStatement(job_id="j", version=3, batches=[_batch(6, B, [7, 8], 20)])
    return [v1, v2, v3]


def test_the_board_sums_each_peers_credit_from_the_statements() -> None:
    b = board("j", "T", _statements())
    rows = {r.peer_id: r for r in b.rows}
    assert [r.peer_id for r in b.rows] == [A, B, C]   # most groups first; ties by peer id
    assert (b.statements, b.first_version, b.head_version, b.groups, b.tokens) == (3, 1, 3, 6, 72)
    a, bb, c = rows[A], rows[B], rows[C]
    assert (a.groups, a.tokens, a.batches, a.versions, a.first_version, a.last_version) == (3, 42, 2, 2, 1, 2)
    assert (bb.groups, bb.tokens, bb.batches, bb.versions, bb.first_version, bb.last_version) == (3, 30, 2, 2, 1, 3)
    assert bb.dropped == {"stale_at_step": 2} and not bb.banned
    assert (c.groups, c.versions, c.banned, dict(c.dropped)) == (0, 0, "logprob mismatch", {"banned: logprob mismatch": 1})
    assert a.share == bb.share == 0.5 and c.share == 0.0
    assert sum(r.groups for r in b.rows) == b.groups
    assert all(r.verified_share is None for r in b.rows)   # nothing checked


def test_checks_give_the_verified_share_and_the_status_names_bans_the_record_does_not() -> None:
    checks = {bytes([1]) * 32: True, bytes([3]) * 32: False, bytes([2]) * 32: True}
    b = board("j", "T", _statements(), checks=checks, bans={B: "strikes", C: "ignored: the record names it"},
              findings={"forged_batch": 1})
    rows = {r.peer_id: r for r in b.rows}
    assert (rows[A].checked, rows[A].verified, rows[A].verified_share) == (3, 2, 2 / 3)
    assert (rows[B].checked, rows[B].verified, rows[B].verified_share) == (1, 1, 1.0)   # batch 6 not checked
    assert rows[B].banned == "strikes (status)" and rows[C].banned == "logprob mismatch"
    assert b.findings == {"forged_batch": 1}


def test_json_and_csv_carry_every_row() -> None:
    b = board("j", "T", _statements(), checks={bytes([1]) * 32: True})
    d = json.loads(json.dumps(b.as_dict()))
    assert d["groups"] == 6 and [p["peer_id"] for p in d["peers"]] == [A, B, C]
    assert d["peers"][0]["verified_share"] == 1.0 and d["peers"][0]["checked"] == 2 and d["peers"][1]["verified_share"] is None
    rows = list(csv.DictReader(io.StringIO(b.csv_text())))
    assert tuple(rows[0]) == CSV_FIELDS and [r["peer_id"] for r in rows] == [A, B, C]
    assert rows[1]["dropped"] == "stale_at_step=2" and rows[1]["verified_share"] == ""
    assert rows[2]["banned"] == "logprob mismatch" and sum(int(r["groups"]) for r in rows) == 6


def test_an_empty_chain_is_an_empty_board() -> None:
    b = board("j", "T", [])
    assert (b.rows, b.groups, b.head_version) == ([], 0, 0)
    assert b.csv_text().strip() == ",".join(CSV_FIELDS)


class _Gone(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class _Books:
    """Books of one job "j" (the statements above, unsigned: the chain check finds them broken)."""

    def __init__(self, gone: bool = False) -> None:
        self.gone = gone

    def status(self, job_id: str) -> pb.JobStatus:
        if self.gone:
            raise _Gone()
        return pb.JobStatus(job_id=job_id, state="running" if job_id == "j" else "unknown", trainer_id="T")

    def statements(self, job_id: str) -> list[pb.Signed]:
        return [pb.Signed(body=s.SerializeToString()) for s in _statements()]

    def batches(self, job_id: str, batch_ids) -> dict[str, pb.AdmittedBatch]:
        return {}


def test_the_pages_leaderboard_is_none_for_an_unknown_job_or_a_trainer_gone_and_findings_otherwise() -> None:
    fetch = books_credit(lambda job_id: _Books())
    assert fetch("other") is None
    b = fetch("j")
    assert b is not None and b.statements == 0 and sum(b.findings.values()) >= 1   # unsigned: the chain breaks at once
    assert books_credit(lambda job_id: _Books(gone=True))("j") is None
    assert books_credit(lambda job_id: None)("j") is None
