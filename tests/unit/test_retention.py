"""Disk stays bounded: the trainer's retention rule (pure), the adapter store pruning as versions
are published, catch-up from inside the window, and a clear "not kept" answer outside it (in
process and over gRPC)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from swarmrl.node.net.grpc_wire import GrpcWire
from swarmrl.node.net.trainer_client import TrainerClient
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.submitter.client import stub
from swarmrl.node.trainer.adapter_store import AdapterStore
from swarmrl.node.trainer.retention import KEEP_SNAPSHOTS, KEEP_VERSIONS, Retention, disk_use, plan_prune
from swarmrl.node.trainer.service import serve
from swarmrl.protocol import adapter as ad
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import AdapterReplica, VersionNotKept, assemble, chunks
from swarmrl.validator.adapters import SnapshotCache, TrainerAdapters

JOB = "job-r"
R = Retention(keep_versions=4, keep_snapshots=2, max_async_level=2)   # floor = head - 6


# ---- the rule (pure)

def test_nothing_is_pruned_inside_the_first_window() -> None:
    plan = plan_prune(6, set(range(1, 7)), {0, 5}, R)
    assert plan == type(plan)(floor=0, rebase_at=None, drop_deltas=(), drop_snapshots=())


def test_window_keeps_floor_snapshot_deltas_after_it_and_newest_spare_snapshots() -> None:
    plan = plan_prune(20, set(range(1, 21)), {0, 10, 14, 15, 20}, R)
    assert plan.floor == 14 and plan.rebase_at is None
    assert plan.drop_deltas == tuple(range(1, 15))          # d15..d20 stay: 14 -> 20 by deltas
    assert plan.drop_snapshots == (0, 10)                   # 14 is the floor, 15 and 20 the 2 spares
    plan = plan_prune(20, set(range(1, 21)), {0, 10, 16, 18, 19, 20}, R)
    assert plan.rebase_at == 14                             # no snapshot of the floor: rebuild it first
    assert plan.drop_snapshots == (0, 10, 16, 18)


def test_bounds_hold_for_any_head() -> None:
    for head in range(200):
        plan = plan_prune(head, set(range(1, head + 1)), set(range(0, head + 1, 3)), R)
        kept_deltas = head - len(plan.drop_deltas)
        kept_snaps = len(range(0, head + 1, 3)) - len(plan.drop_snapshots) + (plan.rebase_at is not None)
        assert kept_deltas == min(head, 6) and kept_snaps <= 1 + R.keep_snapshots
        assert head - plan.floor >= min(head, 2 + 2)        # the checkpoint (head or head-1) rolls forward


def test_retention_rejects_windows_too_small_for_restart() -> None:
    with pytest.raises(ValueError, match="roll-forward"):
        Retention(keep_versions=1)
    with pytest.raises(ValueError):
        Retention(keep_snapshots=0)


def test_trainer_config_defaults_are_the_rules() -> None:
    cfg = TrainerConfig()
    assert (cfg.keep_versions, cfg.keep_snapshots) == (KEEP_VERSIONS, KEEP_SNAPSHOTS)


# ---- the store

def _states(n: int) -> list[ad.State]:
    gen = torch.Generator().manual_seed(0)
    out = [{"a.lora_A.weight": 0.1 * torch.randn(4, 16, generator=gen), "a.lora_B.weight": torch.zeros(16, 4)}]
    for _ in range(n):
        out.append({k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in out[-1].items()})
    return out


def _files(store: AdapterStore, kind: str) -> set[int]:
    return {int(p.stem[1:]) for p in store.root.glob(f"{kind}*.bin")}


class FakeFetch:
    """FetchAdapter over the store in process (JobRuntime.updates without gRPC)."""

    def __init__(self, store: AdapterStore, head: int) -> None:
        self.store, self.head = store, head

    def fetch_adapter(self, req: pb.AdapterRequest) -> Iterator[pb.AdapterChunk]:
        for update in self.store.updates(req, self.head):
            yield from chunks(update.header, update.payload)


@pytest.fixture()
def published(tmp_path: Path) -> tuple[Identity, AdapterStore, list[ad.State]]:
    """30 versions published through a store with R, snapshots every 5; a validator asks for a
    snapshot of head-3 after each step (rebuilt and cached, then pruned)."""
    trainer = Identity.from_seed(b"t" * 32)
    store = AdapterStore(tmp_path / "adapters", JOB, trainer, snapshot_every=5, retention=R)
    states = _states(30)
    store.put_snapshot(0, states[0])
    exact = [ad.clone_state(states[0])]
    for v in range(1, 31):
        new, _ = store.publish(v, exact[-1], states[v])
        exact.append(new)
        list(store.updates(pb.AdapterRequest(job_id=JOB, want_version=max(0, v - 3), snapshot=True), v))
        assert len(_files(store, "d")) <= 6 and len(_files(store, "s")) <= 1 + R.keep_snapshots
    return trainer, store, exact


def test_store_prunes_as_it_publishes_and_serves_the_whole_window(published) -> None:
    trainer, store, exact = published
    assert _files(store, "d") == set(range(25, 31)) and store.oldest_kept() == 24
    assert len(store.delta_sizes(30)) == 30 and all(s > 0 for s in store.delta_sizes(30))  # pruned ones too
    src = TrainerAdapters(JOB, trainer.public_key, FakeFetch(store, 30), SnapshotCache(2))
    for v in range(24, 31):                                  # every version in the window, as a validator
        assert src.state(v)[1] == ad.adapter_hash(exact[v])
    with pytest.raises(VersionNotKept, match="not kept"):     # not "never published" (a freshness failure)
        src.state(23)


def test_catch_up_inside_the_window_by_deltas_and_a_late_joiner_by_a_snapshot(published) -> None:
    trainer, store, exact = published
    fetch = FakeFetch(store, 30)
    behind = AdapterReplica(JOB, trainer.public_key)
    behind.apply(next(assemble(fetch.fetch_adapter(pb.AdapterRequest(job_id=JOB, want_version=24, snapshot=True)), trainer.peer_id)))
    got = list(assemble(fetch.fetch_adapter(pb.AdapterRequest(job_id=JOB, have_version=24, want_version=30)), trainer.peer_id))
    assert [u.header.snapshot for u in got] == [False] * 6    # deltas 25..30
    for u in got:
        behind.apply(u)
    assert behind.version == 30 and behind.hash == ad.adapter_hash(exact[30])
    late = list(assemble(fetch.fetch_adapter(pb.AdapterRequest(job_id=JOB, have_version=3, want_version=30)), trainer.peer_id))
    assert [(u.header.snapshot, u.header.to_version) for u in late] == [(True, 30)]   # deltas from 3 are gone
    assert list(store.updates(pb.AdapterRequest(job_id=JOB, want_version=31), 30)) == []  # never published


def test_not_kept_is_answered_over_grpc(published) -> None:
    trainer, store, _ = published

    class Job:
        def updates(self, req: pb.AdapterRequest) -> Iterator:
            return store.updates(req, 30)

        def count_upload(self, requester: str, n: int) -> None:
            pass

    class Trainer:
        def __init__(self) -> None:
            self.jobs = {JOB: Job()}

        def count_upload(self, n: int) -> None:
            pass

    server, port = serve(Trainer(), "127.0.0.1", 0, 16)
    try:
        client = stub(f"127.0.0.1:{port}")
        with pytest.raises(grpc.RpcError) as err:
            list(client.FetchAdapter(pb.AdapterRequest(job_id=JOB, want_version=5, snapshot=True), timeout=10))
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "version 5 is not kept (the trainer keeps versions 24 and newer)" in err.value.details()
        src = TrainerAdapters(JOB, trainer.public_key, TrainerClient(GrpcWire(f"127.0.0.1:{port}", b"", max_message_mb=16)),
                              SnapshotCache(2))   # the validator's client: OUT_OF_RANGE is not retried
        with pytest.raises(VersionNotKept):
            src.state(5)
        assert src.state(27)[0] is not None
    finally:
        server.stop(0)


def test_disk_use_by_kind(published, tmp_path: Path) -> None:
    _, store, _ = published
    state_dir = tmp_path / "state"
    (state_dir / "jobs" / JOB).mkdir(parents=True)
    store.root.rename(state_dir / "jobs" / JOB / "adapters")
    (state_dir / "ledger.sqlite").write_bytes(b"x" * 10)
    use = disk_use(state_dir)
    assert use["deltas"] > 0 and use["snapshots"] > 0 and use["ledger"] == 10
    assert use["total"] == use["deltas"] + use["snapshots"] + use["ledger"]


def test_disk_use_skips_a_folder_pruned_during_the_walk(tmp_path: Path, monkeypatch) -> None:
    """A checkpoint folder listed, then removed by the trainer before the walk enters it, is not
    counted, and the walk goes on (Path.rglob raised FileNotFoundError here)."""
    state_dir = tmp_path / "state"
    for name in ("old", "new"):
        (state_dir / "jobs" / JOB / "checkpoints" / name).mkdir(parents=True)
        (state_dir / "jobs" / JOB / "checkpoints" / name / "adapter.bin").write_bytes(b"x" * 7)
    (state_dir / "ledger.sqlite").write_bytes(b"x" * 10)
    victim, real = state_dir / "jobs" / JOB / "checkpoints" / "old", os.scandir

    class Listed:
        def __init__(self, entries: list) -> None:
            self.entries = iter(entries)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.entries)

        def close(self) -> None:
            return None

    listed: list = []   # the checkpoints folder as listed once, just before "old" was removed

    def scandir(path="."):
        if not (isinstance(path, (str, Path)) and Path(path).name == "checkpoints"):
            return real(path)
        if not listed:
            with real(path) as it:
                listed.extend(it)
            shutil.rmtree(victim)
        return Listed(listed)

    monkeypatch.setattr(os, "scandir", scandir)
    use = disk_use(state_dir)
    assert use["checkpoints"] == 7 and use["ledger"] == 10 and use["total"] == 17


def test_a_trainer_that_adopted_a_snapshot_prunes_from_it(published, tmp_path: Path) -> None:
    """A cotrainer that joined at version 27 holds no deltas before it: its floor is the snapshot."""
    _, source, exact = published
    snap = source.snapshot(27)
    assert snap is not None
    joined = AdapterStore(tmp_path / "joined", JOB, Identity.from_seed(b"c" * 32), snapshot_every=5, retention=R)
    joined.put_snapshot(0, exact[0])
    joined.adopt(ad_header(snap), snap.payload, exact[27])
    for v in (28, 29, 30):
        delta = source.delta(v)
        assert delta is not None
        joined.adopt(ad_header(delta), delta.payload, exact[v])
    assert _files(joined, "s") == {27, 30} and _files(joined, "d") == {28, 29, 30} and joined.oldest_kept() == 27
    with pytest.raises(VersionNotKept):
        list(joined.updates(pb.AdapterRequest(job_id=JOB, want_version=25, snapshot=True), 30))


def ad_header(update) -> pb.AdapterUpdate:
    return pb.AdapterUpdate.FromString(update.header.body)
