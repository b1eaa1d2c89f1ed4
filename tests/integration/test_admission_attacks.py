"""A real trainer process on loopback keeps serving an honest worker while rejecting, each with
its own reason: a forged signature, a replayed batch, a rollout from an unknown lease, a stale
policy version and a NaN log-prob."""

from __future__ import annotations

import math
import time

import pytest

from swarmrl.node.inference import build_backend
from swarmrl.node.local.processes import LocalSwarm
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.net.grpc_wire import connect
from swarmrl.node.submitter.client import job_status, stub, submit_job
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.worker.session import JobSession
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served_job(tmp_path_factory, model_cache):
    work = tmp_path_factory.mktemp("trainer")
    swarm = LocalSwarm(work)
    trainer_key = Identity.generate()
    trainer_key.save(work / "trainer.key")
    swarm.start("trainer", "trainer", [f'key="{work / "trainer.key"}"', f'state_dir="{work / "state"}"',
                                       f'ready_file="{work / "trainer.ready"}"', f'cache_dir="{model_cache}"'])
    try:
        endpoint = swarm.wait_ready("trainer", work / "trainer.ready", timeout_s=120)["endpoint"]
        spec = builtin_job("tiny", model_cache, steps=100, batch_groups=2, prompts_per_lease=2, max_async_level=1)
        job_id = submit_job(endpoint, Identity.generate(), spec)
        record = pb.JobRecord(job_id=job_id, trainer_id=trainer_key.peer_id, endpoint=endpoint,
                              spec_json=spec.canonical_json(), trainer_public_key=trainer_key.public_key)
        backend = build_backend("hf", prepare_base_model("tiny", model_cache))
        backend.add_slot(job_id, spec.lora)
        yield endpoint, record, backend
    finally:
        swarm.stop_all()


def _session(record, backend, identity=None) -> JobSession:
    identity = identity or Identity.generate()
    return JobSession(record, connect(record, max_message_mb=64, peer_id=identity.peer_id), identity=identity,
                      backend=backend, max_prompts=2, grade_timeout_s=10)


def _lease(session: JobSession, timeout_s: float = 120) -> pb.Lease:
    """A lease, waiting out backpressure ("busy") as a worker does: the trainer refuses leases while
    two batches of admitted groups wait for a step, and how long that lasts depends on the machine."""
    deadline = time.monotonic() + timeout_s
    while (lease := session.request_lease()) is None:
        assert session.last_refusal == "busy" and time.monotonic() < deadline, session.last_refusal
        time.sleep(0.5)
    return lease


def _work_once(session: JobSession):
    """`JobSession.work_once` that waits out backpressure; None never means "no lease" here."""
    while (result := session.work_once()) is None:
        assert session.last_refusal == "busy", session.last_refusal
        time.sleep(0.5)
    return result


def _prepared_batch(session: JobSession) -> tuple[pb.Lease, pb.Signed]:
    lease = _lease(session)
    session.catch_up(lease.policy_version)
    prompts = session.env.prompts(session.spec.seed, list(lease.prompt_indices))
    groups = session.generate(prompts, lease)
    session.grade(prompts, groups)
    return lease, session.sign(lease, groups)


def _send(endpoint: str, envelope: pb.Signed) -> pb.BatchReceipt:
    return stub(endpoint).SubmitRollouts(iter([envelope]), timeout=30).batches[0]


def _resign(identity: Identity, envelope: pb.Signed, edit) -> pb.Signed:
    batch = pb.RolloutBatch.FromString(envelope.body)
    edit(batch)
    return signing.sign(identity, signing.ROLLOUT_BATCH, batch)


def _group_reasons(receipt: pb.BatchReceipt) -> set[str]:
    return {g.reason for g in receipt.groups if not g.admitted}


def test_each_attack_is_rejected_with_its_reason_while_honest_work_continues(served_job):
    endpoint, record, backend = served_job
    honest = _session(record, backend)
    first = _work_once(honest)
    assert first.admitted == first.groups == 2

    # stale: an attacker takes a lease now and answers it after the policy moved on.
    stale_id = Identity.generate()
    stale_session = _session(record, backend, stale_id)
    _, stale_envelope = _prepared_batch(stale_session)

    # forged signature: flip one bit of an honest batch's signature.
    _, envelope = _prepared_batch(honest)
    sig = bytearray(envelope.signature)
    sig[0] ^= 1
    forged = pb.Signed(body=envelope.body, public_key=envelope.public_key, signature=bytes(sig))
    r = _send(endpoint, forged)
    assert not r.accepted and r.reason == "bad_signature"

    # the honest original is admitted, its replay is not.
    r = _send(endpoint, envelope)
    assert r.accepted and all(g.admitted for g in r.groups)
    r = _send(endpoint, envelope)
    assert not r.accepted and r.reason == "replay"

    # unknown lease.
    attacker = Identity.generate()
    r = _send(endpoint, _resign(attacker, envelope, lambda b: (setattr(b, "lease_id", "no-such-lease"),
                                                                setattr(b, "peer_id", attacker.peer_id))))
    assert not r.accepted and r.reason == "unknown_lease"

    # NaN log-prob in an otherwise honest batch from the attacker's own lease.
    nan_session = _session(record, backend, attacker)
    _, nan_envelope = _prepared_batch(nan_session)

    def poison(b: pb.RolloutBatch) -> None:
        b.groups[0].completions[0].logprobs[0] = math.nan

    r = _send(endpoint, _resign(attacker, nan_envelope, poison))
    assert r.accepted and "non_finite" in _group_reasons(r)

    # drive the policy forward with honest work until the stale lease's version is out of the window.
    lease_version = pb.RolloutBatch.FromString(stale_envelope.body).groups[0].completions[0].policy_version
    deadline = time.monotonic() + 240
    while job_status(endpoint, record.job_id).policy_version < lease_version + 2:
        assert time.monotonic() < deadline, "trainer did not advance"
        result = _work_once(honest)
        assert result.admitted == result.groups
    r = _send(endpoint, stale_envelope)
    assert r.accepted and _group_reasons(r) == {"stale"}

    # the trainer still serves the honest worker, and counted every reason.
    after = _work_once(honest)
    assert after.admitted == after.groups
    rejected = dict(job_status(endpoint, record.job_id).groups_rejected)
    for reason in ("bad_signature", "replay", "unknown_lease", "non_finite", "stale"):
        assert rejected.get(reason, 0) >= 1, (reason, rejected)
    for s in (honest, stale_session, nan_session):
        s.grader.close()
