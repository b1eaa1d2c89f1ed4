"""`swarmrl up`'s live line (node/local/live.py): off a terminal, a plain line per step, and the
last line shows the snapshot the summary is written from, even when the step did not advance
between the last poll and that snapshot (the validator checked more, more groups were admitted)."""

from __future__ import annotations

import io

from rich.console import Console

from swarmrl.node.local.live import LiveLine
from swarmrl.node.local.summary import summarize
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb


def _status(step: int, admitted: int, checked: int) -> pb.JobStatus:
    st = pb.JobStatus(job_id="j", state="done", step=step, policy_version=step, total_steps=4,
                      groups_admitted=admitted, validator_checked=checked)
    st.groups_rejected["stale"] = 2
    st.history.append(pb.StepMetrics(step=step, policy_version=step, reward_mean=0.5, staleness_mean=1.0))
    return st


def test_the_last_line_is_the_summarys_snapshot() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with LiveLine(console, 4) as live:
        for step, admitted, checked in [(1, 100, 30), (1, 120, 40), (4, 506, 173)]:
            live.show(_status(step, admitted, checked))
        final = _status(4, 510, 175)   # after the validator settled: the same step, later figures
        live.finish(final)
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/4", "4/4", "4/4"]   # one line per step, then the final one
    summary = summarize(final, _spec(), "j", 4, b"", {}, {}, 1.0)
    assert lines[-1] == (f"training 4/4  v4  last step: reward 0.500, staleness 1.00  groups: "
                         f"{summary['groups_admitted']} admitted, 2 rejected, {summary['validator']['checked']} checked")
    assert "510 admitted" in lines[-1] and "175 checked" in lines[-1]


def _spec() -> JobSpec:
    return JobSpec.model_validate({"name": "t", "base_model": "m", "base_model_sha256": "0" * 64,
                                   "environment": "arithmetic", "env_version": "1", "steps": 4})
