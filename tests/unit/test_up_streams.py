"""`swarmrl up` writes its result (the summary table) to stdout and its progress and logs to
stderr (issue 28 item 5: every line went to stderr and stdout was empty)."""

from __future__ import annotations

from pathlib import Path

from swarmrl.node.local import up
from swarmrl.node.local.summary import print_summary

SUMMARY = {"job_id": "abc123", "base_model": "tiny", "environment": "arithmetic", "loss": "grpo", "final_version": 3,
           "steps": 3, "reward_first": 0.25, "reward_last": 0.75, "reward_window": 1, "groups_admitted": 24,
           "validator": {"checked": 5, "failed": 0}, "adapter_hash_agreement": True, "seconds": 12.5,
           "peers": ["p1", "p2"]}


def test_the_summary_goes_to_stdout_and_progress_to_stderr(capsys, tmp_path: Path) -> None:
    up.console.print("progress: step 3/3")   # what up's progress, status lines and warnings print through
    print_summary(SUMMARY, tmp_path)          # as up calls it at the end
    out, err = capsys.readouterr()
    assert "progress: step 3/3" in err and "progress" not in out
    assert "swarmrl up: summary" in out and "abc123" in out and "reward_last (mean, last 1)" in out
    assert "0.750" in out and "metrics.csv" in out
    assert "summary" not in err
