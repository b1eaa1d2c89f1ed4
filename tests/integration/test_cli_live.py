"""The CLI against real processes on loopback: a job the trainer does not host, `status --json`
hashes in hex, and DHT peers that cannot be reached; each failure one line with exit code 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from swarmrl.node.local.processes import LocalSwarm

pytestmark = pytest.mark.integration


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmrl.node.cli.main", *argv], check=False, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "SWARMRL_TRACEBACK": ""})


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, model_cache):
    work = tmp_path_factory.mktemp("cli-trainer")
    swarm = LocalSwarm(work)
    swarm.start("trainer", "trainer", [f'key="{work / "trainer.key"}"', f'state_dir="{work / "state"}"',
                                       f'ready_file="{work / "trainer.ready"}"', f'cache_dir="{model_cache}"'])
    try:
        yield swarm.wait_ready("trainer", work / "trainer.ready", timeout_s=120)["endpoint"], work
    finally:
        swarm.stop_all()


def test_status_and_fetch_of_an_unknown_job_exit_1(trainer):
    endpoint, work = trainer
    status = _cli("status", "nosuchjob", "--trainer", endpoint)
    assert status.returncode == 1 and "unknown job 'nosuchjob'" in _one_line(status)
    fetch = _cli("fetch", "nosuchjob", "--trainer", endpoint, "--out", str(work / "adapter"))
    assert fetch.returncode == 1 and "does not host job 'nosuchjob'" in _one_line(fetch)


def test_submit_then_status_json_prints_the_hash_in_hex(trainer, model_cache):
    endpoint, work = trainer
    job = work / "job.toml"
    job.write_text('base_model = "tiny"\nsteps = 2\n')
    submit = _cli("submit", str(job), "--trainer", endpoint, "--key", str(work / "submitter.key"),
                  "--cache-dir", str(model_cache))
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip()
    status = _cli("status", job_id, "--trainer", endpoint, "--json")
    assert status.returncode == 0, status.stderr
    printed = json.loads(status.stdout)
    assert printed["jobId"] == job_id and len(printed["adapterHash"]) == 64
    int(printed["adapterHash"], 16)


def test_unreachable_initial_peers_exit_1():
    peer = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    proc = _cli("bootstrap", "--initial-peers", peer)
    assert proc.returncode == 1 and "initial peer" in _one_line(proc)
