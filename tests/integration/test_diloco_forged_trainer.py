"""A trainer that is not what its round tickets say, with real processes on loopback (issue 26,
"bad input"): a bootstrap, three trainers of one tiny DiLoCo job (H = 4) and three workers, one
following each trainer. Trainer2 runs the `forged_outer_ticket` drill: the tickets it gathers in
its outer rounds don't verify, and the pseudo-gradient it sends is poison (every value 1000).
Every trainer lists all three as cotrainers (trainer2 stands for an impostor of a listed
trainer: its libp2p peer joins the rounds, but it can't sign as the trainer), so each outer round
expects three members. Then:

- the honest trainers refuse it, as it asks to join or at the all-reduce of a group it leads,
  and count it under `bad_signature` (`JobStatus.averaging_refused`);
- their own outer rounds agree (a round whose leader turned trainer2 away waits its matchmaking
  time for the third member, then goes on with two), and they end the job on the same adapter;
- the poison is in neither: their adapters' largest LoRA value stays far below it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from swarmrl.node.submitter.client import job_status, sign_job, submit_signed
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.faults import POISON
from tests.integration.diloco_swarm import DilocoSwarm, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
H, STEPS, OUTER_TIMEOUT_S = 4, 12, 10.0
TRAINERS = ("trainer0", "trainer1", "trainer2")
WORKERS = ("worker0", "worker1", "worker2")


def test_a_trainer_with_forged_tickets_is_refused_and_the_others_agree(tmp_path: Path, model_cache: Path) -> None:
    swarm = DilocoSwarm(tmp_path, model_cache, [*TRAINERS, *WORKERS])
    ids = [swarm.keys[t].peer_id for t in TRAINERS]
    try:
        swarm.start_bootstrap()
        eps = [swarm.start_trainer("trainer0", (0, 3), ids, []),
               swarm.start_trainer("trainer1", (1, 3), ids, []),
               swarm.start_trainer("trainer2", (2, 3), ids, ['fault="forged_outer_ticket"'])]
        spec = builtin_job("tiny", model_cache, steps=STEPS, batch_groups=2, prompts_per_lease=2, sync="diloco",
                           inner_steps=H, outer_timeout_s=OUTER_TIMEOUT_S)
        envelope = sign_job(swarm.keys["submitter"], spec)
        job_id = submit_signed(eps[0], envelope)
        assert all(submit_signed(ep, envelope) == job_id for ep in eps[1:])
        for w, t in zip(WORKERS, ids):
            swarm.start_worker(w, t)

        honest = eps[:2]
        wait_for(lambda: all(job_status(ep, job_id, timeout_s=10).state == "done" for ep in honest), 600,
                 "the honest trainers ending the job", swarm.log("trainer0"))
        assert "forged_outer_ticket" in swarm.log("trainer2").read_text()
        statuses = [job_status(ep, job_id, timeout_s=10) for ep in honest]
        refused = sum(st.averaging_refused.get("bad_signature", 0) for st in statuses)
        assert refused >= 1, [dict(st.averaging_refused) for st in statuses]
        assert set().union(*(st.averaging_refused for st in statuses)) == {"bad_signature"}
        assert all(st.outer_rounds >= 1 for st in statuses), [st.outer_rounds for st in statuses]

        # the last round may end differently at the two: the larger id adopts the other's (test_diloco_kill)
        def ends() -> set[tuple[int, bytes]]:
            return {(s.policy_version, bytes(s.adapter_hash)) for s in (job_status(ep, job_id, timeout_s=10)
                                                                        for ep in honest)}

        wait_for(lambda: len(ends()) == 1, 120, "the honest trainers ending on the same adapter",
                 swarm.log("trainer1"))
        assert {v for v, _ in ends()} == {STEPS}
        # a trainer reports done before it exports final/ (atomically, file by file: JobRuntime.export)
        finals = [tmp_path / t / "jobs" / job_id / "final" / "adapter_model.safetensors" for t in TRAINERS[:2]]
        wait_for(lambda: all(f.exists() for f in finals), 60, "the honest trainers' final exports",
                 swarm.log("trainer0"))
        for t, final in zip(TRAINERS[:2], finals):
            tensors = load_file(str(final))
            largest = max(float(x.abs().max()) for x in tensors.values())
            assert largest < POISON / 100, (t, largest)
        print(f"honest trainers: refused {refused} forged tickets, outer rounds agreed "
              f"{[st.outer_rounds for st in statuses]} of {STEPS // H}, same adapter at v{STEPS}")
    finally:
        swarm.stop_all()
