"""The other trainers of a job: who they are, whether one is ahead of us, and their signed updates.

Several trainers can serve one job (the same signed job submitted to each). They find each
other through their signed job records in the DHT (`swarm.dht`): a cotrainer is a trainer with a
verified record for the same job id, allowed by this trainer's `cotrainers` setting (None =
any), that has not failed to answer recently. Every trainer applies the same rules, so they
converge on one adapter:

- they average gradients before every step (`swarm.averaging`) and publish the same version;
- a trainer whose cotrainer is ahead adopts that cotrainer's state (it restarted, joined late,
  or missed a round);
- a split (the same version with different adapter hashes, after a round that completed for one
  side only) resolves towards the smaller trainer id: the other side adopts its state.

A trainer adopts a cotrainer's adapter only through that cotrainer's signed updates
(`fetch_chain`), re-signs them with its own key and serves them to its workers. Its calls to a
cotrainer name it (`swarmrl-peer` metadata) and are retried with backoff when refused as
overloaded or unreachable (`node.net.grpc_retry`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc

from swarmrl.node.net import tls
from swarmrl.node.net.grpc_guard import peer_metadata
from swarmrl.node.net.grpc_options import channel_options
from swarmrl.node.net.grpc_retry import Backoff, call_with_backoff, stream_with_backoff
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.protocol import adapter as ad
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc
from swarmrl.protocol.updates import ReceivedUpdate, assemble

log = logging.getLogger(__name__)
UNREACHABLE_S = 30.0
PROBE_TIMEOUT_S = 3.0
# a probe runs inside an averaging round: two tries, so a cotrainer that is only refusing for a
# moment is not marked unreachable, without holding the round for long
PROBE_BACKOFF = Backoff(attempts=2, base_s=0.25, max_s=0.5)


@dataclass(frozen=True)
class Cotrainer:
    """Another trainer of the job, as its latest verified record shows it."""

    trainer_id: str
    public_key: bytes
    endpoint: str
    head_version: int
    head_hash: bytes
    done: bool
    tls_cert_sha256: bytes = b""   # pinned certificate of its gRPC endpoint (empty: plaintext)


class Cotrainers:
    """The live cotrainers of one job, seen from one trainer (see the module docstring)."""

    def __init__(self, job_id: str, my_id: str, allowed: set[str] | None = None, *,
                 sync: dict[str, Any] | None = None, inner_steps: int | None = None) -> None:
        """sync: our job's sync settings (`JobSpec.sync_settings`; None: not checked);
        inner_steps: DiLoCo's H, where versions that are multiples of it are the common ones."""
        self.job_id, self.my_id, self.allowed = job_id, my_id, allowed
        self.sync, self.inner_steps = sync, inner_steps
        self._known: dict[str, Cotrainer] = {}
        self._unreachable: dict[str, float] = {}
        self.refused: dict[str, str] = {}   # trainer id -> why its record was refused (sync settings)

    def update(self, records: list[VerifiedRecord]) -> None:
        """Replace the view with the job's records found in the DHT now."""
        known = {}
        for r in records:
            rec = r.record
            if rec.job_id != self.job_id or r.trainer_id == self.my_id:
                continue
            if self.allowed is not None and r.trainer_id not in self.allowed:
                continue
            why = self._sync_mismatch(rec.spec_json)
            if why:
                if self.refused.get(r.trainer_id) != why:
                    log.warning("job %s: cotrainer %s refused: %s", self.job_id[:12], r.trainer_id[:12], why)
                self.refused[r.trainer_id] = why
                continue
            known[r.trainer_id] = Cotrainer(r.trainer_id, r.trainer_public_key, rec.endpoint, int(rec.head_version),
                                            bytes(rec.head_hash), rec.done, bytes(rec.tls_cert_sha256))
        self._known = known

    def _sync_mismatch(self, spec_json: str) -> str:
        """Why a cotrainer's job spec can't train with ours ("" when its sync settings agree)."""
        if self.sync is None:
            return ""
        try:
            theirs = json.loads(spec_json) if spec_json else {}
        except ValueError:
            return "its record's spec is not JSON"
        for key, mine in self.sync.items():
            got = theirs.get(key, "every_step" if key == "sync" else None)
            if got != mine:
                return f"different sync settings: {key} = {got!r}, ours {mine!r}"
        return ""

    def live(self) -> list[Cotrainer]:
        """The known cotrainers not marked unreachable right now, sorted by trainer id."""
        now = time.monotonic()
        return sorted((c for c in self._known.values() if self._unreachable.get(c.trainer_id, 0.0) <= now),
                      key=lambda c: c.trainer_id)

    def get(self, trainer_id: str) -> Cotrainer | None:
        """The cotrainer `trainer_id` as last seen in the DHT, or None if unknown (or not allowed)."""
        return self._known.get(trainer_id)

    def mark_unreachable(self, trainer_id: str, for_s: float = UNREACHABLE_S) -> None:
        """Leave `trainer_id` out of `live` for the next `for_s` seconds (it failed a call)."""
        self._unreachable[trainer_id] = time.monotonic() + for_s
        log.warning("job %s: cotrainer %s unreachable; going on without it for %.0fs", self.job_id[:12],
                    trainer_id[:12], for_s)

    def sync_target(self, version: int, head_hash: bytes) -> Cotrainer | None:
        """The cotrainer whose state to adopt now, if any: the furthest ahead, or at our version
        with a different adapter, the smallest id below ours. With DiLoCo only outer versions
        count (inner ones are each trainer's own, and what a trainer shares is its last outer
        version): one whose last outer version is past ours finished a round we missed (we
        restarted, or were slow past the round's timeout), whatever inner version it is at now;
        a split is one at our outer version with another adapter."""
        live = self.live()
        if self.inner_steps is not None:
            h = self.inner_steps
            ahead = [c for c in live if c.head_version - c.head_version % h > version - version % h]
            if ahead:
                return min(ahead, key=lambda c: (-(c.head_version - c.head_version % h), c.trainer_id))
            live = [c for c in live if c.head_version % h == 0]
        ahead = [c for c in live if c.head_version > version]
        if ahead:
            return min(ahead, key=lambda c: (-c.head_version, c.trainer_id))
        split = [c for c in live if c.head_version == version and c.head_hash != head_hash
                 and c.head_hash and c.trainer_id < self.my_id]
        return min(split, key=lambda c: c.trainer_id) if split else None

    def probe(self, job_id: str, max_message_mb: int = 64) -> None:
        """Ask every live cotrainer for its status (retried once if refused: `PROBE_BACKOFF`);
        mark the ones that don't answer unreachable."""
        meta = peer_metadata(self.my_id)
        for c in self.live():
            try:
                channel = tls.channel(c.endpoint, c.tls_cert_sha256, channel_options(max_message_mb))
            except tls.PinError:
                self.mark_unreachable(c.trainer_id)
                continue
            try:
                call_with_backoff(partial(pb_grpc.TrainerStub(channel).GetJobStatus, pb.JobStatusRequest(job_id=job_id),
                                          timeout=PROBE_TIMEOUT_S, metadata=meta), PROBE_BACKOFF)
            except grpc.RpcError:
                self.mark_unreachable(c.trainer_id)
            finally:
                channel.close()


def fetch_chain(c: Cotrainer, job_id: str, *, have_version: int, have_hash: bytes, want_version: int,
                max_gap: int = 8, max_message_mb: int = 64, timeout_s: float = 120.0,
                my_id: str = "") -> list[ReceivedUpdate]:
    """Signed updates from cotrainer `c` that take us from (have_version, have_hash) to
    `want_version`: its deltas when they chain from our hash (and are at most `max_gap`), else
    its snapshot of `want_version`. Asked as trainer `my_id` ("" = anonymous); each download's
    opening is retried with backoff if refused (`grpc_retry.stream_with_backoff`).

    Raises:
        grpc.RpcError, tls.PinError: the cotrainer could not be reached (or not over its pinned TLS).
        ad.AdapterError: what it served does not verify or does not reach `want_version`.
    """
    channel = tls.channel(c.endpoint, c.tls_cert_sha256, channel_options(max_message_mb))
    try:
        stub = pb_grpc.TrainerStub(channel)
        meta = peer_metadata(my_id) if my_id else ()

        def ask(snapshot: bool) -> list[ReceivedUpdate]:
            req = pb.AdapterRequest(job_id=job_id, have_version=have_version, want_version=want_version,
                                    snapshot=snapshot, requester="trainer")
            return list(assemble(stream_with_backoff(lambda: stub.FetchAdapter(req, timeout=timeout_s, metadata=meta)),
                                 c.trainer_id))

        updates = ask(False) if 0 < want_version - have_version <= max_gap else []
        if not _chains(updates, have_version, have_hash, want_version):
            updates = ask(True)
            if len(updates) != 1 or not updates[0].header.snapshot or updates[0].header.to_version != want_version:
                raise ad.AdapterError(f"cotrainer {c.trainer_id[:12]} did not serve version {want_version}")
        return updates
    finally:
        channel.close()


def _chains(updates: list[ReceivedUpdate], have_version: int, have_hash: bytes, want_version: int) -> bool:
    version, h = have_version, have_hash
    for u in updates:
        hd = u.header
        if hd.snapshot or hd.from_version != version or bytes(hd.from_hash) != h:
            return False
        version, h = int(hd.to_version), bytes(hd.to_hash)
    return version == want_version and bool(updates)
