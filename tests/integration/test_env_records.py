"""Workers announce their environments in the real DHT (hivemind nodes on loopback), and the
trainer's status says when no worker can serve a job: a worker announcing arithmetic, a job on
environment foo 2 that nobody has -> 0 workers and why; a second worker announcing foo 2 -> 1."""

from __future__ import annotations

import pytest

from swarmrl.node.cli.status import print_status
from swarmrl.node.swarm.dht import start_dht, visible_maddrs
from swarmrl.node.swarm.env_records import EnvAnnouncer
from swarmrl.node.trainer.status import fill_serving
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

pytestmark = pytest.mark.integration
MODEL = "aa" * 32
PKG = "ab12" * 16


def _status(spec: JobSpec, dht) -> pb.JobStatus:
    st = pb.JobStatus(job_id="j", state="running")
    fill_serving(st, spec, dht, max_age_s=0.0)
    return st


def test_status_says_when_no_worker_serves_a_job(capsys: pytest.CaptureFixture[str]) -> None:
    trainer = start_dht()
    peers = visible_maddrs(trainer)
    nodes = [trainer]
    try:
        spec = JobSpec(base_model="tiny", base_model_sha256=MODEL, environment="foo", env_version="2",
                       env_package_sha256=PKG)
        assert _status(spec, trainer).unserved_reason == "no worker announces its environments in the DHT"
        nodes.append(start_dht(peers))
        arithmetic = [pb.EnvInfo(name="arithmetic", version="1", package="swarmrl")]
        assert EnvAnnouncer(nodes[1], Identity.generate(), arithmetic, [MODEL]).refresh(force=True)
        st = _status(spec, trainer)
        assert st.HasField("serving_workers") and st.serving_workers == 0
        assert st.unserved_reason == ("no worker announces environment foo 2 (package sha ab12ab12…); "
                                      "1 worker(s) announce: arithmetic 1")
        print_status(st)
        printed = " ".join(capsys.readouterr().out.split())   # rich wraps at the terminal width
        assert "workers serving it: 0 - no worker can serve this job: no worker announces environment foo 2" in printed
        nodes.append(start_dht(peers))
        foo = [pb.EnvInfo(name="foo", version="2", package="foo", package_sha256=PKG)]
        assert EnvAnnouncer(nodes[2], Identity.generate(), foo, [MODEL]).refresh(force=True)
        st = _status(spec, trainer)
        assert st.serving_workers == 1 and st.unserved_reason == ""
        assert _status(spec.model_copy(update={"environment": "arithmetic", "env_version": "1",
                                               "env_package_sha256": ""}), trainer).serving_workers == 1
    finally:
        for node in nodes:
            node.shutdown()
