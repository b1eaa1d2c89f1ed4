"""UpdateCache stays bounded while a job publishes many versions, and still serves the newest
ones (node/swarm/gossip.py)."""

from __future__ import annotations

import hashlib

import pytest

from swarmrl.node.swarm.gossip import UpdateCache
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import ReceivedUpdate

JOB = "cd" * 16
TRAINER = Identity.from_seed(b"c" * 32)


def _update(version: int, snapshot: bool = False) -> ReceivedUpdate:
    payload = version.to_bytes(8, "little") * 4
    header = pb.AdapterUpdate(job_id=JOB, to_version=version, snapshot=snapshot,
                              payload_sha256=hashlib.sha256(payload).digest())
    return ReceivedUpdate(header, signing.sign(TRAINER, signing.ADAPTER_UPDATE, header), payload)


def test_many_versions_keep_the_newest_deltas_and_snapshots_only():
    cache = UpdateCache(keep_deltas=4, keep_snapshots=2)
    for v in range(1, 2001):
        cache.put(_update(v))
        if v % 100 == 0:
            cache.put(_update(v, snapshot=True))
    held = cache.held(JOB)
    assert sorted(h.version for h in held if not h.snapshot) == [1997, 1998, 1999, 2000]
    assert sorted(h.version for h in held if h.snapshot) == [1900, 2000]
    # a peer within the kept window is served each delta it lacks; older ones are gone
    for v in range(1997, 2001):
        got = cache.get(JOB, v, snapshot=False)
        assert got is not None and got.payload == v.to_bytes(8, "little") * 4
    assert cache.get(JOB, 1996, snapshot=False) is None
    assert cache.get(JOB, 2000, snapshot=True) is not None


def test_a_count_of_zero_holds_none_of_that_kind():
    cache = UpdateCache(keep_deltas=0, keep_snapshots=1)
    for v in range(1, 50):
        cache.put(_update(v))
    cache.put(_update(49, snapshot=True))
    assert [(h.version, h.snapshot) for h in cache.held(JOB)] == [(49, True)]
    assert cache.get(JOB, 49, snapshot=False) is None


def test_the_default_is_bounded():
    cache = UpdateCache()
    for v in range(1, 300):
        cache.put(_update(v))
    assert len(cache.held(JOB)) == cache.keep[False] == 16


def test_a_negative_count_is_refused():
    with pytest.raises(ValueError, match="keep_deltas"):
        UpdateCache(keep_deltas=-1)


def _job_update(job: str, version: int) -> ReceivedUpdate:
    payload = version.to_bytes(8, "little")
    header = pb.AdapterUpdate(job_id=job, to_version=version, payload_sha256=hashlib.sha256(payload).digest())
    return ReceivedUpdate(header, signing.sign(TRAINER, signing.ADAPTER_UPDATE, header), payload)


def test_many_jobs_keep_those_updated_last():
    cache = UpdateCache(keep_deltas=4, keep_jobs=3)
    for j in range(40):   # a worker that runs for days sees job after job
        for v in range(1, 10):
            cache.put(_job_update(f"job-{j}", v))
        cache.put(_job_update("long-job", j + 1))   # a job that runs throughout stays held
    assert sorted(cache.jobs()) == ["job-38", "job-39", "long-job"]
    assert cache.get("job-39", 9, snapshot=False) is not None and cache.get("job-37", 9, snapshot=False) is None
    assert [h.version for h in cache.held("long-job")] == [37, 38, 39, 40]
    with pytest.raises(ValueError, match="keep_jobs"):
        UpdateCache(keep_jobs=0)
