"""The ledger's group commit (node/runtime/group_commit.py) under the trainer's admission: a receipt is
never sent before the batch it admits is on disk, admissions arriving together share one sync,
two batches racing for one prompt admit it once, and a failed sync stops the ledger.

"On disk" is modelled at the one place the ledger makes data durable: each fdatasync of the
write-ahead log is recorded with the log's bytes as they were when it began (what the sync
covers at the least), and a power cut right after that sync leaves the database file (which no
checkpoint touches in these small runs: checked) plus those bytes. SQLite itself reads that
image back, as it would after the cut.
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.runtime import group_commit
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol import admission as adm
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from tests.unit.test_red_team import _group


@pytest.fixture()
def runtime(tmp_path, model_cache):
    spec = builtin_job("tiny", model_cache, steps=4, batch_groups=64, prompts_per_lease=1)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = JobRuntime("job-gc", spec, identity=Identity.from_seed(b"t" * 32),
                     model_path=prepare_base_model("tiny", model_cache), state_dir=tmp_path, ledger=ledger)
    yield job, ledger, tmp_path
    ledger.close()


class DiskImages:
    """Records, at each fdatasync of the WAL, the log's bytes as that sync began (see the module
    docstring); `hold` makes the next sync wait until `release` (to let commits pile up)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.images: list[bytes] = []
        self.lock = threading.Lock()
        self.held: threading.Event | None = None
        real = group_commit._fdatasync

        def recording_fdatasync(fd: int) -> None:
            image = os.pread(fd, os.fstat(fd).st_size, 0)
            held, self.held = self.held, None
            if held is not None:
                assert held.wait(60), "the held sync was never released"
            real(fd)
            with self.lock:
                self.images.append(image)

        monkeypatch.setattr(group_commit, "_fdatasync", recording_fdatasync)

    def hold(self) -> threading.Event:
        self.held = threading.Event()
        return self.held

    def admitted_after_cut(self, db_file: Path, image: bytes, into: Path) -> set[str]:
        """Batch ids a ledger holds when the power is cut after the sync that recorded `image`."""
        into.mkdir()
        shutil.copy(db_file, into / "ledger.sqlite")
        (into / "ledger.sqlite-wal").write_bytes(image)
        db = sqlite3.connect(into / "ledger.sqlite")
        try:
            return {b for (b,) in db.execute("SELECT batch_id FROM batches")}
        finally:
            db.close()


def _until(condition: Callable[[], bool]) -> None:
    for _ in range(60_000):
        if condition():
            return
        threading.Event().wait(0.001)
    raise AssertionError("the threads never got there")


def _leases(job: JobRuntime, peers: list[Identity]) -> list[pb.Lease]:
    out = []
    for who in peers:
        reply = job.admission.request_lease(who.peer_id, pb.LeaseRequest(job_id=job.job_id, max_prompts=1))
        assert reply.HasField("lease"), reply.reason
        out.append(reply.lease)
    return out


def _batch(job: JobRuntime, who: Identity, lease: pb.Lease, nonce: bytes = b"") -> pb.Signed:
    groups = [_group(i, job.prompt_ids(i), version=lease.policy_version, n=job.spec.group_size)
              for i in lease.prompt_indices]
    return signing.sign(who, signing.ROLLOUT_BATCH, pb.RolloutBatch(
        job_id=job.job_id, lease_id=lease.lease_id, peer_id=who.peer_id, groups=groups, nonce=nonce))


def _peers(n: int) -> list[Identity]:
    """`n` fixed worker identities."""
    return [Identity.from_seed(bytes([k]) * 32) for k in range(1, n + 1)]


def _one_batch_each(job: JobRuntime, n: int) -> list[pb.Signed]:
    """One signed batch from each of `n` workers, each answering its own fresh lease."""
    peers = _peers(n)
    return [_batch(job, who, lease) for who, lease in zip(peers, _leases(job, peers), strict=True)]


def test_a_power_cut_right_after_a_receipt_keeps_its_batch(runtime, monkeypatch) -> None:
    job, _, tmp = runtime
    envelopes = _one_batch_each(job, 4)
    disk = DiskImages(monkeypatch)
    db_file = tmp / "ledger.sqlite"
    db_before = db_file.read_bytes()
    answered: set[str] = set()
    for k, envelope in enumerate(envelopes):   # one at a time: the cut comes right after each receipt
        syncs_before = len(disk.images)
        receipt = job.admission.admit(envelope, 1 << 24)
        assert receipt.accepted and all(g.admitted for g in receipt.groups), receipt
        assert len(disk.images) == syncs_before + 1   # alone, a batch pays one sync
        answered.add(receipt.batch_id)
        assert disk.admitted_after_cut(db_file, disk.images[-1], tmp / f"cut{k}") == answered
    assert db_file.read_bytes() == db_before   # no checkpoint ran: the image model holds


def test_batches_arriving_together_share_a_sync_and_all_survive_a_cut(runtime, monkeypatch) -> None:
    job, _, tmp = runtime
    envelopes = _one_batch_each(job, 6)
    disk = DiskImages(monkeypatch)
    db_file = tmp / "ledger.sqlite"
    release = disk.hold()   # the first batch's sync waits until every other batch has committed
    receipts: list[pb.BatchReceipt] = []

    def submit(envelope: pb.Signed) -> None:
        receipts.append(job.admission.admit(envelope, 1 << 24))

    first = threading.Thread(target=submit, args=(envelopes[0],))
    first.start()
    group = job.ledger._group
    assert group is not None
    _until(lambda: disk.held is None)   # the first batch committed and its sync is held
    base = group.last()
    others = [threading.Thread(target=submit, args=(e,)) for e in envelopes[1:]]
    for t in others:
        t.start()
    _until(lambda: group.last() >= base + len(others))   # every other batch committed too
    release.set()
    for t in [first, *others]:
        t.join(60)
    assert len(receipts) == len(envelopes) and all(r.accepted and r.groups[0].admitted for r in receipts)
    assert len(disk.images) == 2   # the held sync, then one for the five batches that piled up behind it
    assert disk.admitted_after_cut(db_file, disk.images[-1], tmp / "cut") == {r.batch_id for r in receipts}


def test_two_batches_racing_for_one_prompt_admit_it_once(runtime) -> None:
    job, ledger, _ = runtime
    peers = _peers(5)
    for who, lease in zip(peers, _leases(job, peers), strict=True):
        twins = [_batch(job, who, lease, nonce=bytes([n]) * 16) for n in (1, 2)]   # same prompt, two batch ids
        start = threading.Barrier(2)
        verdicts: list[pb.GroupVerdict] = []

        def submit(envelope: pb.Signed, start: threading.Barrier = start, verdicts: list = verdicts) -> None:
            start.wait()
            verdicts.extend(job.admission.admit(envelope, 1 << 24).groups)

        threads = [threading.Thread(target=submit, args=(e,)) for e in twins]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(v.reason for v in verdicts) == ["", adm.DUPLICATE_GROUP]
    assert ledger.group_counts(job.job_id)["pending"] == len(peers)


def test_a_failed_sync_fails_the_write_and_every_later_one(tmp_path, monkeypatch) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.record_step("j", 1, {"loss": 1.0})
    real = group_commit._fdatasync
    faults = [OSError(errno.EIO, "injected I/O error")]

    def failing_once(fd: int) -> None:
        if faults:
            raise faults.pop()
        real(fd)

    monkeypatch.setattr(group_commit, "_fdatasync", failing_once)
    with pytest.raises(group_commit.WalSyncError, match="fdatasync failed"):
        ledger.record_step("j", 2, {"loss": 0.5})
    with pytest.raises(group_commit.WalSyncError, match="an earlier sync failed"):
        ledger.record_step("j", 3, {"loss": 0.2})   # the disk works again, but what step 2 wrote may be gone
    ledger.close()


def test_normal_sync_never_waits_for_the_disk(tmp_path, monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(group_commit, "_fdatasync", calls.append)
    ledger = Ledger(tmp_path / "ledger.sqlite", synchronous="normal")
    ledger.record_step("j", 1, {"loss": 1.0})
    ledger.sync()
    assert calls == [] and ledger.steps("j") == [{"loss": 1.0}]
    ledger.close()
