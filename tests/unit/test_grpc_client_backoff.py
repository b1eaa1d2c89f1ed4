"""Every client of a trainer backs off when refused, and names itself where it has an identity
(issue 11): a real gRPC server on 127.0.0.1 refuses the first calls of each method with
RESOURCE_EXHAUSTED and a `retry-after-ms` hint (as `node.net.grpc_guard` does), then answers from a
real adapter store. The validator, a cotrainer, the submitter (`swarmrl submit/status/fetch`) and
the dashboard each retry and succeed, or give up after their attempts with a clear error; the
server sees the caller's `swarmrl-peer` header."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from swarmrl.node.cli.main import main as cli_main
from swarmrl.node.net.grpc_options import channel_options
from swarmrl.node.net.grpc_retry import Backoff, GaveUp
from swarmrl.node.net.grpc_wire import connect
from swarmrl.node.ops.dashboard import grpc_fetch
from swarmrl.node.submitter.client import fetch_snapshot, job_status, sign_job, submit_signed
from swarmrl.node.swarm.cotrainers import Cotrainer, Cotrainers, fetch_chain
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.node.trainer.adapter_store import AdapterStore
from swarmrl.protocol import adapter as ad
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec, job_id_from_body
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc
from swarmrl.protocol.updates import chunks
from swarmrl.validator.adapters import SnapshotCache
from swarmrl.validator.service import JobWatch, sign_report

HINT_MS = 40
HEAD = 3
SPEC = JobSpec.model_validate({"base_model": "tiny", "base_model_sha256": "0" * 64})
TRAINER = Identity.from_seed(b"t" * 32)


class Refuser(grpc.ServerInterceptor):
    """Refuses the first `refusals` calls of every method with RESOURCE_EXHAUSTED and a retry hint
    (in trailing metadata, as `grpc_guard.StreamGuard` does), then lets them through; records the
    `swarmrl-peer` header of every call, by method name."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.peers: dict[str, list[str]] = defaultdict(list)

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        method = details.method.rsplit("/", 1)[-1]
        peer = dict(details.invocation_metadata or ()).get("swarmrl-peer", "")
        with self.lock:
            self.calls[method] += 1
            self.peers[method].append(peer)
            refuse = self.calls[method] <= self.refusals
        if handler is None or not refuse:
            return handler

        def refused(request: Any, context: grpc.ServicerContext) -> Any:
            context.set_trailing_metadata((("retry-after-ms", str(HINT_MS)),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many streams (per_peer); retry later")
        make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
        return make[handler.request_streaming, handler.response_streaming](
            refused, handler.request_deserializer, handler.response_serializer)


class CannedTrainer(pb_grpc.TrainerServicer):
    """Answers every call a non-worker client makes: jobs accepted, a fixed status, two admitted
    batches, verdicts acknowledged, adapters from a real signed store."""

    def __init__(self, store: AdapterStore) -> None:
        self.store = store

    def SubmitJob(self, request: pb.Signed, context: Any) -> pb.JobAck:
        return pb.JobAck(job_id=job_id_from_body(request.body), accepted=True)

    def GetJobStatus(self, request: pb.JobStatusRequest, context: Any) -> pb.JobStatus:
        return pb.JobStatus(job_id=request.job_id, state="running", policy_version=HEAD, trainer_id=TRAINER.peer_id,
                            spec_json=SPEC.canonical_json())

    def SampleAdmitted(self, request: pb.SampleRequest, context: Any) -> Iterator[pb.AdmittedBatch]:
        yield from (pb.AdmittedBatch(seq=request.after_seq + i) for i in (1, 2))

    def ReportVerdicts(self, request: pb.Signed, context: Any) -> pb.VerdictAck:
        return pb.VerdictAck(accepted=1)

    def FetchAdapter(self, request: pb.AdapterRequest, context: Any) -> Iterator[pb.AdapterChunk]:
        for update in self.store.updates(request, HEAD):
            yield from chunks(update.header, update.payload)


class Served:
    """The refusing server with its interceptor, and the job its store holds."""

    def __init__(self, tmp_path: Path, refusals: int) -> None:
        self.job_id = "job-backoff"
        self.store = AdapterStore(tmp_path / "adapters", self.job_id, TRAINER)
        gen = torch.Generator().manual_seed(0)
        state = {"a.lora_A.weight": 0.1 * torch.randn(4, 16, generator=gen), "a.lora_B.weight": torch.zeros(16, 4)}
        self.store.put_snapshot(0, state)
        self.states = [ad.clone_state(state)]
        for v in range(1, HEAD + 1):
            new, _ = self.store.publish(v, self.states[-1], {k: t + 1e-3 * v for k, t in state.items()})
            self.states.append(new)
        self.refuser = Refuser(refusals)
        self.server = grpc.server(futures.ThreadPoolExecutor(8), interceptors=[self.refuser],
                                  options=channel_options(64))
        pb_grpc.add_TrainerServicer_to_server(CannedTrainer(self.store), self.server)
        self.endpoint = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def record(self) -> VerifiedRecord:
        rec = pb.JobRecord(job_id=self.job_id, endpoint=self.endpoint, spec_json=SPEC.canonical_json(),
                           base_model="tiny", base_model_sha256=bytes(32), trainer_id=TRAINER.peer_id)
        return VerifiedRecord(rec, TRAINER.peer_id, TRAINER.public_key)

    def cotrainer(self) -> Cotrainer:
        return Cotrainer(TRAINER.peer_id, TRAINER.public_key, self.endpoint, HEAD, b"", False)


@pytest.fixture()
def serve(tmp_path: Path) -> Iterator[Callable[[int], Served]]:
    started: list[Served] = []

    def start(refusals: int) -> Served:
        started.append(Served(tmp_path / str(len(started)), refusals))
        return started[-1]
    yield start
    for s in started:
        s.server.stop(None)


REFUSED = Backoff().attempts - 1   # refusals a client with the default backoff still gets through


def test_validator_names_itself_and_retries_every_call(serve: Callable[[int], Served]) -> None:
    s = serve(REFUSED)
    me = Identity.from_seed(b"v" * 32)
    rec = s.record()
    watch = JobWatch.open(rec, connect(rec.record, max_message_mb=64, peer_id=me.peer_id), cache=SnapshotCache())
    try:
        assert [b.seq for b in watch.sample(5)] == [6, 7]                 # a stream: its opening retried
        assert watch.head_version() == HEAD                                # unary
        assert watch.report(sign_report(me, s.job_id, [], 0)).accepted == 1
        state, _ = watch.adapters.state(HEAD)                              # an adapter download
        assert all(torch.equal(state[k], s.states[HEAD][k]) for k in state)
    finally:
        watch.close()
    methods = {"SampleAdmitted", "GetJobStatus", "ReportVerdicts", "FetchAdapter"}
    assert {m: s.refuser.calls[m] for m in methods} == dict.fromkeys(methods, REFUSED + 1)
    assert {p for m in methods for p in s.refuser.peers[m]} == {me.peer_id}


def test_cotrainer_names_itself_and_retries(serve: Callable[[int], Served]) -> None:
    s = serve(1)   # the probe tries twice (`PROBE_BACKOFF`): one refusal, then an answer
    view = Cotrainers(s.job_id, "me" * 20)
    view.update([s.record()])
    view.probe(s.job_id)
    assert [c.trainer_id for c in view.live()] == [TRAINER.peer_id]   # answered on its second try: still live
    updates = fetch_chain(s.cotrainer(), s.job_id, have_version=0, have_hash=b"", want_version=HEAD, max_gap=0,
                          my_id="me" * 20)
    assert [(u.header.snapshot, u.header.to_version) for u in updates] == [(True, HEAD)]
    assert s.refuser.calls["FetchAdapter"] == 2 and s.refuser.calls["GetJobStatus"] == 2
    assert set(s.refuser.peers["GetJobStatus"] + s.refuser.peers["FetchAdapter"]) == {"me" * 20}
    refusing = serve(10)
    view = Cotrainers(refusing.job_id, "me" * 20)
    view.update([refusing.record()])
    view.probe(refusing.job_id)
    assert view.live() == [] and refusing.refuser.calls["GetJobStatus"] == 2


def test_submitter_and_dashboard_retry_and_submissions_name_the_signer(serve: Callable[[int], Served]) -> None:
    s = serve(REFUSED)
    owner = Identity.from_seed(b"o" * 32)
    envelope = sign_job(owner, SPEC)
    assert submit_signed(s.endpoint, envelope) == job_id_from_body(envelope.body)
    assert job_status(s.endpoint, s.job_id).policy_version == HEAD
    assert fetch_snapshot(s.endpoint, s.job_id, TRAINER.public_key).version == HEAD
    channel = grpc.insecure_channel(s.endpoint)
    try:
        st = grpc_fetch(pb_grpc.TrainerStub(channel))(s.job_id)
    finally:
        channel.close()
    assert st is not None and st.policy_version == HEAD
    # each call opened once more than it was refused: GetJobStatus by `status` and the dashboard
    assert s.refuser.calls == {"SubmitJob": REFUSED + 1, "GetJobStatus": REFUSED + 2, "FetchAdapter": REFUSED + 1}
    assert s.refuser.peers["SubmitJob"] == [owner.peer_id] * (REFUSED + 1)
    assert set(s.refuser.peers["GetJobStatus"] + s.refuser.peers["FetchAdapter"]) == {""}   # no identity: anonymous


def test_clients_give_up_after_their_attempts_with_a_clear_error(serve: Callable[[int], Served],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    s = serve(100)
    attempts = Backoff().attempts
    with pytest.raises(GaveUp) as caught:
        job_status(s.endpoint, s.job_id)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and isinstance(caught.value, grpc.RpcError)
    assert f"gave up after {attempts} attempts" in str(caught.value)
    assert caught.value.waited_s >= (attempts - 1) * HINT_MS / 1000   # the hint was honoured each time
    rec = s.record()
    watch = JobWatch.open(rec, connect(rec.record, max_message_mb=64, peer_id="v" * 40), cache=SnapshotCache())
    try:
        with pytest.raises(GaveUp, match="too many streams"):
            watch.sample(0)
    finally:
        watch.close()
    assert s.refuser.calls == {"GetJobStatus": attempts, "SampleAdmitted": attempts}
    assert cli_main(["status", s.job_id, "--trainer", s.endpoint]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"swarmrl status: the trainer at {s.endpoint} is overloaded")
    assert f"gave up after {attempts} attempts" in err[0] and "try again later" in err[0]
