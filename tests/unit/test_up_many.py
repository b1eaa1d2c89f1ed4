"""A several-job `swarmrl up` (issue 24 item 6): which jobs it runs and on which trainer
(node/local/jobs_plan.py), what its summary says per job and per worker
(node/local/many_summary.py), and the `swarmrl status` listing of every announced job
(node/swarm/listing.py, protocol/market.py's shares)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from swarmrl.node.cli.main import main
from swarmrl.node.cli.status import listing_table
from swarmrl.node.local.jobs_plan import plan_jobs
from swarmrl.node.local.many_summary import job_figures, print_run_summary, run_summary, worker_split
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.node.swarm.listing import list_jobs
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.market import Offer, intake_shares, weight_shares
from swarmrl.protocol.pb import swarm_pb2 as pb


def _files(tmp_path: Path, *names: str) -> list[Path]:
    out = []
    for n in names:
        p = tmp_path / f"{n}.toml"
        p.write_text('base_model = "tiny"\n')
        out.append(p)
    return out


def test_files_then_copies_each_on_trainer_i_mod_t(tmp_path: Path) -> None:
    a, b = _files(tmp_path, "a", "b")
    plan = plan_jobs([a, b], 2, "1,2,3,4", 2, [])
    assert [(s.name, s.file, s.seed_offset, s.weight, s.trainer) for s in plan] == [
        ("a", a, 0, 1.0, 0), ("b", b, 0, 2.0, 1), ("builtin-0", None, 0, 3.0, 0), ("builtin-1", None, 1, 4.0, 1)]
    assert [s.trainer for s in plan_jobs([], 3, "", None, [])] == [0, 1, 2]   # default: one trainer per job


def test_one_job_is_the_one_job_up(tmp_path: Path) -> None:
    (a,) = _files(tmp_path, "a")
    assert len(plan_jobs([], None, "", None, [])) == 1
    assert len(plan_jobs([], 1, "", 3, ["lie"])) == 1   # the one-job up's own options stand
    assert [s.file for s in plan_jobs([a], None, "", None, [])] == [a]
    assert len(plan_jobs([a], 1, "", None, [])) == 2   # a file and one copy of the built-in job


@pytest.mark.parametrize(("files", "copies", "weights", "trainers", "red", "says"), [
    (["a", "a"], None, "", None, [], "duplicate job"),
    ([], 2, "1", None, [], "1 weights for 2 jobs"),
    ([], 2, "1,0", None, [], "not in (0, 100]"),
    ([], 2, "1,x", None, [], "'x' is not a number"),
    ([], 2, "", 3, [], "--trainers 3 with 2 jobs"),
    ([], 2, "", None, ["lie"], "--red-team runs with one job"),
    ([], None, "2", None, [], "--weights is for several jobs"),
])
def test_bad_plans_say_why(tmp_path: Path, files: list[str], copies: int | None, weights: str, trainers: int | None,
                           red: list[str], says: str) -> None:
    paths = [tmp_path / f"{n}.toml" for n in files]
    for p in paths:
        p.write_text("")
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        plan_jobs(paths, copies, weights, trainers, red)


@pytest.mark.parametrize("argv", [["up", "--jobs", "0"], ["up", "--jobs", "2", "--trainers", "3"],
                                  ["status"], ["status", "abc"]])
def test_cli_mistakes_are_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main([*argv, *(["--out", str(tmp_path / "o")] if argv[0] == "up" else [])]))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err


def test_different_base_models_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text('base_model = "tiny"\n')
    b.write_text('base_model = "gemma"\n')
    assert main(["up", str(a), str(b), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "different base models" in err and "google/gemma-3-270m" in err
    assert not (tmp_path / "o").exists()   # nothing written, nothing left


def _status(job: str, peers: dict[str, int]) -> pb.JobStatus:
    return pb.JobStatus(job_id=job, peers=[pb.PeerInfo(peer_id=p, groups_admitted=n) for p, n in peers.items()])


def test_worker_split_counts_each_workers_groups_per_job() -> None:
    statuses = {"a": _status("A", {"p0": 5, "p1": 2, "intruder": 9}), "b": _status("B", {"p1": 7})}
    assert worker_split(statuses, {"worker0": "p0", "worker1": "p1", "worker2": "p2"}) == {
        "worker0": {"a": 5, "b": 0}, "worker1": {"a": 2, "b": 7}, "worker2": {"a": 0, "b": 0}}


def _one_job_summary(steps: int, trained: int) -> dict[str, object]:
    return {"job_id": "f" * 32, "steps": steps, "final_version": steps, "reward_first": 0.25, "reward_last": 0.5,
            "reward_window": 1, "groups_admitted": trained + 1, "groups_trained": trained, "groups_no_signal": 0,
            "groups_dropped": 1, "adapter_hash": "ab", "adapter_hash_agreement": True, "seconds": 3.0,
            "peers": ["not in the figures"], "audit": {"findings": 0, "statements": steps, "by_reason": {}}}


def test_run_summary_gives_each_jobs_figures_and_whether_all_trained(tmp_path: Path) -> None:
    a = job_figures(_one_job_summary(4, 8), "trainer", 1.0, 4, tmp_path / "jobs/a/adapter")
    b = job_figures({**_one_job_summary(3, 6), "audit": {"findings": 2, "statements": 3, "by_reason": {"x": 2}}},
                    "trainer1", 2.0, 4, tmp_path / "jobs/b/adapter")
    assert "peers" not in a and a["adapter"] == str(tmp_path / "jobs/a/adapter") and a["trainer"] == "trainer"
    split = {"worker0": {"a": 5, "b": 0}, "worker1": {"a": 2, "b": 7}}
    s = run_summary("tiny", {"a": a, "b": b}, split, {"trainer": ["a"], "trainer1": ["b"]}, 12.34)
    assert s["every_job_trained"] is False and s["seconds"] == 12.3   # b stopped at 3 of 4 steps
    buf = io.StringIO()
    print_run_summary(s, tmp_path, Console(file=buf, width=400))
    text = buf.getvalue()
    assert run_summary("tiny", {"a": a, "b": {**b, "steps": 4}}, split, {}, 1.0)["every_job_trained"] is True
    assert "0.250 -> 0.500 (1)" in text and "3/4" in text and "trainer1" in text
    assert "0 (4 statements)" in text and "2 (3 statements) {'x': 2}" in text   # each job's audit findings
    worker1 = next(line for line in text.splitlines() if "worker1" in line)
    assert [c.strip() for c in worker1.strip("│ ").split("│")] == ["worker1", "2", "7", "9", "2"]


def test_shares_of_intake_and_of_weight() -> None:
    offers = [Offer("a", 4, 30.0, 1.0), Offer("b", 0, 10.0, 3.0), Offer("c", 2, 0.0, 200.0)]
    assert intake_shares(offers) == {"a": 0.75, "b": 0.25, "c": 0.0}
    assert weight_shares(offers) == pytest.approx({"a": 1 / 104, "b": 3 / 104, "c": 100 / 104})   # c capped at 100
    assert intake_shares([Offer("a", 1, 0.0, 1.0)]) == {"a": 0.0}
    with pytest.raises(ValueError):
        weight_shares([Offer("a", 1, 0.0, 0.0)])


def _record(spec: JobSpec, trainer: str, capacity: int, intake: float, weight: float, *, done: bool = False,
            head: int = 2, demand: bool = True) -> VerifiedRecord:
    rec = pb.JobRecord(job_id=f"job-{spec.name}", trainer_id=trainer, base_model=spec.base_model, head_version=head,
                       spec_json=spec.canonical_json(), done=done, environment=spec.environment)
    if demand:
        rec.demand.CopyFrom(pb.Demand(capacity=capacity, intake_per_min=intake, weight=weight))
    return VerifiedRecord(rec, trainer, b"")


def test_listing_merges_trainers_and_shares_among_running_jobs() -> None:
    base = JobSpec.model_validate({"base_model": "tiny", "base_model_sha256": "0" * 64, "steps": 6})
    a, b, c, d = (base.model_copy(update={"name": n}) for n in "abcd")
    worker = pb.WorkerEnvs(worker_id="w", base_model_sha256=["0" * 64],
                           environments=[pb.EnvInfo(name=base.environment, version=base.env_version)])
    rows = list_jobs([_record(a, "t0", 3, 20.0, 1.0), _record(a, "t1", 2, 10.0, 1.0, head=4),
                      _record(b, "t0", 0, 10.0, 3.0), _record(c, "t0", 0, 50.0, 1.0, done=True),
                      _record(d, "t2", 0, 0.0, 0.0, demand=False)], [worker])
    by = {r.name: r for r in rows}
    assert [r.name for r in rows] == ["a", "b", "d", "c"]   # running first, the done job last
    assert (by["a"].trainers, by["a"].capacity, by["a"].intake_per_min, by["a"].head_version) == (2, 5, 30.0, 4)
    assert (by["a"].share, by["b"].share) == (0.75, 0.25) and (by["a"].fair_share, by["b"].fair_share) == (0.25, 0.75)
    assert by["c"].share is None and by["c"].done
    assert by["d"].problem.startswith("no demand announced") and by["d"].share is None
    assert by["a"].serving_workers == 1 and by["a"].total_steps == 6
    buf = io.StringIO()
    Console(file=buf, width=250).print(listing_table(rows))
    line = next(x for x in buf.getvalue().splitlines() if "│ a " in x)
    assert "running" in line and "4/6" in line and "30.0" in line and "75%" in line and "25%" in line
