"""benchmarks/step_profile.py on tiny: one step end to end, every phase timed, the shares add up."""

from __future__ import annotations

import argparse
import math

from benchmarks.step_profile import TRAINER, WORKER, run


def test_one_tiny_step_is_profiled(model_cache) -> None:
    args = argparse.Namespace(model="tiny", steps=1, threads=1, seed=0, head="function", cache_dir=model_cache)
    result = run(args)
    (step,) = result["steps"]
    assert step["completions"] >= result["batch_groups"] * result["group_size"] and step["tokens"] > 0
    br = step["breakdown"]
    assert set(br) == {*WORKER, *TRAINER, "total"}
    for kind in ("wall", "cpu"):
        assert math.isclose(sum(br[k][f"{kind}_share"] for k in WORKER + TRAINER), 1.0, rel_tol=1e-9)
        assert br["worker: generate"][f"{kind}_s"] > 0 and br["trainer: forward"][f"{kind}_s"] > 0
    assert all(v >= 0 for v in step["worker_overhead"].values())
    assert result["mean_after_warmup"] == {}
