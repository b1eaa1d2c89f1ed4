"""A DiLoCo trainer SIGKILLed mid-outer-round (issue 26's fault figure), with real processes on
loopback: a bootstrap, two trainers of one tiny job (`sync = "diloco"`, H = 4, int8 outer rounds)
and two workers. Trainer1 runs the `die_in_outer_round` drill: in its second outer round, a moment
after it put its pseudo-gradient in, it SIGKILLs its process group (itself, its DHT, its
averager). Then:

- the survivor finishes that round within the round's timeout (alone) and the job goes on;
- no admitted group is lost: every group a worker holds trainer1's signed receipt for is in
  trainer1's ledger when it comes back;
- trainer1, restarted without the drill from its state folder, adopts the job's outer state and
  agrees with the survivor by adapter hash within two outer steps, then takes agreed outer
  rounds again, and both end the job on the same adapter.

A known failure, left open (docs/DILOCO.md): on a loaded machine the restarted trainer's download
of the survivor's state (hivemind's `load_state_from_peers`) can come back empty every time, so it
never rejoins; the test is then marked xfail, naming it, after every check before the rejoin held.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from swarmrl.node.submitter.client import job_status, sign_job, submit_signed
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.worker.receipts import ReceiptStore, receipts_path
from swarmrl.protocol import diloco
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.signing import signer_id
from tests.integration.diloco_swarm import DilocoSwarm, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
H, STEPS, OUTER_TIMEOUT_S = 4, 64, 15.0
TRAINERS = ("trainer0", "trainer1")
NO_STATE = "but no newer state came"   # cotraining.sync_from's line when a cotrainer ahead served no state


def _outer_hashes(state_dir: Path, job_id: str) -> dict[int, bytes]:
    """Outer version -> adapter hash, from a trainer's store (its signed snapshot headers)."""
    out = {}
    for hdr in (state_dir / "jobs" / job_id / "adapters").glob("s*.hdr"):
        v = int(hdr.stem[1:])
        if v and diloco.is_outer_version(v, H):
            out[v] = bytes(pb.AdapterUpdate.FromString(pb.Signed.FromString(hdr.read_bytes()).body).to_hash)
    return out


def _receipted(cache: Path, workers: list[Identity], trainer: str, job_id: str) -> set[int]:
    """Prompt indices the workers hold `trainer`'s signed admission receipts for."""
    got: set[int] = set()
    for w in workers:
        path = receipts_path(cache, w.peer_id)
        if not path.exists():
            continue
        store = ReceiptStore(path)
        try:
            for env in store.envelopes(job_id):
                if signer_id(env) == trainer:
                    got |= set(pb.AdmissionReceipt.FromString(env.body).admitted)
        finally:
            store.close()
    return got


def _ledger_prompts(state_dir: Path, job_id: str) -> set[int]:
    con = sqlite3.connect(f"file:{state_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    try:
        return {int(r[0]) for r in con.execute("SELECT prompt_index FROM groups WHERE job_id = ?", (job_id,))}
    finally:
        con.close()


def test_a_trainer_killed_mid_outer_round_loses_nothing_and_rejoins(tmp_path: Path, model_cache: Path) -> None:
    work = tmp_path
    swarm = DilocoSwarm(work, model_cache, [*TRAINERS, "worker0", "worker1"])
    procs, keys = swarm.procs, swarm.keys
    ids = [keys[t].peer_id for t in TRAINERS]

    def start_trainer(name: str, rank: int, extra: list[str]) -> str:
        return swarm.start_trainer(name, (rank, 2), ids, extra)

    try:
        swarm.start_bootstrap()
        ep0 = start_trainer("trainer0", 0, [])
        ep1 = start_trainer("trainer1", 1, ['fault="die_in_outer_round"'])
        spec = builtin_job("tiny", model_cache, steps=STEPS, batch_groups=2, prompts_per_lease=2, sync="diloco",
                           inner_steps=H, outer_timeout_s=OUTER_TIMEOUT_S)
        envelope = sign_job(keys["submitter"], spec)
        job_id = submit_signed(ep0, envelope)
        assert submit_signed(ep1, envelope) == job_id
        for i, w in enumerate(("worker0", "worker1")):
            swarm.start_worker(w, ids[i])

        # trainer1 dies in its second outer round (version 2H), its whole process group with it
        killed = procs.procs["trainer1"]
        deadline = time.monotonic() + 300
        while killed.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert killed.returncode == -9, "the drill did not kill trainer1"
        log1 = work / "logs" / "trainer1.log"
        assert "die_in_outer_round" in log1.read_text()
        receipted = _receipted(model_cache, [keys["worker0"], keys["worker1"]], ids[1], job_id)
        assert receipted, "no worker holds a receipt of trainer1"
        kept = _ledger_prompts(work / "trainer1", job_id)
        assert receipted <= kept, f"admitted groups lost: {sorted(receipted - kept)[:10]}"

        # the survivor finished that round alone, within the round's timeout, and went on
        wait_for(lambda: job_status(ep0, job_id, timeout_s=10).policy_version >= 2 * H + 2, 180,
              "the survivor stepping past the round", work / "logs" / "trainer0.log")
        history = job_status(ep0, job_id, history=STEPS, timeout_s=10).history
        row = next(h for h in history if h.step == 2 * H)
        assert row.extra["outer_agreed"] == 0.0 and row.extra["outer_seconds"] < 3 * OUTER_TIMEOUT_S + 10

        # back without the drill: resumes, adopts the outer state, agrees within two outer steps
        at_restart = diloco.last_outer_version(job_status(ep0, job_id, timeout_s=10).policy_version, H)
        ep1 = start_trainer("trainer1", 1, [])
        assert "resumed at version" in log1.read_text()
        assert receipted <= _ledger_prompts(work / "trainer1", job_id)

        def agreed_at() -> int | None:
            mine, theirs = _outer_hashes(work / "trainer1", job_id), _outer_hashes(work / "trainer0", job_id)
            common = sorted(v for v in mine if v > 2 * H and theirs.get(v) == mine[v])
            return common[0] if common else None

        try:
            wait_for(lambda: agreed_at() is not None, 240, "trainer1 agreeing by hash again", log1)
        except pytest.fail.Exception:
            if NO_STATE in log1.read_text():   # the known failure (docs/DILOCO.md, "Not done")
                pytest.xfail("the restarted trainer could not download the survivor's state over hivemind "
                             "(its libp2p streams to the survivor closed empty): it never rejoined")
            raise
        first = agreed_at()
        assert first is not None and first <= at_restart + 2 * H, (first, at_restart)
        print(f"killed in the round at v{2 * H}; the survivor's round took {row.extra['outer_seconds']:.1f}s "
              f"(timeout {OUTER_TIMEOUT_S:.0f}s); {len(receipted)} receipted groups of trainer1 all in its ledger; "
              f"restarted at the survivor's outer v{at_restart}; agreed by hash at v{first}")
        wait_for(lambda: job_status(ep1, job_id, timeout_s=10).outer_rounds >= 1, 240,
              "an agreed outer round after the restart", log1)
        wait_for(lambda: all(job_status(ep, job_id, timeout_s=10).state == "done" for ep in (ep0, ep1)), 300,
              "both trainers ending the job", log1)

        # the last round may end differently at the two (one member misses an averaged part): the
        # records show the same version with two adapters, and the larger id adopts the other's
        def ends() -> set[tuple[int, bytes]]:
            return {(s.policy_version, bytes(s.adapter_hash)) for s in (job_status(ep, job_id, timeout_s=10)
                                                                        for ep in (ep0, ep1))}

        wait_for(lambda: len(ends()) == 1, 120, "both trainers ending on the same adapter", log1)
        assert {v for v, _ in ends()} == {STEPS}
    finally:
        swarm.stop_all()
