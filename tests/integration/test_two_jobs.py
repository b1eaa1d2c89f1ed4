"""Two jobs on one base model at once, real processes on 127.0.0.1 (issue 24 items 1-2): a
bootstrap peer, one trainer hosting both jobs, two workers choosing by the jobs' signed demand.
Both jobs reach their steps, every job was served and every worker served, each worker holds
each job's final adapter with the trainer's hash, and no record was ignored (every trainer record
carries sound demand). That each worker serves *both* is not asserted: the market rule keeps a
worker on its job while the job's trainer grants leases, so two workers may split one job each
(one suite run did)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from swarmrl.node.local.processes import LocalSwarm
from swarmrl.node.submitter.client import job_status, sign_job, submit_signed
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.protocol.identity import Identity

pytestmark = pytest.mark.integration
WORKERS = ["worker0", "worker1"]


def test_two_jobs_share_two_workers(tmp_path: Path, model_cache: Path) -> None:
    keys = {n: Identity.load_or_create(tmp_path / "keys" / f"{n}.key") for n in ["submitter", "trainer", *WORKERS]}
    cache = [f"cache_dir={json.dumps(str(model_cache))}"]
    swarm = LocalSwarm(tmp_path)
    try:
        swarm.start("bootstrap", "bootstrap", [f"ready_file={json.dumps(str(tmp_path / 'bootstrap.ready'))}"])
        net = [f"net.initial_peers={json.dumps(swarm.wait_ready('bootstrap', tmp_path / 'bootstrap.ready')['maddrs'])}"]
        swarm.start("trainer", "trainer", net + cache + [
            f"key={json.dumps(str(tmp_path / 'keys/trainer.key'))}", f"state_dir={json.dumps(str(tmp_path / 'trainer'))}",
            f"ready_file={json.dumps(str(tmp_path / 'trainer.ready'))}"])
        endpoint = swarm.wait_ready("trainer", tmp_path / "trainer.ready", timeout_s=300)["endpoint"]
        for w in WORKERS:
            swarm.start(w, "worker", net + cache + [
                f"key={json.dumps(str(tmp_path / 'keys' / (w + '.key')))}", 'base_model="tiny"',
                f"ready_file={json.dumps(str(tmp_path / (w + '.ready')))}", "exit_when_done=true"], nice=5)
        for w in WORKERS:
            swarm.wait_ready(w, tmp_path / f"{w}.ready", timeout_s=300)
        jobs = [submit_signed(endpoint, sign_job(keys["submitter"], builtin_job("tiny", model_cache, steps=6, seed=s)))
                for s in (0, 1)]
        deadline = time.monotonic() + 600
        while True:
            st = [job_status(endpoint, j) for j in jobs]
            if all(s.state == "done" for s in st):
                break
            assert time.monotonic() < deadline, [(s.state, s.policy_version) for s in st]
            swarm.check_alive(["trainer"])   # workers exit on their own once both jobs are done
            time.sleep(1)
        for w in WORKERS:   # the workers exit once every job they know is done (after catching up)
            assert swarm.procs[w].wait(timeout=120) == 0, swarm.tail(w)
        served = {(w, j): 0 for w in WORKERS for j in jobs}   # groups admitted, per worker and job
        for job_id, status in zip(jobs, st):
            assert status.policy_version == 6
            for w in WORKERS:
                report = json.loads((tmp_path / f"{w}.ready").read_text())
                assert report["ignored_jobs"] == {}
                held = report["adapters"][job_id]
                assert (held["version"], held["hash"]) == (6, status.adapter_hash.hex())
                served[w, job_id] = sum(int(p.groups_admitted) for p in status.peers if p.peer_id == keys[w].peer_id)
        print("groups admitted per (worker, job):", served)
        assert all(sum(served[w, j] for w in WORKERS) > 0 for j in jobs), served
        assert all(sum(served[w, j] for j in jobs) > 0 for w in WORKERS), served
    finally:
        swarm.stop_all()
