"""Groups on probation are counted in one query (Ledger.count_on_probation): a status read while
batches are admitted can't go negative, as the difference of two counts did (`swarmrl up` on Gemma
died at step 55 of 60: 'Value out of range: -2' from GetJobStatus), and `follow` rides out a few
status errors in a row before it fails the run in one line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from swarmrl.node.local import live as live_mod
from swarmrl.node.local.processes import SwarmFailed
from swarmrl.node.trainer.ledger import Ledger, Probation
from swarmrl.protocol.pb import swarm_pb2 as pb


def _admit(led: Ledger, batch_id: str, peer: str, index: int, now_ms: int) -> None:
    led.add_lease(pb.Lease(lease_id=batch_id, job_id="J", peer_id=peer, prompt_indices=[index], deadline_ms=10**9))
    batch = pb.RolloutBatch(job_id="J", lease_id=batch_id, peer_id=peer)
    led.admit(batch_id, batch, pb.Signed(body=batch_id.encode()),
              [pb.Group(prompt_index=index, completions=[pb.Completion(policy_version=0)])], now_ms=now_ms)


def test_on_probation_is_pending_less_trainable_and_never_negative(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "ledger.sqlite")
    for i, (peer, at) in enumerate([("old", 100), ("new", 900), ("new", 950), ("vouched", 990)]):
        _admit(led, f"b{i}", peer, i, at)
    led.add_verdicts("J", "validator", [pb.Verdict(job_id="J", peer_id="vouched", batch_id="b3", prompt_index=3,
                                                   passed=True, check="x")], now_ms=991)
    cutoff = Probation(500, -1)   # received after 500 ms: trainable only with a passing verdict for their peer
    assert led.count_on_probation("J", cutoff) == 2   # the two of "new"
    assert led.count_on_probation("J", cutoff) == led.count_pending("J") - led.count_pending("J", hold=cutoff)
    last_chance = Probation(500, 0)   # the step's staleness floor at the groups' version 0: now or never
    assert led.count_on_probation("J", last_chance) == 0 and led.count_pending("J", hold=last_chance) == 4
    led.mark([p.row_id for p in led.pending("J", 10)], "trained", step=1)
    assert led.count_on_probation("J", cutoff) == 0
    led.close()


class _Swarm:
    def check_alive(self, names: list[str]) -> None:
        pass


class _Bug(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNKNOWN

    def details(self) -> str:
        return "Exception calling application: Value out of range: -2"


class _Live:
    def __init__(self) -> None:
        self.printed: list[str] = []
        self.console = self

    def print(self, text: str) -> None:
        self.printed.append(text)

    def show(self, st: pb.JobStatus) -> None:
        pass


def _follow(monkeypatch: pytest.MonkeyPatch, answers: list[Any]) -> tuple[pb.JobStatus, _Live]:
    def job_status(endpoint: str, job_id: str, history: int) -> pb.JobStatus:
        answer = answers.pop(0) if answers else pb.JobStatus(state="done", step=2)
        if isinstance(answer, Exception):
            raise answer
        return answer
    monkeypatch.setattr(live_mod, "job_status", job_status)
    monkeypatch.setattr(live_mod.time, "sleep", lambda s: None)
    live = _Live()
    st = live_mod.follow(_Swarm(), "127.0.0.1:1", "J", SimpleNamespace(steps=2), 60, live)  # type: ignore[arg-type]
    return st, live


def test_follow_rides_out_a_few_status_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    st, live = _follow(monkeypatch, [_Bug(), pb.JobStatus(state="running", step=1), _Bug(), _Bug()])
    assert st.state == "done" and len(live.printed) == 3 and "Value out of range" in live.printed[0]


def test_follow_fails_the_run_in_one_line_when_status_errors_persist(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SwarmFailed, match="failed 6 times in a row: UNKNOWN: Exception calling application"):
        _follow(monkeypatch, [_Bug() for _ in range(live_mod.STATUS_ERRORS_IN_A_ROW + 1)])
