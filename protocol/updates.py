"""Signed adapter updates on the wire: chunking, reassembly and verification, and applying them to a replica.

Pure (no network): every role that moves or applies updates (worker, trainer, validator, the
swarm layer, the submitter) shares this file.

An update is accepted only when its header verifies under the trainer's public key (from the
job's signed DHT record) or the key of one of the job's other trainers that record lists (they
average gradients, so their updates are bit-identical), its payload matches the header's sha256, a delta's `from_hash` is the
hash the worker holds, and the result hashes to `to_hash`. Past `max_gap` versions behind, the
worker asks for a full snapshot instead of the delta chain.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field

from swarmrl.protocol import adapter as ad
from swarmrl.protocol import delta_codec as dc
from swarmrl.protocol import signing
from swarmrl.protocol.identity import peer_id_from_public_key
from swarmrl.protocol.pb import swarm_pb2 as pb

log = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20


NOT_KEPT = "not kept"


class VersionNotKept(LookupError):
    """The trainer published this adapter version but no longer keeps it (older than its
    retention floor, `node/trainer/retention.py`). On the wire: FetchAdapter ends with gRPC status
    OUT_OF_RANGE and this message as its details."""

    def __init__(self, job_id: str, version: int, floor: int | None = None) -> None:
        kept = f"the trainer keeps versions {floor} and newer" if floor is not None else "pruned by the trainer"
        super().__init__(f"job {job_id[:12]}: adapter version {version} is {NOT_KEPT} ({kept})")
        self.version, self.floor = version, floor


@dataclass
class ReceivedUpdate:
    """A verified header with its payload (signature and content hash checked).

    rebuilt: a peer-made snapshot (`open_snapshot`, `rebuilt_snapshot`): `envelope` is the
    trainer-signed header of the version (a delta's, whose `to_hash` is the version's adapter
    hash), `payload` the peer's encoding of the state, and `header` that signed header read as a
    snapshot of it (`snapshot` set, `payload_sha256`/`payload_size` of this payload; never signed
    or re-served as such: peers serve `envelope`)."""

    header: pb.AdapterUpdate
    envelope: pb.Signed
    payload: bytes
    rebuilt: bool = False


class SnapshotRefused(ad.AdapterError):
    """A snapshot from a peer that does not verify; `reason` is one of
    `snapshot_sources.REFUSALS` (the label it is counted under)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def _as_snapshot(header: pb.AdapterUpdate, payload: bytes) -> pb.AdapterUpdate:
    view = pb.AdapterUpdate()
    view.CopyFrom(header)
    view.snapshot, view.from_version, view.from_hash = True, 0, b""
    view.payload_sha256, view.payload_size, view.codec = ad.payload_sha256(payload), len(payload), ad.CODEC
    return view


def rebuilt_snapshot(update: ReceivedUpdate, state: ad.State) -> ReceivedUpdate:
    """A snapshot of the version `update` produced, made from the replica's `state` after applying
    it, to serve to peers: the trainer-signed envelope of `update` with `state` encoded
    (`adapter.encode_state`). `update` itself when it is a snapshot already.

    Raises:
        ad.AdapterError: `state` does not hash to the update's signed `to_hash`."""
    if update.header.snapshot:
        return update
    if ad.adapter_hash(state) != update.header.to_hash:
        raise ad.AdapterError(f"version {update.header.to_version}: the state does not hash to the signed to_hash")
    payload = ad.encode_state(state)
    return ReceivedUpdate(_as_snapshot(update.header, payload), update.envelope, payload, rebuilt=True)


def open_snapshot(got: Iterable[pb.AdapterChunk], signers: Collection[str], *, job_id: str, version: int,
                  payload_sha256: bytes, max_bytes: int = ad.MAX_STATE_BYTES) -> ReceivedUpdate:
    """Verify a snapshot a peer streamed for (`job_id`, `version`) under content address
    `payload_sha256` (its holder record's), exactly as a trainer's: the header is signed by one of
    `signers` and is of that job and version; the payload is the bytes asked for; the state it
    decodes to hashes to the header's signed `to_hash`. The header may be the trainer's snapshot
    header (a received snapshot re-served) or the signed header of any update ending at
    `version` (a peer's rebuilt snapshot: `rebuilt` set).

    Raises:
        SnapshotRefused: with the reason (`snapshot_sources.REFUSALS`) it failed on."""
    chunk_list = list(got)
    if not chunk_list or not chunk_list[0].HasField("header") or any(c.HasField("header") for c in chunk_list[1:]):
        raise SnapshotRefused("undecodable", "expected one header on the first chunk")
    envelope = chunk_list[0].header
    try:
        header, signer = signing.open_signed(envelope, signing.ADAPTER_UPDATE, pb.AdapterUpdate)
    except signing.SignatureError as exc:
        raise SnapshotRefused("signature", str(exc)) from exc
    if signer not in signers:
        raise SnapshotRefused("untrusted", f"signed by {signer[:12]}, not a trainer we accept")
    if header.job_id != job_id or int(header.to_version) != version:
        raise SnapshotRefused("version", f"asked for v{version} of {job_id[:12]}, got v{header.to_version} "
                                         f"of {header.job_id[:12]}")
    payload = b"".join(c.data for c in chunk_list)
    sha = ad.payload_sha256(payload)
    if sha != payload_sha256 or (header.snapshot and sha != header.payload_sha256):
        raise SnapshotRefused("payload_sha256", f"payload of v{version} is not the content asked for")
    try:
        state = ad.decode_state(payload, max_bytes=max_bytes)
    except ad.AdapterError as exc:
        raise SnapshotRefused("undecodable", str(exc)) from exc
    if ad.adapter_hash(state) != header.to_hash:
        raise SnapshotRefused("adapter_hash", f"v{version}: the state does not hash to the trainer-signed to_hash")
    if header.snapshot:
        return ReceivedUpdate(header, envelope, payload)
    return ReceivedUpdate(_as_snapshot(header, payload), envelope, payload, rebuilt=True)


def chunks(header: pb.Signed, payload: bytes) -> Iterator[pb.AdapterChunk]:
    """Split one signed update into stream chunks (header on the first, `last` on the final)."""
    n = max(1, -(-len(payload) // CHUNK_BYTES))
    for i in range(n):
        part = payload[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES]
        yield pb.AdapterChunk(header=header if i == 0 else None, data=part, last=i == n - 1)


def headers(chunks: Iterable[pb.AdapterChunk], trainer_id: str | Collection[str]) -> Iterator[pb.AdapterUpdate]:
    """The verified headers of a chunk stream signed by `trainer_id` (or any of a collection),
    payloads ignored: the answer to `AdapterRequest.header_only` (each header a chunk of its own,
    `last` set), or a full stream from a trainer that sends the payloads anyway. A header proves
    what the trainer published (its `to_hash`, `payload_sha256`) without the payload's bytes.

    Raises:
        ad.AdapterError: a header that doesn't verify or isn't the trainer's.
    """
    signers = {trainer_id} if isinstance(trainer_id, str) else set(trainer_id)
    for chunk in chunks:
        if not chunk.HasField("header"):
            continue
        try:
            header, signer = signing.open_signed(chunk.header, signing.ADAPTER_UPDATE, pb.AdapterUpdate)
        except signing.SignatureError as exc:
            raise ad.AdapterError(f"adapter update header: {exc}") from exc
        if signer not in signers:
            raise ad.AdapterError(f"adapter update signed by {signer}, not by the job's trainer(s) {sorted(signers)}")
        yield header


def assemble(chunks: Iterable[pb.AdapterChunk], trainer_id: str | Collection[str]) -> Iterator[ReceivedUpdate]:
    """Reassemble a chunk stream into verified updates signed by `trainer_id` (or any of a
    collection of trainer ids).

    Raises:
        ad.AdapterError: a header that doesn't verify or isn't the trainer's, a payload whose
            sha256 or size differs from its header, or a stream that ends mid-update.
    """
    signers = {trainer_id} if isinstance(trainer_id, str) else set(trainer_id)
    header: pb.AdapterUpdate | None = None
    envelope: pb.Signed | None = None
    parts: list[bytes] = []
    for chunk in chunks:
        if chunk.HasField("header"):
            if header is not None:
                raise ad.AdapterError("new update started before the previous one ended")
            envelope = chunk.header
            try:
                header, signer = signing.open_signed(envelope, signing.ADAPTER_UPDATE, pb.AdapterUpdate)
            except signing.SignatureError as exc:
                raise ad.AdapterError(f"adapter update header: {exc}") from exc
            if signer not in signers:
                raise ad.AdapterError(f"adapter update signed by {signer}, not by the job's trainer(s) {sorted(signers)}")
            parts = []
        if header is None:
            raise ad.AdapterError("payload chunk without a header")
        parts.append(chunk.data)
        if sum(map(len, parts)) > header.payload_size:
            raise ad.AdapterError("payload larger than its header says")
        if chunk.last:
            payload = b"".join(parts)
            if ad.payload_sha256(payload) != header.payload_sha256:
                raise ad.AdapterError(f"payload of version {header.to_version} does not match its sha256")
            assert envelope is not None
            yield ReceivedUpdate(header, envelope, payload)
            header, envelope = None, None
    if header is not None:
        raise ad.AdapterError("stream ended in the middle of an update")


@dataclass
class AdapterReplica:
    """A worker's copy of one job's adapter: state, version and hash."""

    job_id: str
    trainer_public_key: bytes
    state: ad.State | None = None
    version: int = -1
    hash: bytes = b""
    applied: list[int] = field(default_factory=list)

    @property
    def trainer_id(self) -> str:
        """Peer id of the trainer whose signature the replica's updates must carry."""
        return peer_id_from_public_key(self.trainer_public_key)

    def apply(self, update: ReceivedUpdate) -> None:
        """Apply one verified update (snapshot or the next delta).

        Raises:
            ad.AdapterError: the delta doesn't start from our version/hash, or the result's hash
                differs from the signed `to_hash`; dc.DeltaFormatError: a malformed delta payload.
        """
        h = update.header
        if h.snapshot:
            state = ad.decode_state(update.payload)
        else:
            if self.state is None or h.from_version != self.version or h.from_hash != self.hash:
                raise ad.AdapterError(f"delta {h.from_version}->{h.to_version} does not apply to version {self.version}")
            state = ad.apply_delta(self.state, dc.decode_delta(update.payload))
        got = ad.adapter_hash(state)
        if got != h.to_hash:
            raise ad.AdapterError(f"version {h.to_version}: reconstructed hash {got.hex()[:12]} != {h.to_hash.hex()[:12]}")
        self.state, self.version, self.hash = state, int(h.to_version), got
        self.applied.append(self.version)
