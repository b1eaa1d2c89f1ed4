"""Swarm figures are what their names say: a share stays in [0, 1]; the star ratio may exceed 1."""

from __future__ import annotations

from swarmrl.node.swarm.figures import swarm_figures, upload_share
from swarmrl.protocol.pb import swarm_pb2 as pb

JOB = "j" * 32


def _worker(from_trainer: int, from_peers: int, served: int) -> dict:
    return {"adapters": {JOB: {"peer_upload_bytes": served,
                               "sync": {"bytes_from_trainer": from_trainer, "bytes_from_peers": from_peers}}}}


def test_share_is_a_share_even_when_the_trainer_sends_more_than_a_star() -> None:
    # The red-team drill's case: adversaries (not among the honest workers) and snapshots make the
    # trainer upload more than a star of 2 honest workers x 4 deltas x 100 B would.
    st = pb.JobStatus(job_id=JOB, policy_version=4, delta_bytes=[100] * 4)
    st.upload_bytes["worker"] = 1264
    workers = {"w0": _worker(500, 300, 300), "w1": _worker(200, 300, 300)}
    fig = swarm_figures([st], workers, JOB, model_bytes=10_000)
    assert fig["trainer_upload_vs_star"] == 1264 / 800 > 1
    assert fig["trainer_upload_share"] == 700 / 1300
    for t, p in [(0, 0), (5, 0), (0, 5), (3, 9)]:
        assert 0.0 <= upload_share(t, p) <= 1.0
