"""The trainer remembers the adapter version of the peers that asked for leases last, not of every
peer id it ever saw (Admission.peer_versions), and the status still shows a live peer's version."""

from __future__ import annotations

import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.admission import PEER_VERSIONS_KEPT
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.node.trainer.status import job_status
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from tests.unit.test_trainer_job import FakeClock, _honest_batch, _submit


def test_many_peer_ids_leave_a_bounded_table_and_live_peers_versions(tmp_path, model_cache) -> None:
    torch.manual_seed(0)
    spec = builtin_job("tiny", model_cache, steps=4, batch_groups=1000, prompts_per_lease=1)
    ledger = Ledger(tmp_path / "ledger.sqlite", synchronous="normal")
    job = JobRuntime("job-peers", spec, identity=Identity.from_seed(b"t" * 32), ledger=ledger,
                     model_path=prepare_base_model("tiny", model_cache), state_dir=tmp_path, clock=FakeClock())
    assert job.admission.peer_versions_kept == PEER_VERSIONS_KEPT
    job.admission.peer_versions_kept = 50   # the rule at a size a test can fill
    early, live = Identity.from_seed(b"e" * 32), Identity.from_seed(b"l" * 32)

    def ask(who: str, version: int) -> pb.Lease:
        reply = job.admission.request_lease(who, pb.LeaseRequest(job_id=job.job_id, max_prompts=1,
                                                                 adapter_version=version))
        assert reply.HasField("lease"), reply.reason
        return reply.lease

    assert _submit(job, _honest_batch(job, early, ask(early.peer_id, 1))).accepted
    for n in range(200):
        ask(f"sybil-{n}", 0)
        if n % 20 == 0:
            lease = ask(live.peer_id, 2 + n // 20)
        assert len(job.admission.peer_versions) <= 50
    assert _submit(job, _honest_batch(job, live, lease)).accepted
    peers = {p.peer_id: p for p in job_status(job, 0).peers}
    assert peers[live.peer_id].adapter_version == 2 + 180 // 20   # its last request
    assert not peers[early.peer_id].HasField("adapter_version")   # asked longest ago: forgotten
    assert len(job.admission.peer_versions) == 50
    ledger.close()
