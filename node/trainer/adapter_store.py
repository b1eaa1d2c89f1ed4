"""The trainer's adapter store: every published version as a signed delta, plus snapshots.

On disk, per job: `d{to}.bin` (delta payload from to-1 -> to), `s{v}.bin` (full snapshot), each
with a `.hdr` file holding the trainer-signed `AdapterUpdate` header. Files are written to a
temporary name, fsynced and renamed, so a crash leaves either the old or the new file. Snapshots
are written every `snapshot_every` versions; other versions are rebuilt from the nearest older
snapshot and the delta chain (and cached as snapshots). A trainer that adopts a cotrainer's versions
(the same job, averaged gradients) stores them re-signed with its own key (`adopt`), after checking
them; a version it published itself and then replaced that way (a split repaired) stays known
by its hash (`published`, `superseded.json`), so a batch sampled with it is told from a forged
one. Each new version prunes what the retention rule no longer keeps (`retention.py`: a window
of versions behind the head); a request for a version below it raises `VersionNotKept`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from swarmrl.node.trainer.retention import Retention, plan_prune
from swarmrl.protocol import adapter as ad
from swarmrl.protocol import delta_codec as dc
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import VersionNotKept

log = logging.getLogger(__name__)
SUPERSEDED_KEPT = 256   # versions whose replaced hashes are remembered (the newest)


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
    """Signed deltas and snapshots of one job's adapter versions (thread-safe).

    retention: what is kept as versions are added (default: `Retention()`, no staleness window);
    the trainer sets it from its config and the job's `max_async_level`.
    codec: how published deltas are encoded (`delta_codec`; the job's `delta_codec`); snapshots
    are always float32.
    """

    def __init__(self, root: Path, job_id: str, identity: Identity, *, snapshot_every: int = 10,
                 retention: Retention | None = None, codec: dc.DeltaCodec = dc.DEFAULT_CODEC) -> None:
        self.root = root
        self.job_id = job_id
        self.identity = identity
        self.snapshot_every = snapshot_every
        self.retention = retention or Retention()
        self.encoder = dc.DeltaEncoder(codec)
        self._lock = threading.RLock()
        root.mkdir(parents=True, exist_ok=True)
        self._sizes = {v: (root / f"d{v}.bin").stat().st_size for v in self._versions("d")}
        self._superseded = self._load_superseded()

    def _sign(self, *, from_v: int, to_v: int, from_hash: bytes, to_hash: bytes, payload: bytes, snapshot: bool,
              codec: str = ad.CODEC) -> pb.Signed:
        header = pb.AdapterUpdate(
            job_id=self.job_id, from_version=from_v, to_version=to_v, from_hash=from_hash, to_hash=to_hash,
            snapshot=snapshot, payload_sha256=ad.payload_sha256(payload), payload_size=len(payload), codec=codec,
        )
        return signing.sign(self.identity, signing.ADAPTER_UPDATE, header)

    def _put(self, stem: str, header: pb.Signed, payload: bytes) -> None:
        write_atomic(self.root / f"{stem}.bin", payload)
        write_atomic(self.root / f"{stem}.hdr", header.SerializeToString())
        if stem.startswith("d"):
            self._sizes[int(stem[1:])] = len(payload)

    def _get(self, stem: str) -> StoredUpdate | None:
        hdr, bin_ = self.root / f"{stem}.hdr", self.root / f"{stem}.bin"
        with self._lock:
            if not (hdr.exists() and bin_.exists()):
                return None
            return StoredUpdate(pb.Signed.FromString(hdr.read_bytes()), bin_.read_bytes())

    def _drop(self, stem: str) -> None:
        (self.root / f"{stem}.hdr").unlink(missing_ok=True)  # the header first: readers need both
        (self.root / f"{stem}.bin").unlink(missing_ok=True)

    def _versions(self, kind: str) -> set[int]:
        """Versions with a stored delta (`kind` "d") or snapshot ("s")."""
        return {int(p.stem[1:]) for p in self.root.glob(f"{kind}*.hdr")}

    def put_snapshot(self, version: int, state: ad.State) -> bytes:
        """Store a full snapshot of `version`; returns its adapter hash."""
        payload = ad.encode_state(state)
        h = ad.adapter_hash(state)
        with self._lock:
            self._put(f"s{version}", self._sign(from_v=0, to_v=version, from_hash=b"", to_hash=h,
                                                 payload=payload, snapshot=True), payload)
        return h

    def publish(self, version: int, old: ad.State, new: ad.State, *, carry: bool = True) -> tuple[ad.State, StoredUpdate]:
        """Publish version `version` (= old's version + 1) as a signed delta.

        Returns (exact_new, update): exact_new = old + the delta as every replica decodes it is
        the state to adopt. carry: keep the codec's error feedback (`DeltaEncoder`; off while
        cotrainers publish the same versions).
        """
        payload, exact = self.encoder.encode(old, new, carry=carry)
        header = self._sign(from_v=version - 1, to_v=version, from_hash=ad.adapter_hash(old),
                            to_hash=ad.adapter_hash(exact), payload=payload, snapshot=False,
                            codec=dc.header_codec(self.encoder.codec))
        with self._lock:
            self._put(f"d{version}", header, payload)
            if version % self.snapshot_every == 0:
                self.put_snapshot(version, exact)
            self.prune(version)
        return exact, StoredUpdate(header, payload)

    def publish_snapshot(self, version: int, state: ad.State) -> bytes:
        """Publish `version` as a signed snapshot only (a DiLoCo outer version: no delta from the
        previous version is stored, so a request for one is served this snapshot); returns its hash."""
        with self._lock:
            h = self.put_snapshot(version, state)
            self.prune(version)
        return h

    def adopt(self, header: pb.AdapterUpdate, payload: bytes, state_after: ad.State) -> None:
        """Store a verified update published by a cotrainer, re-signed by this trainer.

        `state_after` is the adapter once the update is applied (for periodic snapshots). The
        codec's carried residual is dropped: the head is now what the cotrainer published.
        """
        to_v = int(header.to_version)
        signed = self._sign(from_v=int(header.from_version), to_v=to_v, from_hash=bytes(header.from_hash),
                            to_hash=bytes(header.to_hash), payload=payload, snapshot=bool(header.snapshot),
                            codec=header.codec or ad.CODEC)
        self.encoder.reset()
        with self._lock:
            mine = self.header(to_v)
            if mine is not None and bytes(mine.to_hash) != bytes(header.to_hash):
                self._supersede(to_v, bytes(mine.to_hash))
                self._drop(f"d{to_v}")   # our own delta or cached snapshot of the replaced version
                self._drop(f"s{to_v}")   # must never be served (or rebuilt from) again
            self._put(f"{'s' if header.snapshot else 'd'}{to_v}", signed, payload)
            if not header.snapshot and to_v % self.snapshot_every == 0:
                self.put_snapshot(to_v, state_after)
            self.prune(to_v)

    def published(self, version: int, adapter_hash: bytes) -> bool:
        """Whether this trainer published `adapter_hash` as `version`: its stored header's, or one
        it published and then replaced by a cotrainer's (`adopt`: a split repaired). True when
        the version is no longer kept here (pruned: nothing to tell it by)."""
        header = self.header(version)
        if header is None:
            return True
        with self._lock:
            return bytes(header.to_hash) == adapter_hash or adapter_hash in self._superseded.get(version, set())

    def _supersede(self, version: int, adapter_hash: bytes) -> None:
        self._superseded.setdefault(version, set()).add(adapter_hash)
        for v in sorted(self._superseded)[:-SUPERSEDED_KEPT]:
            del self._superseded[v]
        doc = {str(v): sorted(h.hex() for h in hs) for v, hs in self._superseded.items()}
        write_atomic(self.root / "superseded.json", json.dumps(doc).encode())

    def _load_superseded(self) -> dict[int, set[bytes]]:
        path = self.root / "superseded.json"
        if not path.exists():
            return {}
        try:
            doc = json.loads(path.read_text())
            return {int(v): {bytes.fromhex(h) for h in hs} for v, hs in doc.items()}
        except (ValueError, TypeError, AttributeError) as exc:
            log.warning("job %s: %s unreadable (%s); starting without it", self.job_id[:12], path, exc)
            return {}

    def prune(self, head: int) -> None:
        """Delete what the retention rule does not keep at `head` (`retention.plan_prune`),
        after rebuilding a snapshot of the new floor when there is none."""
        with self._lock:
            deltas, snapshots = self._versions("d"), self._versions("s")
            plan = plan_prune(head, deltas, snapshots, self.retention)
            if plan.rebase_at is not None and self.snapshot(plan.rebase_at) is None:
                newer = [v for v in snapshots if v > plan.floor]   # the floor never existed here (a
                if not newer:                                     # snapshot adopted from a cotrainer)
                    log.warning("job %s: cannot rebuild version %d; keeping everything", self.job_id[:12], plan.floor)
                    return
                plan = plan_prune(head, deltas, snapshots, self.retention, floor=min(newer))
            for v in plan.drop_deltas:
                self._drop(f"d{v}")
            for v in plan.drop_snapshots:
                self._drop(f"s{v}")

    def oldest_kept(self) -> int:
        """The oldest version the store can still serve: its oldest snapshot (0 when none)."""
        return min(self._versions("s"), default=0)

    def delta_sizes(self, head: int) -> list[int]:
        """Payload bytes of the deltas to versions 1..head, pruned ones included (0 where one is
        unknown: never stored, or pruned before this process started)."""
        return [self._sizes.get(v, 0) for v in range(1, head + 1)]

    def header(self, version: int) -> pb.AdapterUpdate | None:
        """The signed update header body of `version` as published (its delta's, else a stored
        snapshot's), or None when neither is kept; reads the header file only."""
        for stem in (f"d{version}", f"s{version}"):
            path = self.root / f"{stem}.hdr"
            with self._lock:
                data = path.read_bytes() if path.exists() else None
            if data is not None:
                return pb.AdapterUpdate.FromString(pb.Signed.FromString(data).body)
        return None

    def delta(self, to_version: int) -> StoredUpdate | None:
        """The delta that produces `to_version`, if published."""
        return self._get(f"d{to_version}")

    def snapshot(self, version: int) -> StoredUpdate | None:
        """A signed snapshot of `version`, rebuilt from the nearest older snapshot if needed
        (`state_at`) and then cached."""
        with self._lock:
            stored = self._get(f"s{version}")
            if stored is not None:
                return stored
            state = self.state_at(version)
            if state is None:
                return None
            self.put_snapshot(version, state)
            return self._get(f"s{version}")

    def state_at(self, version: int) -> ad.State | None:
        """The adapter of `version`: its stored snapshot, or the nearest older one with the
        deltas after it applied (exactly as every replica applies them); None when the chain
        is not stored. Writes nothing."""
        with self._lock:
            base = max((v for v in self._versions("s") if v <= version), default=None)
            if base is None:
                return None
            snap = self._get(f"s{base}")
            assert snap is not None
            state = ad.decode_state(snap.payload)
            for v in range(base + 1, version + 1):
                d = self.delta(v)
                if d is None:
                    return None
                state = ad.apply_delta(state, dc.decode_delta(d.payload))
            return state

    def updates(self, req: pb.AdapterRequest, head: int) -> Iterator[StoredUpdate]:
        """What `FetchAdapter` serves: deltas have_version -> wanted version (absent = `head`),
        or one snapshot when asked, when the caller is ahead of the wanted version, or when the
        deltas from its version are no longer kept (a late joiner). Nothing for a version after
        the head (never published).

        Raises (on iteration):
            VersionNotKept: the wanted version is older than what the retention rule keeps.
        """
        yield from self._serve(req, head)

    def _serve(self, req: pb.AdapterRequest, head: int) -> list[StoredUpdate]:
        want = req.want_version if req.HasField("want_version") else head
        if want > head:
            return []
        with self._lock:
            if want < self.oldest_kept():
                raise VersionNotKept(self.job_id, want, self.oldest_kept())
            chain = None if req.snapshot or req.have_version > want else self._delta_chain(req.have_version, want)
            if chain is not None:
                return chain
            # asked for a snapshot, or the stored deltas don't chain (pruned, or a state adopted
            # from a cotrainer replaced a version): one snapshot, rebuilt and cached if needed
            cached = (self.root / f"s{want}.hdr").exists()
            snap = self.snapshot(want)
            if not cached and snap is not None:
                self.prune(head)   # a rebuilt snapshot counts against keep_snapshots
            return [snap] if snap is not None else []

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
