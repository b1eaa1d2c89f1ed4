"""Adapter versions for re-scoring: fetched as trainer-signed snapshots, cached per (job, version).

A validator needs the exact adapter a completion claims (`policy_version`). It asks the job's
trainer for a signed snapshot of that version (`FetchAdapter(snapshot=True, want_version=v)`),
verifies it like a worker does (`protocol.updates`: trainer signature, payload sha256, adapter hash)
and keeps the last few in an LRU. The trainer serves every version from its retention floor up to
its head: an empty answer (a version after the head) is `VersionUnavailable`, a version it pruned is
answered OUT_OF_RANGE, `VersionNotKept` (the validator cannot decide then: it lagged too far).

`want_version` is an explicit field (absent = the head), so version 0 is asked for like any other.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping

import grpc

from swarmrl.node.net.trainer_client import AdapterFetcher
from swarmrl.protocol import adapter as ad
from swarmrl.protocol.identity import peer_id_from_public_key
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import AdapterReplica, ReceivedUpdate, VersionNotKept, assemble

log = logging.getLogger(__name__)
DEFAULT_CAPACITY = 4

class VersionUnavailable(LookupError):
    """The trainer does not serve this version: it was never published."""

    def __init__(self, job_id: str, version: int) -> None:
        super().__init__(f"job {job_id[:12]}: the trainer does not serve adapter version {version}")
        self.version = version


class AdapterReplaced(LookupError):
    """A completion names an adapter hash other than the one the trainer now serves for its
    version: the trainer published it, admitted the batch, then replaced that version by a
    cotrainer's (a split repaired). Nobody serves the named adapter any more, so its log-probs
    can't be recomputed: undecided, never a failure (admission refuses a hash the trainer never
    published as `adapter_unknown`)."""


class AdapterSource(ABC):
    """The adapter states of one job, by version."""

    job_id: str

    @abstractmethod
    def state(self, version: int) -> tuple[ad.State, bytes]:
        """(state, adapter hash) of `version`.

        Raises:
            VersionUnavailable: the version does not exist.
            VersionNotKept: it existed, but the trainer no longer keeps it.
            ad.AdapterError: what arrived does not verify.
        """


class InMemoryAdapters(AdapterSource):
    """A job's versions held in memory (simulations, tests, a trainer validating itself)."""

    def __init__(self, job_id: str, states: Mapping[int, ad.State]) -> None:
        self.job_id = job_id
        self._states = {int(v): ad.clone_state(s) for v, s in states.items()}

    def state(self, version: int) -> tuple[ad.State, bytes]:
        """(state, adapter hash) of a held version (the held tensors, not a copy).

        Raises VersionUnavailable for a version not held."""
        if version not in self._states:
            raise VersionUnavailable(self.job_id, version)
        s = self._states[version]
        return s, ad.adapter_hash(s)


class SnapshotCache:
    """LRU of verified adapter states keyed by (job id and trainer, version), shared by a validator's jobs."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[tuple[str, int], tuple[ad.State, bytes]] = OrderedDict()

    def get(self, job_id: str, version: int, load: Callable[[], tuple[ad.State, bytes]]) -> tuple[ad.State, bytes]:
        """The cached entry, or `load()`'s result (cached; the least recently used one leaves)."""
        key = (job_id, version)
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = load()
        self._items[key] = value
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return value

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._items


class TrainerAdapters(AdapterSource):
    """A job's versions fetched from its trainer as signed snapshots (see the module docstring).

    trainer: the job's trainer (its client, `node.net.trainer_client.AdapterFetcher`);
    trainer_public_key: from the job's signed DHT record.
    """

    def __init__(self, job_id: str, trainer_public_key: bytes, trainer: AdapterFetcher, cache: SnapshotCache) -> None:
        self.job_id = job_id
        self.trainer_public_key = trainer_public_key
        self.trainer_id = peer_id_from_public_key(trainer_public_key)
        self.trainer = trainer
        self.cache = cache

    def state(self, version: int) -> tuple[ad.State, bytes]:
        """(state, adapter hash) of `version`: from the cache, else the trainer's signed snapshot.

        Raises VersionUnavailable (the trainer has no such version), ad.AdapterError (the snapshot
        does not verify or is not the one asked for), grpc.RpcError (the trainer can't be reached).
        """
        # keyed by trainer too: a DiLoCo job's trainers publish different inner versions of one number
        return self.cache.get(f"{self.job_id}@{self.trainer_id}", version, lambda: self._load(version))

    def _updates(self, req: pb.AdapterRequest) -> list[ReceivedUpdate]:
        try:
            return list(assemble(self.trainer.fetch_adapter(req), self.trainer_id))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                raise VersionNotKept(self.job_id, req.want_version) from exc
            raise

    def _load(self, version: int) -> tuple[ad.State, bytes]:
        updates = self._updates(pb.AdapterRequest(job_id=self.job_id, want_version=version, snapshot=True))
        if not updates:
            raise VersionUnavailable(self.job_id, version)
        snap = updates[0]
        if not snap.header.snapshot or snap.header.job_id != self.job_id:
            raise ad.AdapterError(f"asked for a snapshot of job {self.job_id[:12]}, got something else")
        if snap.header.to_version != version:
            raise ad.AdapterError(f"asked for version {version}, the trainer sent {snap.header.to_version}")
        replica = AdapterReplica(self.job_id, self.trainer_public_key)
        replica.apply(snap)
        assert replica.state is not None
        return replica.state, replica.hash
