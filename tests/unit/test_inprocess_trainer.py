"""A real worker session and a real validator pass against a trainer in this process, with no
socket (issue 23 item 3): `node.local.inprocess.InProcessTrainer` behind the same client
interfaces (`node.net.trainer_client`) the gRPC path implements.

The trainer trusts the validator and keeps new peers' groups on probation, so the walk is the
real one end to end: the worker leases, generates (tiny model, transformers backend), grades in
the real grading pool, signs and submits; nothing trains until the validator, re-checking every
group (sample rate 1), reports passing verdicts; then the trainer steps, and the worker's next
lease catches up to the new version from the trainer. While it runs, opening an internet socket
or a gRPC channel or server fails the test."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from swarmrl.node.inference import build_backend
from swarmrl.node.local.inprocess import InProcessTrainer
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.runtime.config import TrainerConfig, ValidatorConfig
from swarmrl.node.submitter.client import sign_job
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.worker.red_team import RedTeam
from swarmrl.node.worker.session import JobSession
from swarmrl.protocol import admission as adm
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.red_team_modes import REPLAY
from swarmrl.protocol.verdicts import ALL
from swarmrl.validator.service import ValidatorService


class NetworkUsed(AssertionError):
    """The in-process path opened a network socket or a gRPC channel."""


@pytest.fixture()
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fail any internet socket (Python's) and any gRPC channel or server (grpc's C core opens
    its own sockets, so it is refused at its constructors). Unix sockets and pipes (the grading
    pool's) stay allowed. Returns the list of attempts (expected empty)."""
    attempts: list[str] = []
    real = socket.socket

    class InetRefused(real):  # type: ignore[misc, valid-type]
        def __init__(self, family: Any = -1, *args: Any, **kwargs: Any) -> None:
            inet = family in (socket.AF_INET, socket.AF_INET6) or (family == -1 and kwargs.get("fileno") is None
                                                                     and len(args) < 3)   # the default: AF_INET
            if inet:
                attempts.append(f"socket({int(family)})")
                raise NetworkUsed(f"a socket of family {family} was opened")
            super().__init__(family, *args, **kwargs)

    def refuse(what: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            attempts.append(what)
            raise NetworkUsed(f"{what} was called")
        return refused

    monkeypatch.setattr(socket, "socket", InetRefused)
    for name in ("insecure_channel", "secure_channel", "server"):
        monkeypatch.setattr(grpc, name, refuse(f"grpc.{name}"))
    return attempts


@pytest.fixture()
def hosted(tmp_path: Path, model_cache: Path) -> Iterator[tuple[InProcessTrainer, JobSpec, str, Identity]]:
    """An in-process trainer hosting the tiny arithmetic job, trusting one validator, with new
    peers on probation for an hour (so only a validator's pass lets their groups train)."""
    validator = Identity.generate()
    cfg = TrainerConfig(state_dir=tmp_path / "trainer", cache_dir=model_cache, trusted_validators=[validator.peer_id],
                        probation_s=3600)
    trainer = InProcessTrainer(cfg, Identity.generate())
    spec = builtin_job("tiny", model_cache, steps=3, batch_groups=4, prompts_per_lease=2)
    ack = trainer.submit_job(sign_job(Identity.generate(), spec))
    assert ack.accepted, ack.reason
    yield trainer, spec, ack.job_id, validator
    trainer.close()


def _rounds(session: JobSession, groups: int) -> int:
    """Work leases until `groups` groups were admitted; returns the rounds it took."""
    admitted = rounds = 0
    while admitted < groups:
        result = session.work_once()
        assert result is not None, session.last_refusal
        assert result.reasons == [] and result.admitted == result.groups
        admitted, rounds = admitted + result.admitted, rounds + 1
        assert rounds <= groups
    return rounds


def test_worker_and_validator_against_an_in_process_trainer(no_network: list[str], hosted, model_cache: Path,
                                                            tmp_path: Path) -> None:
    trainer, spec, job_id, validator_key = hosted
    job = trainer.trainer.jobs[job_id]
    backend = build_backend("hf", prepare_base_model("tiny", model_cache))
    backend.add_slot(job_id, spec.lora)
    worker = Identity.generate()
    record = trainer.record(job_id)
    session = JobSession(record, trainer.connect(record), identity=worker, backend=backend,
                         max_prompts=spec.prompts_per_lease, grade_timeout_s=30)
    validator = ValidatorService(ValidatorConfig(key=tmp_path / "v.key", state_dir=tmp_path / "validator",
                                                 cache_dir=model_cache, sample_rate=1.0, device="cpu"),
                                 validator_key, connect=trainer.connect)
    try:
        # lease -> catch up (v0, a snapshot from the trainer) -> generate -> grade -> sign -> submit
        _rounds(session, spec.batch_groups)
        assert session.replica.version == 0 and session.sync.stats.trainer_updates == 1
        assert job.ledger.count_pending(job_id) == spec.batch_groups
        assert trainer.step() == 0 and job.groups_on_probation() == spec.batch_groups   # nobody vouched yet

        # the validator's pass: sample admitted batches, re-check every group, report signed verdicts
        sent = validator.poll([trainer.verified_record(job_id)])
        assert sent == spec.batch_groups
        status = trainer.client().job_status(pb.JobStatusRequest(job_id=job_id, verdicts=16))
        verdicts = list(status.recent_verdicts)
        assert len(verdicts) == spec.batch_groups
        assert {(r.verdict.peer_id, r.validator_id, r.verdict.passed, r.verdict.check) for r in verdicts} == {
            (worker.peer_id, validator_key.peer_id, True, ALL)}
        assert job.groups_on_probation() == 0

        # the trainer steps on the vouched-for groups; the worker's next lease catches up to v1.
        # A batch whose every group scored alike carries no signal (sampling is random): it is
        # consumed as no_signal without a version, and the now vouched-for worker fills another.
        while trainer.step() == 0:
            assert job.batches_without_signal <= 3 and job.version == 0
            _rounds(session, spec.batch_groups)
        assert job.version == 1
        assert job.ledger.group_counts(job_id)["trained"] == spec.batch_groups
        result = session.work_once()
        assert result is not None and result.policy_version == 1 and result.admitted == result.groups
        assert session.replica.version == 1 and session.replica.hash == job.head_hash
        assert session.stats.catchups == 2 and session.sync.stats.trainer_updates == 2

        # replay protection is the trainer's own: the same signed batch again is refused
        lease = session.request_lease()
        assert lease is not None
        session.catch_up(lease.policy_version)
        prompts = session.env.prompts(spec.seed, list(lease.prompt_indices))
        groups = session.generate(prompts, lease)
        session.grade(prompts, groups)
        envelope = session.sign(lease, groups)
        assert session.trainer.submit_rollouts(envelope).accepted
        again = session.trainer.submit_rollouts(envelope)
        assert not again.accepted and again.reason == "replay"
    finally:
        session.close()
        validator.close()
    assert no_network == []


def test_in_process_messages_cross_as_bytes_under_the_message_limit(no_network: list[str], hosted) -> None:
    trainer, _, job_id, _ = hosted
    client = trainer.client(max_message_mb=1)
    worker = Identity.generate()
    req = pb.LeaseRequest(job_id=job_id, max_prompts=1, created_ms=0)
    reply = client.request_lease(signing.sign(worker, signing.LEASE_REQUEST, req))
    assert reply.HasField("lease") and reply.lease.peer_id == worker.peer_id
    huge = pb.Signed(body=b"\0" * (1 << 20), public_key=worker.public_key, signature=b"\0" * 64)
    with pytest.raises(grpc.RpcError) as refused:   # as a gRPC channel of 1 MiB refuses it
        client.submit_rollouts(huge)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in refused.value.details()
    with pytest.raises(grpc.RpcError) as unknown:   # NOT_FOUND, as the gRPC service aborts
        list(client.fetch_adapter(pb.AdapterRequest(job_id="no-such-job", want_version=0, snapshot=True)))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert no_network == []


def test_two_jobs_sessions_share_one_in_process_trainer(no_network: list[str], hosted, model_cache: Path) -> None:
    """What the many-jobs work needs: one trainer, several jobs, one session per job over one
    backend with a LoRA slot per job; each job's admission is its own."""
    trainer, spec, first, _ = hosted
    second = trainer.submit_job(sign_job(Identity.generate(), spec.model_copy(update={"seed": spec.seed + 1}))).job_id
    assert second != first and set(trainer.trainer.jobs) == {first, second}
    backend = build_backend("hf", prepare_base_model("tiny", model_cache))
    worker = Identity.generate()
    sessions = []
    for job_id in (first, second):
        backend.add_slot(job_id, spec.lora)
        record = trainer.record(job_id)
        sessions.append(JobSession(record, trainer.connect(record), identity=worker, backend=backend,
                                   max_prompts=spec.prompts_per_lease, grade_timeout_s=30))
    try:
        for s in sessions:
            assert _rounds(s, spec.prompts_per_lease) == 1
        assert [trainer.trainer.jobs[j].ledger.count_pending(j) for j in (first, second)] == [spec.prompts_per_lease] * 2
    finally:
        for s in sessions:
            s.close()
    assert no_network == []


def test_the_replay_drill_reads_admitted_batches_through_the_same_client(no_network: list[str], hosted,
                                                                         model_cache: Path) -> None:
    """The red team's replay mode samples admitted batches (a validator's call) through the
    worker's client, and the trainer refuses what it resends: the verbatim batch as a replay, the
    reassigned groups as not the lease's."""
    trainer, spec, job_id, _ = hosted
    sessions = []
    for _ in range(2):
        backend = build_backend("hf", prepare_base_model("tiny", model_cache))
        backend.add_slot(job_id, spec.lora)
        record, who = trainer.record(job_id), Identity.generate()
        sessions.append(JobSession(record, trainer.connect(record), identity=who, backend=backend,
                                   max_prompts=spec.prompts_per_lease, grade_timeout_s=30))
    honest, adversary = sessions
    try:
        assert _rounds(honest, spec.prompts_per_lease) == 1
        drill = RedTeam(REPLAY, seed=0)
        result = drill.work_once(adversary)
        assert result is not None and result.admitted == 0 and result.groups == spec.prompts_per_lease
        assert drill.stats.submitted_batches == 2 and drill.stats.admitted_groups == 0
        assert drill.stats.last_reasons[0] == "replay" and set(result.reasons) == {adm.NOT_IN_LEASE}
    finally:
        for s in sessions:
            s.close()
    assert no_network == []

def test_the_guard_refuses_internet_sockets_and_grpc(no_network: list[str]) -> None:
    """The guard the tests above run under is real: these would have opened a connection."""
    with pytest.raises(NetworkUsed):
        socket.create_connection(("127.0.0.1", 9), timeout=1)
    with pytest.raises(NetworkUsed):
        grpc.insecure_channel("127.0.0.1:9")
    a, b = socket.socketpair()   # unix sockets (the grading pool's kind) still work
    a.close(), b.close()
    assert no_network == [f"socket({int(socket.AF_INET)})", "grpc.insecure_channel"]
