"""Delta gossip: a peer serves the signed adapter updates it holds over hivemind's libp2p streams.

Every worker keeps the updates it applied (the last `keep_deltas` deltas and `keep_snapshots`
snapshots per job) in an `UpdateCache`, serves them under the libp2p protocol
`swarmrl.v1.FetchUpdate` (request `UpdateRequest`, answer a stream of `AdapterChunk`, exactly what
the trainer's gRPC `FetchAdapter` streams) and announces them in the DHT (`swarm.holders`). The
node reuses the DHT's libp2p daemon (`DHT.replicate_p2p`) from an asyncio loop in a background
thread. Bytes served and fetched are counted per job.

Snapshots are served under a bound so serving never starves the peer's own work: at most
`max_snapshot_streams` at once (`snapshot_sources.admits_stream`); a request past it gets an empty
answer at once (the asker tries its next holder) and is counted in `snapshot_refused[job]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import hivemind
from hivemind.p2p import P2PContext, PeerID
from hivemind.utils.multiaddr import Multiaddr

from swarmrl.node.swarm.dht import REFRESH_S
from swarmrl.node.swarm.holders import announce_holdings
from swarmrl.protocol import snapshot_sources
from swarmrl.protocol.blobs import blob_chunks
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.signing import signer_id
from swarmrl.protocol.updates import ReceivedUpdate, chunks

log = logging.getLogger(__name__)
PROTOCOL = "swarmrl.v1.FetchUpdate"
DATASET_PROTOCOL = "swarmrl.v1.FetchDataset"   # data-set files by sha256 (swarm.datasets)
MAX_UPDATE_BYTES = 1 << 30
DIAL_TIMEOUT_S = 10.0
T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running in a daemon thread; `run` executes a coroutine on it."""

    def __init__(self, name: str = "swarmrl-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for it (raises its exception or TimeoutError)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Stop the loop and join its thread (waits up to 5 s); pending coroutines are abandoned."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class UpdateCache:
    """The signed updates a peer holds, per job: the newest `keep_deltas` deltas and
    `keep_snapshots` snapshots (thread-safe), for the `keep_jobs` jobs it received an update of
    last (a finished job's final version is served until newer jobs push it out). A count of 0
    holds none of that kind (it never means "all": every count is a bound).

    Raises:
        ValueError: a negative count, or keep_jobs < 1.
    """

    def __init__(self, keep_deltas: int = 16, keep_snapshots: int = 2, keep_jobs: int = 8) -> None:
        if keep_deltas < 0 or keep_snapshots < 0:
            raise ValueError(f"keep_deltas and keep_snapshots must be >= 0, got {keep_deltas}, {keep_snapshots}")
        if keep_jobs < 1:
            raise ValueError(f"keep_jobs must be >= 1, got {keep_jobs}")
        self.keep = {False: keep_deltas, True: keep_snapshots}
        self.keep_jobs = keep_jobs
        self._items: OrderedDict[str, dict[bool, OrderedDict[int, ReceivedUpdate]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, update: ReceivedUpdate) -> None:
        """Hold `update` under its header's job, `to_version` and kind (delta or snapshot).

        Replaces an update held for the same key, then evicts the oldest versions of that kind beyond
        `keep_deltas` / `keep_snapshots`, and the jobs beyond `keep_jobs` that got no update for
        the longest. The update is stored as given (verify it first).
        """
        h = update.header
        with self._lock:
            kinds = self._items.setdefault(h.job_id, {False: OrderedDict(), True: OrderedDict()})
            self._items.move_to_end(h.job_id)
            while len(self._items) > self.keep_jobs:
                self._items.popitem(last=False)
            held = kinds[bool(h.snapshot)]
            held[int(h.to_version)] = update
            for v in sorted(held)[:max(0, len(held) - self.keep[bool(h.snapshot)])]:
                del held[v]

    def get(self, job_id: str, version: int, snapshot: bool) -> ReceivedUpdate | None:
        """The held delta (or snapshot, with `snapshot`) ending at `version` for the job, or None."""
        with self._lock:
            held = self._items.get(job_id, {}).get(snapshot)
            return held.get(version) if held is not None else None

    def held(self, job_id: str) -> list[pb.HeldUpdate]:
        """What this peer holds for the job, as the HeldUpdate entries its DHT record and listings carry."""
        with self._lock:
            kinds = self._items.get(job_id, {})
            return [pb.HeldUpdate(version=v, snapshot=snap, payload_sha256=u.header.payload_sha256,
                                  payload_size=len(u.payload), signer=signer_id(u.envelope))
                    for snap, held in kinds.items() for v, u in held.items()]

    def jobs(self) -> list[str]:
        """Ids of the jobs with at least one held update."""
        with self._lock:
            return list(self._items)


class GossipNode:
    """Serves a peer's `UpdateCache` over libp2p, fetches updates from other peers and announces
    its holdings in the DHT. `served[job]` counts payload bytes sent to other peers, of which
    `snapshot_served[job]` snapshots; `snapshot_refused[job]` the snapshot requests it refused at its
    stream bound ("busy").

    dialable: False for a peer that accepts no inbound connections (DHT client mode, behind NAT):
    it still fetches from peers but never announces holdings (nobody could fetch them).
    max_snapshot_streams: snapshot streams served at once (0: none; see the module docstring)."""

    def __init__(self, dht: hivemind.DHT, identity: Identity, cache: UpdateCache | None = None, *,
                 dialable: bool = True, max_snapshot_streams: int = snapshot_sources.MAX_STREAMS) -> None:
        snapshot_sources.admits_stream(0, max_snapshot_streams)   # raises ValueError when negative
        self.dht, self.identity, self.dialable = dht, identity, dialable
        self.cache = cache or UpdateCache()
        self.served: Counter[str] = Counter()
        self.snapshot_served: Counter[str] = Counter()
        self.snapshot_refused: Counter[str] = Counter()
        self.max_snapshot_streams = max_snapshot_streams
        self._snapshot_streams = 0   # snapshot streams being served (read and written on the loop only)
        self._loop = LoopThread("swarmrl-gossip")
        self.p2p: hivemind.P2P = self._loop.run(self._start(), timeout=60)
        self.libp2p_peer_id: bytes = self.p2p.peer_id.to_bytes()
        self.maddrs: list[str] = [str(m) for m in dht.get_visible_maddrs()] if dialable else []
        self._announced: dict[str, float] = {}
        self._lock = threading.Lock()
        self.datasets: dict[str, bytes] = {}   # sha256 hex -> verified file bytes this peer serves

    async def _start(self) -> hivemind.P2P:
        p2p = await self.dht.replicate_p2p()
        await p2p.add_protobuf_handler(PROTOCOL, self._serve, pb.UpdateRequest, stream_output=True)
        await p2p.add_protobuf_handler(DATASET_PROTOCOL, self._serve_dataset, pb.UpdateRequest, stream_output=True)
        return p2p

    async def _serve_dataset(self, req: pb.UpdateRequest, context: P2PContext) -> AsyncIterator[pb.AdapterChunk]:
        data = self.datasets.get(bytes(req.payload_sha256).hex())
        if data is None:
            return
        with self._lock:
            self.served["dataset:" + bytes(req.payload_sha256).hex()] += len(data)
        for chunk in blob_chunks(data):
            yield chunk

    def hold_dataset(self, sha256_hex: str, data: bytes) -> None:
        """Serve a verified data-set file and announce it (key: the holders record of "dataset:<sha>")."""
        self.datasets[sha256_hex] = data
        self._announce_dataset(sha256_hex)

    def _announce_dataset(self, sha256_hex: str) -> None:
        if not self.dialable:
            return
        held = [pb.HeldUpdate(version=0, payload_sha256=bytes.fromhex(sha256_hex),
                              payload_size=len(self.datasets[sha256_hex]))]
        try:
            announce_holdings(self.dht, self.identity, "dataset:" + sha256_hex, self.libp2p_peer_id, held,
                              int(time.time() * 1000), self.maddrs)
            self._announced["dataset:" + sha256_hex] = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - the DHT can fail; the next refresh retries
            log.warning("announcing data set %s failed: %r", sha256_hex[:12], exc)

    def fetch_dataset(self, libp2p_peer_id: bytes, sha256_hex: str, timeout_s: float = 60.0) -> list[pb.AdapterChunk]:
        """The chunks a peer streams for data set `sha256_hex` (empty when it doesn't hold it)."""
        req = pb.UpdateRequest(job_id="dataset:" + sha256_hex, payload_sha256=bytes.fromhex(sha256_hex))
        coro = self._fetch(libp2p_peer_id, req, DATASET_PROTOCOL)
        return self._loop.run(asyncio.wait_for(coro, timeout_s), timeout=timeout_s + 5)

    async def _serve(self, req: pb.UpdateRequest, context: P2PContext) -> AsyncIterator[pb.AdapterChunk]:
        update = self.cache.get(req.job_id, int(req.version), bool(req.snapshot))
        if update is None or (req.payload_sha256 and req.payload_sha256 != update.header.payload_sha256):
            return
        if not req.snapshot:
            with self._lock:
                self.served[req.job_id] += len(update.payload)
            for chunk in chunks(update.envelope, update.payload):
                yield chunk
            return
        if not snapshot_sources.admits_stream(self._snapshot_streams, self.max_snapshot_streams):
            with self._lock:
                self.snapshot_refused[req.job_id] += 1
            return
        self._snapshot_streams += 1
        try:
            with self._lock:
                self.served[req.job_id] += len(update.payload)
                self.snapshot_served[req.job_id] += len(update.payload)
            for chunk in chunks(update.envelope, update.payload):
                yield chunk
        finally:
            self._snapshot_streams -= 1

    def fetch(self, libp2p_peer_id: bytes, req: pb.UpdateRequest, timeout_s: float = 30.0,
              maddrs: tuple[str, ...] = ()) -> list[pb.AdapterChunk]:
        """The chunks a peer streams for `req` (empty when it doesn't hold it); `maddrs` are the
        addresses its signed holder record gives (dialled first when given).

        Raises:
            TimeoutError, hivemind P2P errors, ValueError (more than MAX_UPDATE_BYTES).
        """
        coro = self._fetch(libp2p_peer_id, req, maddrs=maddrs)
        return self._loop.run(asyncio.wait_for(coro, timeout_s), timeout=timeout_s + 5)

    async def _fetch(self, libp2p_peer_id: bytes, req: pb.UpdateRequest, protocol: str = PROTOCOL,
                     maddrs: tuple[str, ...] = ()) -> list[pb.AdapterChunk]:
        if maddrs:
            await self._dial(PeerID(libp2p_peer_id), maddrs)
        stream = await self.p2p.iterate_protobuf_handler(PeerID(libp2p_peer_id), protocol, req, pb.AdapterChunk)
        out, size = [], 0
        async for chunk in stream:
            size += len(chunk.data)
            if size > MAX_UPDATE_BYTES:
                raise ValueError(f"peer streamed more than {MAX_UPDATE_BYTES} bytes")
            out.append(chunk)
        return out

    async def _dial(self, peer: PeerID, maddrs: tuple[str, ...]) -> None:
        """Connect to `peer` at the addresses its signed record gives (the libp2p daemon's own
        peer routing may not know them yet); a failure is left to the stream that follows."""
        addrs = [Multiaddr(m) for m in maddrs]
        try:   # hivemind.P2P has no public connect; its daemon client does
            await asyncio.wait_for(self.p2p._client.connect(peer, addrs), DIAL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the stream's own error says more
            log.debug("dialling %s at %s failed: %r", peer, maddrs, exc)

    def hold(self, update: ReceivedUpdate) -> None:
        """Keep a verified update to serve it."""
        self.cache.put(update)

    def announce(self, job_id: str, *, force: bool = True) -> None:
        """Announce this peer's holdings of `job_id` (when `force`, or when the last is stale);
        nothing when this peer is not dialable."""
        if not self.dialable:
            return
        last = self._announced.get(job_id, 0.0)
        if not force and time.monotonic() - last < REFRESH_S:
            return
        held = self.cache.held(job_id)
        if not held:
            return
        try:
            announce_holdings(self.dht, self.identity, job_id, self.libp2p_peer_id, held, int(time.time() * 1000),
                              self.maddrs)
            self._announced[job_id] = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - the DHT can fail; the next refresh retries
            log.warning("announcing holdings of job %s failed: %r", job_id, exc)

    def refresh(self) -> None:
        """Re-announce every job's holdings whose record is due (call periodically)."""
        for job_id in self.cache.jobs():
            self.announce(job_id, force=False)
        for sha in list(self.datasets):
            if time.monotonic() - self._announced.get("dataset:" + sha, 0.0) >= REFRESH_S:
                self._announce_dataset(sha)

    def served_bytes(self, job_id: str) -> int:
        """Payload bytes of the job's updates this node has sent to other peers."""
        with self._lock:
            return self.served[job_id]

    def snapshot_served_bytes(self, job_id: str) -> int:
        """Payload bytes of the job's snapshots this node has sent to other peers."""
        with self._lock:
            return self.snapshot_served[job_id]

    def shutdown(self) -> None:
        """Drop the protocol handler, stop the libp2p daemon and the loop (best effort; never raises)."""
        with contextlib.suppress(Exception):
            self._loop.run(self._stop(), timeout=10)
        self._loop.stop()

    async def _stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.p2p.remove_protobuf_handler(PROTOCOL, stream_output=True)
            await self.p2p.remove_protobuf_handler(DATASET_PROTOCOL, stream_output=True)
        await self.p2p.shutdown()
