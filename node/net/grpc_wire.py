"""The trainer's calls over gRPC: a channel to the endpoint a job's signed record names.

`GrpcWire` is a `trainer_client.TrainerWire`: TLS pinned to the record's certificate
fingerprint (plaintext when it has none, `tls.channel`), send and receive limits of
`max_message_mb` (`grpc_options.channel_options`), every call naming the caller in its
`swarmrl-peer` metadata (the trainer bounds streams per peer, `grpc_guard`), and each call's
deadline. `connect` wraps it in the `TrainerClient` the worker and the validator use.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from swarmrl.node.net import tls
from swarmrl.node.net.grpc_guard import peer_metadata
from swarmrl.node.net.grpc_options import channel_options
from swarmrl.node.net.trainer_client import TrainerClient
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc


class GrpcWire:
    """One channel to a trainer and its stub (see the module docstring).

    Raises (on construction) tls.PinError: the record pins a certificate that the endpoint did
    not present, or the endpoint could not be reached to read it.
    """

    def __init__(self, endpoint: str, tls_cert_sha256: bytes, *, max_message_mb: int, peer_id: str = "") -> None:
        self.endpoint = endpoint
        self.channel = tls.channel(endpoint, tls_cert_sha256, channel_options(max_message_mb))
        self.stub = pb_grpc.TrainerStub(self.channel)
        self.metadata = peer_metadata(peer_id) if peer_id else ()   # "" = anonymous

    def request_lease(self, signed: pb.Signed, timeout_s: float) -> pb.LeaseReply:
        """RequestLease."""
        reply: pb.LeaseReply = self.stub.RequestLease(signed, timeout=timeout_s, metadata=self.metadata)
        return reply

    def submit_rollouts(self, envelopes: Iterator[pb.Signed], timeout_s: float) -> pb.Receipt:
        """SubmitRollouts."""
        receipt: pb.Receipt = self.stub.SubmitRollouts(envelopes, timeout=timeout_s, metadata=self.metadata)
        return receipt

    def fetch_adapter(self, request: pb.AdapterRequest, timeout_s: float) -> Iterable[pb.AdapterChunk]:
        """FetchAdapter (the call is itself the stream: cancel it to end it early)."""
        chunks: Iterable[pb.AdapterChunk] = self.stub.FetchAdapter(request, timeout=timeout_s, metadata=self.metadata)
        return chunks

    def fetch_dataset(self, request: pb.UpdateRequest, timeout_s: float) -> Iterable[pb.AdapterChunk]:
        """FetchDataset."""
        chunks: Iterable[pb.AdapterChunk] = self.stub.FetchDataset(request, timeout=timeout_s, metadata=self.metadata)
        return chunks

    def sample_admitted(self, request: pb.SampleRequest, timeout_s: float) -> Iterable[pb.AdmittedBatch]:
        """SampleAdmitted."""
        batches: Iterable[pb.AdmittedBatch] = self.stub.SampleAdmitted(request, timeout=timeout_s,
                                                                       metadata=self.metadata)
        return batches

    def job_status(self, request: pb.JobStatusRequest, timeout_s: float) -> pb.JobStatus:
        """GetJobStatus."""
        status: pb.JobStatus = self.stub.GetJobStatus(request, timeout=timeout_s, metadata=self.metadata)
        return status

    def report_verdicts(self, envelope: pb.Signed, timeout_s: float) -> pb.VerdictAck:
        """ReportVerdicts."""
        ack: pb.VerdictAck = self.stub.ReportVerdicts(envelope, timeout=timeout_s, metadata=self.metadata)
        return ack

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()


def connect(record: pb.JobRecord, *, max_message_mb: int, peer_id: str = "") -> TrainerClient:
    """A client of the trainer that signed `record`, over gRPC to its endpoint (TLS pinned to its
    `tls_cert_sha256` when set), naming `peer_id` in every call ("" = anonymous).

    Raises:
        tls.PinError: the pinned certificate could not be confirmed.
    """
    return TrainerClient(GrpcWire(record.endpoint, bytes(record.tls_cert_sha256), max_message_mb=max_message_mb,
                                  peer_id=peer_id))


def same_trainer_endpoint(a: pb.JobRecord, b: pb.JobRecord) -> bool:
    """Whether two records of a job name the same endpoint and certificate (one connection serves both)."""
    return (a.endpoint, bytes(a.tls_cert_sha256)) == (b.endpoint, bytes(b.tls_cert_sha256))
