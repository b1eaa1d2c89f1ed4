"""`up`'s held-out figure (issue 28 item 3) is a result: the last line on stdout. An evaluation that
fails after a run trained is one warning and `heldout_error` in summary.json, never a failed run."""

from __future__ import annotations

import json

from swarmrl.node.local.interrupt import RunSoFar
from swarmrl.node.local.up import UpOptions, _headline
from swarmrl.node.tasks.builtin_jobs import builtin_job


def test_a_failed_evaluation_is_a_warning_and_the_outputs_stay(tmp_path, model_cache, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    run = RunSoFar(out=out, spec=builtin_job("tiny", model_cache))
    opts = UpOptions(out=out, eval_n=5, cache_dir=model_cache)
    summary = _headline({"steps": 3}, opts, run)             # no adapter folder: the evaluation fails
    assert summary["steps"] == 3 and summary["heldout_error"]
    assert json.loads((out / "summary.json").read_text())["heldout_error"] == summary["heldout_error"]
    captured = capsys.readouterr()
    assert "held-out evaluation failed" in captured.out + captured.err and "Traceback" not in captured.err
    assert "heldout_accuracy_adapter" not in summary
