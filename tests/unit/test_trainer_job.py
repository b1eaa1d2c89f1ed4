"""The trainer's job runtime with small inputs: strikes and bans and what they do (revoked leases,
dropped groups, no bans on unattributable evidence, bans and strikes surviving a restart,
expiry), probation, a ban racing a lease request, lease expiry, and steps that change nothing.

Time is driven through the runtime's injected clock (`FakeClock`): no test sleeps.
"""

from __future__ import annotations

import threading

import pytest
import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.node.trainer.status import job_status
from swarmrl.node.worker import red_team as rt
from swarmrl.protocol import admission as adm
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.verdicts import LOGPROB, STRIKES_TO_BAN
from tests.unit.test_red_team import _group


class FakeClock:
    """A clock the test moves (unix seconds); `hook` runs at each read, once, if set."""

    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t
        self.hook = None

    def __call__(self) -> float:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture()
def runtime(tmp_path, model_cache, clock):
    torch.manual_seed(0)
    spec = builtin_job("tiny", model_cache, steps=4, batch_groups=2, prompts_per_lease=1)
    trainer = Identity.from_seed(b"t" * 32)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = JobRuntime("job-rt", spec, identity=trainer, model_path=prepare_base_model("tiny", model_cache),
                     state_dir=tmp_path, ledger=ledger, clock=clock)
    yield job, ledger, tmp_path
    ledger.close()


def _lease(job: JobRuntime, who: Identity) -> pb.Lease:
    reply = job.admission.request_lease(who.peer_id, pb.LeaseRequest(job_id=job.job_id, max_prompts=1))
    assert reply.HasField("lease"), reply.reason
    return reply.lease


def _honest_batch(job: JobRuntime, who: Identity, lease: pb.Lease) -> pb.Signed:
    groups = [_group(i, job.prompt_ids(i), version=lease.policy_version, n=job.spec.group_size)
              for i in lease.prompt_indices]
    batch = pb.RolloutBatch(job_id=job.job_id, lease_id=lease.lease_id, peer_id=who.peer_id, groups=groups)
    return signing.sign(who, signing.ROLLOUT_BATCH, batch)


def _submit(job: JobRuntime, env: pb.Signed) -> pb.BatchReceipt:
    return job.admission.admit(env, 1 << 24)


def test_nan_batches_ban_after_strikes_and_honest_peers_stay(runtime) -> None:
    job, _, _ = runtime
    bad, good = Identity.from_seed(b"x" * 32), Identity.from_seed(b"y" * 32)
    assert _submit(job, _honest_batch(job, good, _lease(job, good))).groups[0].admitted
    for k in range(STRIKES_TO_BAN):
        lease = _lease(job, bad)
        body = pb.RolloutBatch.FromString(_honest_batch(job, bad, lease).body)
        rt.poison_logprobs(body.groups)
        receipt = _submit(job, signing.sign(bad, signing.ROLLOUT_BATCH, body))
        assert receipt.groups[0].reason == adm.NON_FINITE
        assert (bad.peer_id in job.admission.banned) == (k == STRIKES_TO_BAN - 1)
        assert job.admission.leases.get(lease.lease_id) is None   # revoked: its prompt goes back to the queue now
    assert job.admission.request_lease(bad.peer_id, pb.LeaseRequest(job_id=job.job_id)).reason == adm.BANNED
    assert good.peer_id not in job.admission.banned
    peers = {p.peer_id: p for p in job_status(job, 0).peers}
    assert peers[bad.peer_id].banned and peers[bad.peer_id].banned_at_ms > 0
    assert peers[bad.peer_id].strikes == STRIKES_TO_BAN and peers[bad.peer_id].rejected_by_reason[adm.NON_FINITE] >= 1


def test_a_replaying_peer_is_banned_in_one_round(runtime) -> None:
    """The replay mode's round: a verbatim resend of another peer's admitted batch is refused
    without blame; earlier admitted groups re-signed under the replayer's own lease are one strike
    each, so REPLAY_GROUPS >= STRIKES_TO_BAN of them ban it at once."""
    job, _, _ = runtime
    alice, replayer = Identity.from_seed(b"a" * 32), Identity.from_seed(b"r" * 32)
    sent = [_honest_batch(job, alice, _lease(job, alice)) for _ in range(STRIKES_TO_BAN)]
    assert all(_submit(job, env).groups[0].admitted for env in sent)
    lease = _lease(job, replayer)
    assert _submit(job, sent[-1]).reason == adm.REPLAY and job.admission.strikes[replayer.peer_id] == 0
    earlier = [g for env in sent for g in pb.RolloutBatch.FromString(env.body).groups]
    assert rt.REPLAY_GROUPS >= STRIKES_TO_BAN and len(earlier) <= rt.REPLAY_GROUPS
    body = pb.RolloutBatch(job_id=job.job_id, lease_id=lease.lease_id, peer_id=replayer.peer_id,
                           groups=rt.reassign(earlier, lease))
    receipt = _submit(job, signing.sign(replayer, signing.ROLLOUT_BATCH, body))
    assert [g.reason for g in receipt.groups] == [adm.NOT_IN_LEASE] * len(earlier)
    assert replayer.peer_id in job.admission.banned and alice.peer_id not in job.admission.banned


def test_forged_signature_on_own_private_lease_is_attributable(runtime) -> None:
    job, _, _ = runtime
    forger = Identity.from_seed(b"g" * 32)
    for _ in range(STRIKES_TO_BAN):
        receipt = _submit(job, rt.forge_signature(_honest_batch(job, forger, _lease(job, forger))))
        assert receipt.reason == adm.BAD_SIGNATURE
    assert forger.peer_id in job.admission.banned and "bad_signature_on_own_lease" in job.admission.banned[forger.peer_id]


def test_nobody_can_get_an_honest_peer_banned_without_its_key(runtime) -> None:
    """A framer copies the victim's public key onto garbage (with leases it doesn't hold, or the
    victim's lease once exposed) and replays the victim's admitted batch: rejected, no strike."""
    job, _, _ = runtime
    victim, framer = Identity.from_seed(b"v" * 32), Identity.from_seed(b"w" * 32)
    lease = _lease(job, victim)
    env = _honest_batch(job, victim, lease)
    assert _submit(job, env).groups[0].admitted
    own = _lease(job, framer)                                              # the framer's own lease
    for _ in range(STRIKES_TO_BAN + 1):
        assert _submit(job, env).reason == adm.REPLAY                      # replay
        forged = rt.forge_signature(env)                                   # lease exposed by now
        assert _submit(job, forged).reason == adm.BAD_SIGNATURE
        fake = pb.Signed(body=pb.RolloutBatch(job_id=job.job_id, lease_id=own.lease_id, peer_id=victim.peer_id)
                         .SerializeToString(), public_key=victim.public_key, signature=b"\0" * 64)
        assert _submit(job, fake).reason == adm.BAD_SIGNATURE
    assert victim.peer_id not in job.admission.banned and job.admission.strikes[victim.peer_id] == 0


def test_verdict_ban_drops_pending_groups_and_survives_a_restart(runtime, model_cache) -> None:
    job, ledger, state = runtime
    cheat = Identity.from_seed(b"c" * 32)
    lease = _lease(job, cheat)
    assert _submit(job, _honest_batch(job, cheat, lease)).groups[0].admitted
    verdict = pb.Verdict(job_id=job.job_id, peer_id=cheat.peer_id, batch_id="b", prompt_index=lease.prompt_indices[0],
                         passed=False, check=LOGPROB, detail="mean gap 1.2")
    assert job.admission.apply_verdicts("validator", pb.VerdictReport(job_id=job.job_id, verdicts=[verdict])) == [cheat.peer_id]
    st = job_status(job, 0)
    assert st.groups_dropped_banned == 1 and ledger.count_pending(job.job_id) == 0
    again = JobRuntime(job.job_id, job.spec, identity=job.identity, model_path=prepare_base_model("tiny", model_cache),
                       state_dir=state, ledger=ledger)
    assert cheat.peer_id in again.admission.banned and again.admission.bans.banned_at[cheat.peer_id] == job.admission.bans.banned_at[cheat.peer_id]
    again.admission.lift_ban(cheat.peer_id)
    assert cheat.peer_id not in again.admission.banned and not ledger.bans(job.job_id)


def test_strikes_survive_a_trainer_restart(runtime, model_cache) -> None:
    """A cheater one strike short of a ban does not start afresh when the trainer restarts."""
    job, ledger, state = runtime
    bad = Identity.from_seed(b"s" * 32)
    for _ in range(STRIKES_TO_BAN - 1):
        body = pb.RolloutBatch.FromString(_honest_batch(job, bad, _lease(job, bad)).body)
        rt.poison_logprobs(body.groups)
        assert _submit(job, signing.sign(bad, signing.ROLLOUT_BATCH, body)).groups[0].reason == adm.NON_FINITE
    again = JobRuntime(job.job_id, job.spec, identity=job.identity, model_path=prepare_base_model("tiny", model_cache),
                       state_dir=state, ledger=ledger)
    assert again.admission.strikes[bad.peer_id] == STRIKES_TO_BAN - 1 and bad.peer_id not in again.admission.banned
    body = pb.RolloutBatch.FromString(_honest_batch(again, bad, _lease(again, bad)).body)
    rt.poison_logprobs(body.groups)
    _submit(again, signing.sign(bad, signing.ROLLOUT_BATCH, body))
    assert bad.peer_id in again.admission.banned
    again.admission.lift_ban(bad.peer_id)
    assert again.admission.strikes[bad.peer_id] == 0 and not ledger.strikes(job.job_id)


def test_probation_holds_new_peers_groups_until_a_passing_verdict(tmp_path, model_cache, clock) -> None:
    """With probation, a step uses a peer's groups only after a trusted validator passed one of
    them (or the hold ran out); a cheater caught meanwhile loses its held groups untrained."""
    spec = builtin_job("tiny", model_cache, steps=4, batch_groups=2, prompts_per_lease=1)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = JobRuntime("job-probation", spec, identity=Identity.from_seed(b"t" * 32), ledger=ledger,
                     model_path=prepare_base_model("tiny", model_cache), state_dir=tmp_path, probation_ms=3_600_000,
                     clock=clock)
    honest, cheat = Identity.from_seed(b"h" * 32), Identity.from_seed(b"k" * 32)
    for who in (honest, honest, cheat):
        assert _submit(job, _honest_batch(job, who, _lease(job, who))).groups[0].admitted
    assert not job.ready() and job.take_batch() == [] and job.groups_on_probation() == 3

    def verdict(who: Identity, passed: bool, check: str) -> pb.Verdict:
        # one batch per peer (a batch id is the hash of one peer's signed body)
        return pb.Verdict(job_id=job.job_id, peer_id=who.peer_id, batch_id=f"b-{who.peer_id}", prompt_index=0,
                          passed=passed, check=check)

    job.admission.apply_verdicts("validator", pb.VerdictReport(job_id=job.job_id, verdicts=[verdict(honest, True, "all")]))
    assert job.ready()
    batch = job.take_batch()
    assert {p.peer_id for p in batch} == {honest.peer_id}
    job.ledger.mark([p.row_id for p in batch], "trained", step=1)
    assert job_status(job, 0).groups_on_probation == 1
    job.admission.apply_verdicts("validator", pb.VerdictReport(job_id=job.job_id, verdicts=[verdict(cheat, False, LOGPROB)]))
    assert cheat.peer_id in job.admission.banned and job.groups_on_probation() == 0
    assert job.ledger.peer_state_counts(job.job_id)[cheat.peer_id].get("trained", 0) == 0
    # a hold that ran out: the groups of a peer nobody checked become trainable.
    job.probation_ms = 1_000
    late = Identity.from_seed(b"l" * 32)
    assert _submit(job, _honest_batch(job, late, _lease(job, late))).groups[0].admitted
    assert late.peer_id not in {p.peer_id for p in job.take_batch()}
    clock.advance(1.001)
    batch = job.take_batch()
    assert late.peer_id in {p.peer_id for p in batch}
    job.ledger.mark([p.row_id for p in batch], "trained", step=2)
    # the last chance: a held group whose version is at the step's staleness floor is trained now
    # (or never), whatever the hold (probation must never make a group stale)
    job.probation_ms = 3_600_000
    last = Identity.from_seed(b"z" * 32)
    assert _submit(job, _honest_batch(job, last, _lease(job, last))).groups[0].admitted
    assert last.peer_id not in {p.peer_id for p in job.take_batch()} and job.groups_on_probation() == 1
    job.version += job.spec.max_async_level   # versions published meanwhile: the group is at the floor
    job.probation_last_chance = False   # the whole hold (trainer config probation_last_chance = false)
    assert last.peer_id not in {p.peer_id for p in job.take_batch()} and job.groups_on_probation() == 1
    job.probation_last_chance = True
    assert last.peer_id in {p.peer_id for p in job.take_batch()} and job.groups_on_probation() == 0
    ledger.close()


def test_bans_expire(runtime) -> None:
    job, _, _ = runtime
    peer = Identity.from_seed(b"e" * 32)
    job.admission.ban(peer.peer_id, "test", duration_ms=0)
    assert job.admission.request_lease(peer.peer_id, pb.LeaseRequest(job_id=job.job_id)).HasField("lease")
    assert peer.peer_id not in job.admission.banned


def _lease_to(job: JobRuntime, who: Identity) -> pb.LeaseReply:
    return job.admission.request_lease(who.peer_id, pb.LeaseRequest(job_id=job.job_id, max_prompts=1))


def test_a_ban_landing_during_a_lease_request_wins(runtime, clock) -> None:
    """A ban from another thread that lands while a peer asks for a lease: the request is
    answered `banned`, and the prompts the ban took back go to the next worker at once."""
    job, _, _ = runtime
    cheat, other = Identity.from_seed(b"r" * 32), Identity.from_seed(b"o" * 32)
    held = _lease(job, cheat).prompt_indices[0]
    banning = threading.Thread(target=job.admission.ban, args=(cheat.peer_id, "verdict: logprob"))
    clock.hook = lambda: (banning.start(), banning.join())   # the request's clock read lets the ban in
    assert _lease_to(job, cheat).reason == adm.BANNED
    assert not job.admission.leases.open_of(cheat.peer_id)
    assert list(_lease(job, other).prompt_indices) == [held]


def test_a_ban_never_leaves_a_banned_peer_holding_a_lease(runtime) -> None:
    """Force a ban to arrive between the lease request's ban check and the issued lease (a hook
    inside `LeaseBook.issue` starts it): the request holds the gate the ban needs, so the ban
    waits for the lease to be issued and then revokes it; the banned peer holds nothing and its
    prompts are the next worker's at once."""
    job, _, _ = runtime
    cheat, other = Identity.from_seed(b"q" * 32), Identity.from_seed(b"p" * 32)
    book, gate = job.admission.leases, job.admission.gate
    issue = book.issue
    entered = threading.Event()
    probe: list[bool] = []

    def ban_now() -> None:
        probe.append(gate.acquire(blocking=False))   # is the gate free while the lease is issued?
        if probe[0]:
            gate.release()
        entered.set()
        job.admission.ban(cheat.peer_id, "verdict: logprob")

    banning = threading.Thread(target=ban_now)

    def issue_with_a_ban_arriving(*args, **kwargs):
        banning.start()
        entered.wait()
        return issue(*args, **kwargs)

    book.issue = issue_with_a_ban_arriving
    reply = _lease_to(job, cheat)
    book.issue = issue
    banning.join()
    assert probe == [False], "a ban could take the gate while a lease was being issued"
    assert reply.HasField("lease") and cheat.peer_id in job.admission.banned
    assert not job.admission.leases.open_of(cheat.peer_id)
    assert list(_lease(job, other).prompt_indices) == list(reply.lease.prompt_indices)
    assert _submit(job, _honest_batch(job, cheat, reply.lease)).reason == adm.BANNED


def test_an_expired_lease_goes_to_the_next_worker_and_a_late_answer_is_refused(runtime, clock) -> None:
    """A worker that vanishes mid-lease: once the lease's deadline passes (clock driven), its
    prompts go to the next worker, and the late answer to the dead lease is refused as expired."""
    job, _, _ = runtime
    vanished, survivor = Identity.from_seed(b"v" * 32), Identity.from_seed(b"s" * 32)
    dead = _lease(job, vanished)
    late = _honest_batch(job, vanished, dead)
    clock.advance(job.spec.lease_ttl_s - 1)
    assert list(_lease(job, survivor).prompt_indices) != list(dead.prompt_indices)
    clock.advance(2)
    assert list(_lease(job, survivor).prompt_indices) == list(dead.prompt_indices)
    receipt = _submit(job, late)
    assert not receipt.accepted and receipt.reason == adm.LEASE_EXPIRED


def test_a_batch_without_signal_publishes_nothing(tmp_path, model_cache, clock) -> None:
    """After version 3, a step whose only group has rewards [1, 1] (zero variance: no tokens, no
    gradient) keeps version 3 and its hash, writes no delta, consumes the group and says so in
    the next version's metrics row."""
    spec = builtin_job("tiny", model_cache, steps=8, batch_groups=1, group_size=2, prompts_per_lease=1)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = JobRuntime("job-signal", spec, identity=Identity.from_seed(b"t" * 32), ledger=ledger,
                     model_path=prepare_base_model("tiny", model_cache), state_dir=tmp_path, clock=clock)
    worker = Identity.from_seed(b"w" * 32)

    def step_on(rewards: list[float]) -> dict[str, float] | None:
        lease = _lease(job, worker)
        group = _group(lease.prompt_indices[0], job.prompt_ids(lease.prompt_indices[0]), version=job.version, n=2)
        for c, r in zip(group.completions, rewards):
            c.reward = r
        batch = pb.RolloutBatch(job_id=job.job_id, lease_id=lease.lease_id, peer_id=worker.peer_id, groups=[group])
        assert _submit(job, signing.sign(worker, signing.ROLLOUT_BATCH, batch)).groups[0].admitted
        assert job.ready()
        return job.train_step()

    for _ in range(3):
        assert step_on([0.0, 1.0]) is not None
    assert job.version == 3
    head, deltas = job.head_hash, job.store.latest_version()
    assert step_on([1.0, 1.0]) is None
    assert (job.version, job.head_hash, job.store.latest_version()) == (3, head, deltas)
    assert ledger.count_pending(job.job_id) == 0 and not job.ready()
    row = step_on([1.0, 0.0])
    assert row is not None and job.version == 4 and row["batches_without_signal"] == 1.0
    _no_signal_is_counted_apart(job, worker.peer_id)
    ledger.close()


def _no_signal_is_counted_apart(job: JobRuntime, peer_id: str) -> None:
    """The group of the batch without signal is no_signal, not trained (issue 28 item 5: status
    showed 4 groups trained per step, 40 in 10 steps, and "trained 112" for the same worker): in
    the ledger, the status (job and peer), the trainer's /metrics and status's table titles."""
    from swarmrl.node.cli.status import peers_table, steps_table
    from swarmrl.node.ops.metrics import Families
    from swarmrl.node.trainer.metrics import job_families

    assert job.ledger.group_counts(job.job_id) == {"trained": 4, "no_signal": 1}
    st = job_status(job, history=2)
    peer = {p.peer_id: p for p in st.peers}[peer_id]
    assert (st.groups_trained, st.groups_no_signal, st.groups_admitted) == (4, 1, 5)
    assert (peer.groups_trained, peer.groups_no_signal, peer.groups_admitted) == (4, 1, 5)
    f = Families()
    job_families(f, job)
    samples = {s.name: s.value for m in f for s in m.samples}
    assert samples["swarmrl_trainer_groups_trained_total"] == 4
    assert samples["swarmrl_trainer_groups_no_signal_total"] == 1
    steps, peers = steps_table(st), peers_table(st)
    assert steps.title == "recent steps (the last 2 of 4)" and [c.header for c in steps.columns][4] == "groups trained"
    assert str(peers.title).startswith("peers, over all 4 steps")
    assert [c.header for c in peers.columns][2:4] == ["groups trained into versions", "no signal"]


def test_prompt_ids_reuse_a_prompt_rendered_for_another_index(runtime, monkeypatch) -> None:
    """The arithmetic environment shows the same problem at many indices: those render once, and
    every index still gets exactly `render_prompt`'s ids, also after the memo of distinct
    prompts fills up and starts over."""
    from swarmrl.node.models.causal_lm import render_prompt
    from swarmrl.node.trainer import job as job_module

    job, _, _ = runtime
    monkeypatch.setattr(job_module, "_PROMPT_MEMO", 50)
    indices = list(range(400))
    texts = [job.env.prompt(job.spec.seed, i).text for i in indices]
    assert len(set(texts)) < len(texts)   # repeats, so the memo has something to do
    got: dict[int, list[int]] = {}
    for k in range(0, len(indices), 8):   # leases of 8, as admission asks
        got.update(job.prompt_ids_of(indices[k:k + 8]))
    tok = job.learner.tokenizer
    assert got == {i: render_prompt(tok, job.env.prompt(job.spec.seed, i)) for i in indices}
    assert len(job._ids_by_prompt) <= 50
    assert job.prompt_ids(3) == render_prompt(tok, job.env.prompt(job.spec.seed, 3))
