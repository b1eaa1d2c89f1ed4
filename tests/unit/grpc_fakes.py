"""An in-memory trainer behind the real gRPC service, for the server's load and limit tests and
benchmarks/lease_latency.py (which runs it against older code too, so it imports only what
every version has): downloads are as large as asked (so a reader that stops reading blocks
its stream), leases are granted at once, submissions are admitted at once."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from swarmrl.node.net.grpc_options import channel_options
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc

JOB = "job-fake"


@dataclass
class _Update:
    header: pb.Signed
    payload: bytes


@dataclass
class FakeAdmission:
    """Grants every lease, counts refusals."""

    refused: Counter[str] = field(default_factory=Counter)
    gate: threading.RLock = field(default_factory=threading.RLock)

    def request_lease(self, peer: str, req: pb.LeaseRequest) -> pb.LeaseReply:
        return pb.LeaseReply(lease=pb.Lease(lease_id=f"L{time.monotonic_ns()}", job_id=req.job_id, peer_id=peer))

    def count_refusal(self, reason: str) -> None:
        with self.gate:
            self.refused[reason] += 1


class FakeJob:
    """A job whose adapter download is `download_bytes` long."""

    def __init__(self, download_bytes: int) -> None:
        self.admission = FakeAdmission()
        self.payload = b"\0" * download_bytes

    def updates(self, req: pb.AdapterRequest) -> Iterator[_Update]:
        yield _Update(pb.Signed(), self.payload)

    def count_upload(self, requester: str, n: int) -> None:
        pass


class FakeTrainer:
    """What TrainerService calls, in memory."""

    def __init__(self, download_bytes: int = 64 << 20) -> None:
        self.jobs = {JOB: FakeJob(download_bytes)}
        self.admitted = 0

    def count_upload(self, n: int) -> None:
        pass

    def admit(self, envelope: pb.Signed, on_verified=None) -> pb.BatchReceipt:
        _, signer = signing.open_signed(envelope, signing.ROLLOUT_BATCH, pb.RolloutBatch)
        if on_verified is not None:
            on_verified(signer)
        self.admitted += 1
        return pb.BatchReceipt(batch_id=signing.envelope_id(envelope), accepted=True)


def stub(endpoint: str) -> tuple[grpc.Channel, pb_grpc.TrainerStub]:
    """A channel with the product's options, and its Trainer stub."""
    channel = grpc.insecure_channel(endpoint, options=channel_options(64))
    return channel, pb_grpc.TrainerStub(channel)


def lease_request(who: Identity) -> pb.Signed:
    """A signed lease request for the fake job."""
    return signing.sign(who, signing.LEASE_REQUEST, pb.LeaseRequest(job_id=JOB, max_prompts=1))


def rollout_batch(who: Identity) -> pb.Signed:
    """A signed (empty) rollout batch for the fake job."""
    return signing.sign(who, signing.ROLLOUT_BATCH, pb.RolloutBatch(job_id=JOB, lease_id="L", peer_id=who.peer_id))


class SlowDownloader:
    """Opens an adapter download, reads its first chunk, then stops reading (holds the stream)."""

    def __init__(self, endpoint: str, name: str) -> None:
        self.channel, s = stub(endpoint)
        self.call = s.FetchAdapter(pb.AdapterRequest(job_id=JOB, requester="worker"), metadata=(("swarmrl-peer", name),))
        self.first = threading.Event()
        self.error: grpc.RpcError | None = None
        threading.Thread(target=self._read_one, daemon=True).start()

    def _read_one(self) -> None:
        try:
            next(self.call)
            self.first.set()
        except grpc.RpcError as exc:
            self.error = exc
            self.first.set()

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()
