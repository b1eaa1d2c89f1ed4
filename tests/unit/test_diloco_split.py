"""A DiLoCo round whose members started from different outer states (a split) is repaired
towards the smallest trainer id: the loser takes no step until it has adopted the winner's outer
version (`JobRuntime.split`, `CotrainerSync.coordinate(split_winner=...)`), or until
SPLIT_WAIT_ROUNDS round timeouts pass without it. Before, nothing repaired such a split: in a
two-trainer Gemma run both trainers went alone at every outer round after the first."""

from __future__ import annotations

import time

import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol.identity import Identity


class FakeCotraining:
    """Records what the job hands `coordinate` (the real one needs a DHT)."""

    def __init__(self) -> None:
        self.winners: list[str] = []

    def coordinate(self, records, split_winner: str = "") -> None:
        self.winners.append(split_winner)


def test_the_loser_of_a_split_waits_for_the_winners_version(tmp_path, model_cache) -> None:
    torch.manual_seed(0)
    spec = builtin_job("tiny", model_cache, steps=8, sync="diloco", inner_steps=4, outer_timeout_s=0.2)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = JobRuntime("job-split", spec, identity=Identity.from_seed(b"z" * 32),
                     model_path=prepare_base_model("tiny", model_cache), state_dir=tmp_path, ledger=ledger)
    fake = FakeCotraining()
    job.cotraining = fake   # type: ignore[assignment]
    winner = "1" * 40
    job.split = (job.version, job.head_hash, winner, time.monotonic() + 60)
    assert not job.ready()                       # no step before the adoption
    job.coordinate([])
    assert fake.winners[-1] == winner            # the cotraining layer is asked to adopt the winner's
    job.head_hash = bytes(32)                    # what an adoption does (`CotrainerSync.adopt`)
    job.coordinate([])
    assert job.split is None and fake.winners[-1] == ""

    job.split = (job.version, job.head_hash, winner, time.monotonic() - 1)   # the winner's version never came
    job.coordinate([])
    assert job.split is None and fake.winners[-1] == ""
    ledger.close()
