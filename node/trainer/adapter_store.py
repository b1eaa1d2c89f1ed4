"""The trainer's adapter store: every published version as a signed delta, plus snapshots.

On disk, per job: `d{to}.bin` (delta payload from to-1 -> to), `s{v}.bin` (full snapshot), each
with a `.hdr` file holding the trainer-signed `AdapterUpdate` header. Files are written to a
temporary name, fsynced and renamed, so a crash leaves either the old or the new file. Snapshots
are kept every `snapshot_every` versions (and for the head); other versions are rebuilt from the
nearest snapshot and the delta chain. A trainer that adopts a cotrainer's versions (the same job,
averaged gradients) stores them re-signed with its own key (`adopt`), after checking them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from swarmrl.protocol import adapter as ad
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a fsynced temporary file and rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass(frozen=True)
class StoredUpdate:
    """One signed header with its payload bytes."""

    header: pb.Signed
    payload: bytes


class AdapterStore:
    """Signed deltas and snapshots of one job's adapter versions (thread-safe)."""

    def __init__(self, root: Path, job_id: str, identity: Identity, *, snapshot_every: int = 10) -> None:
        self.root = root
        self.job_id = job_id
        self.identity = identity
        self.snapshot_every = snapshot_every
        self._lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True)

    def _sign(self, *, from_v: int, to_v: int, from_hash: bytes, to_hash: bytes, payload: bytes, snapshot: bool) -> pb.Signed:
        header = pb.AdapterUpdate(
            job_id=self.job_id, from_version=from_v, to_version=to_v, from_hash=from_hash, to_hash=to_hash,
            snapshot=snapshot, payload_sha256=ad.payload_sha256(payload), payload_size=len(payload), codec=ad.CODEC,
        )
        return signing.sign(self.identity, signing.ADAPTER_UPDATE, header)

    def _put(self, stem: str, header: pb.Signed, payload: bytes) -> None:
        write_atomic(self.root / f"{stem}.bin", payload)
        write_atomic(self.root / f"{stem}.hdr", header.SerializeToString())

    def _get(self, stem: str) -> StoredUpdate | None:
        hdr, bin_ = self.root / f"{stem}.hdr", self.root / f"{stem}.bin"
        if not (hdr.exists() and bin_.exists()):
            return None
        return StoredUpdate(pb.Signed.FromString(hdr.read_bytes()), bin_.read_bytes())

    def put_snapshot(self, version: int, state: ad.State) -> bytes:
        """Store a full snapshot of `version`; returns its adapter hash."""
        payload = ad.encode_state(state)
        h = ad.adapter_hash(state)
        with self._lock:
            self._put(f"s{version}", self._sign(from_v=0, to_v=version, from_hash=b"", to_hash=h,
                                                 payload=payload, snapshot=True), payload)
        return h

    def publish(self, version: int, old: ad.State, new: ad.State) -> tuple[ad.State, StoredUpdate]:
        """Publish version `version` (= old's version + 1) as a signed delta.

        Returns (exact_new, update): exact_new = old + (new - old) is the state to adopt.
        """
        delta, exact = ad.make_delta(old, new)
        payload = ad.encode_state(delta)
        header = self._sign(from_v=version - 1, to_v=version, from_hash=ad.adapter_hash(old),
                            to_hash=ad.adapter_hash(exact), payload=payload, snapshot=False)
        with self._lock:
            self._put(f"d{version}", header, payload)
        if version % self.snapshot_every == 0:
            self.put_snapshot(version, exact)
        return exact, StoredUpdate(header, payload)

    def adopt(self, header: pb.AdapterUpdate, payload: bytes, state_after: ad.State) -> None:
        """Store a verified update published by a cotrainer, re-signed by this trainer.

        `state_after` is the adapter once the update is applied (for periodic snapshots).
        """
        to_v = int(header.to_version)
        signed = self._sign(from_v=int(header.from_version), to_v=to_v, from_hash=bytes(header.from_hash),
                            to_hash=bytes(header.to_hash), payload=payload, snapshot=bool(header.snapshot))
        with self._lock:
            self._put(f"{'s' if header.snapshot else 'd'}{to_v}", signed, payload)
        if not header.snapshot and to_v % self.snapshot_every == 0:
            self.put_snapshot(to_v, state_after)

    def delta_sizes(self, head: int) -> list[int]:
        """Payload bytes of the deltas to versions 1..head (0 where one is missing)."""
        return [(self.root / f"d{v}.bin").stat().st_size if (self.root / f"d{v}.bin").exists() else 0
                for v in range(1, head + 1)]

    def delta(self, to_version: int) -> StoredUpdate | None:
        """The delta that produces `to_version`, if published."""
        return self._get(f"d{to_version}")

    def snapshot(self, version: int) -> StoredUpdate | None:
        """A signed snapshot of `version`, rebuilt from the nearest older snapshot if needed."""
        stored = self._get(f"s{version}")
        if stored is not None:
            return stored
        base = max((v for v in range(version + 1) if (self.root / f"s{v}.hdr").exists()), default=None)
        if base is None:
            return None
        snap = self._get(f"s{base}")
        assert snap is not None
        state = ad.decode_state(snap.payload)
        for v in range(base + 1, version + 1):
            d = self.delta(v)
            if d is None:
                return None
            state = ad.apply_delta(state, ad.decode_state(d.payload))
        self.put_snapshot(version, state)
        return self._get(f"s{version}")

    def updates(self, req: pb.AdapterRequest, head: int) -> Iterator[StoredUpdate]:
        """What `FetchAdapter` serves: deltas have_version -> wanted version (absent = `head`),
        or one snapshot when asked (or when the caller is ahead of the wanted version)."""
        want = req.want_version if req.HasField("want_version") else head
        if want > head:
            return
        chain = None if req.snapshot or req.have_version > want else self._delta_chain(req.have_version, want)
        if chain is None:  # asked for a snapshot, or the stored deltas don't chain (a state adopted
            snap = self.snapshot(want)  # from a cotrainer replaced a version): one snapshot
            if snap is not None:
                yield snap
            return
        yield from chain

    def _delta_chain(self, have: int, want: int) -> list[StoredUpdate] | None:
        """The stored deltas have -> want when each starts from the previous one's hash."""
        chain: list[StoredUpdate] = []
        prev: bytes | None = None
        for v in range(have + 1, want + 1):
            update = self.delta(v)
            if update is None:
                return None
            header = pb.AdapterUpdate.FromString(update.header.body)
            if prev is not None and bytes(header.from_hash) != prev:
                return None
            chain.append(update)
            prev = bytes(header.to_hash)
        return chain

    def latest_version(self) -> int:
        """Highest version with a stored delta or snapshot (0 when none)."""
        versions = [int(p.stem[1:]) for p in self.root.glob("[ds]*.hdr")]
        return max(versions, default=0)
