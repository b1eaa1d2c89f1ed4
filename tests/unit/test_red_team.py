"""Red-team modes with small inputs: each doctoring step and what catches it (admission, a
validator rung). The trainer's consequences (strikes, bans, dropped groups) are
tests/unit/test_trainer_job.py.

The validator cases reuse the ladder test's tiny model world (tests/unit/test_validator_ladder.py).
Legend: G = completions per group.
"""

from __future__ import annotations

import math
import random

import pytest

from swarmrl.node.inference.base import Sampling
from swarmrl.node.worker import red_team as rt
from swarmrl.protocol import admission as adm
from swarmrl.protocol import signing
from swarmrl.protocol.envs import get_environment
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.verdicts import LOGPROB, REGRADE, is_attributable
from swarmrl.validator import checks as ck
from tests.unit.test_validator_ladder import (  # noqa: F401 - pytest fixtures
    ALICE,
    BOB,
    JOB,
    MAX_NEW,
    G,
    World,
    admitted,
    copy,
    graded,
    judge,
    only_failure,
    prompt_ids,
    validator,
    world,
)

ENV = get_environment("arithmetic", "1")


def _group(index: int, prompt: list[int], version: int = 0, n: int = 4) -> pb.Group:
    comps = [pb.Completion(token_ids=[5, 6], logprobs=[-1.0, -0.5], finish_reason="stop", policy_version=version,
                           rewards=[0.0, 1.0], reward=0.1) for _ in range(n)]
    return pb.Group(prompt_index=index, prompt_token_ids=prompt, completions=comps)


def _limits(n: int = 4) -> adm.AdmissionLimits:
    return adm.AdmissionLimits(group_size=n, vocab_size=100, max_prompt_tokens=64, max_new_tokens=8,
                               reward_range=ENV.reward_range, num_reward_funcs=len(ENV.reward_funcs), max_async_level=2)


def _check(group: pb.Group, lease: pb.Lease, expected: dict[int, list[int]]) -> str:
    return adm.check_group(group, lease, current_version=lease.policy_version, expected_prompt_ids=expected,
                           already_admitted=(), lim=_limits())


LEASE = pb.Lease(lease_id="L1", job_id="j", peer_id="p", prompt_indices=[3], policy_version=1)


# ---- pure doctoring steps, and the admission reason each earns ------------------------------------

def test_modes_are_checked() -> None:
    assert set(rt.MODES) == {"forged_signature", "replay", "inflated_reward", "fabricated_logprobs", "random_tokens",
                             "base_model_only", "stale_version", "prompt_swap", "copycat", "nan_logprobs", "forged_env_reply"}
    with pytest.raises(ValueError, match="unknown red-team mode"):
        rt.check_mode("polite")


def test_forged_signature_does_not_verify_and_keeps_body_and_key() -> None:
    me = Identity.from_seed(b"f" * 32)
    env = signing.sign(me, signing.ROLLOUT_BATCH, pb.RolloutBatch(job_id="j", lease_id="L1", peer_id=me.peer_id))
    forged = rt.forge_signature(env)
    assert forged.body == env.body and forged.public_key == env.public_key
    with pytest.raises(signing.SignatureError):
        signing.open_signed(forged, signing.ROLLOUT_BATCH, pb.RolloutBatch)
    signing.open_signed(env, signing.ROLLOUT_BATCH, pb.RolloutBatch)  # the original is untouched


def test_nan_logprobs_fail_admission_attributably() -> None:
    g = _group(3, [1, 2], version=1)
    rt.poison_logprobs([g])
    assert all(math.isnan(c.logprobs[0]) for c in g.completions)
    reason = _check(g, LEASE, {3: [1, 2]})
    assert reason == adm.NON_FINITE and is_attributable(reason)


def test_prompt_swap_fails_admission_attributably() -> None:
    lease_prompt = ENV.prompt(0, 3)
    easy = rt.easy_prompt(ENV, 0, lease_prompt)
    assert easy.index == 3 and easy.text != lease_prompt.text and "1+1" in easy.text
    assert ENV.rewards([easy], ["2\n"])[0][0] == 1.0   # the easy answer is graded right against itself
    g = _group(3, [7, 7, 7], version=1)                # the easy prompt's ids, not the lease's
    reason = _check(g, LEASE, {3: [1, 2]})
    assert reason == adm.PROMPT_MISMATCH and is_attributable(reason)


def test_replayed_groups_under_a_new_lease_fail_admission_attributably() -> None:
    old = [_group(1, [1, 2], version=0)]
    again = rt.reassign(old, LEASE)
    assert again[0].completions[0].policy_version == 1 and old[0].completions[0].policy_version == 0
    reason = _check(again[0], LEASE, {3: [1, 2]})
    assert reason == adm.NOT_IN_LEASE and is_attributable(reason)
    assert not is_attributable(adm.REPLAY) and not is_attributable(adm.BAD_SIGNATURE)


def test_honest_slowness_is_never_attributable() -> None:
    for reason in (adm.STALE, adm.LEASE_EXPIRED, adm.DUPLICATE_GROUP, adm.FUTURE_VERSION, adm.UNKNOWN_LEASE,
                   adm.BANNED, adm.TOO_LONG):
        assert not is_attributable(reason), reason


def test_inflated_rewards_fail_regrade() -> None:
    g = _group(3, [1, 2])
    rt.inflate_rewards([g], ENV.reward_range[1])
    assert all(c.reward == pytest.approx(1.1) and list(c.rewards) == [1.0, 1.0] for c in g.completions)
    from swarmrl.protocol.envs.base import Grade
    true = [Grade(rewards=[0.0, 1.0], reward=0.1, error="")] * len(g.completions)
    assert not ck.check_regrade(g.completions, true, ENV.regrade_tolerance).passed


def test_fabricated_logprobs_fail_the_logprob_rung() -> None:
    g = _group(3, [1, 2])
    honest = [list(c.logprobs) for c in g.completions]
    rt.fabricate_logprobs([g])
    claimed = [list(c.logprobs) for c in g.completions]
    assert claimed[0] == pytest.approx([rt.FABRICATED_LOGPROB] * 2)
    assert not ck.check_logprobs(claimed, honest, ck.LogprobTolerance.from_mean(0.15)).passed


def test_random_completion_claims_its_uniform_sampler() -> None:
    c = rt.random_completion(random.Random(0), [4, 5, 6, 7], 8, vocab=10)
    assert len(c.token_ids) == 8 and set(c.token_ids) <= {4, 5, 6, 7} and c.finish_reason == "length"
    assert list(c.logprobs) == pytest.approx([-math.log(4)] * 8)
    with pytest.raises(ValueError):
        rt.random_completion(random.Random(0), [], 8, vocab=10)
    with pytest.raises(ValueError):
        rt.random_completion(random.Random(0), [11], 8, vocab=10)


def test_copycat_finds_foreign_groups_and_relabels_them() -> None:
    me, other = Identity.from_seed(b"m" * 32), Identity.from_seed(b"o" * 32)

    def batch(who: Identity, indices: list[int], admitted_: list[int], seq: int) -> pb.AdmittedBatch:
        body = pb.RolloutBatch(job_id="j", lease_id=f"L{seq}", peer_id=who.peer_id,
                               groups=[_group(i, [1, i]) for i in indices])
        return pb.AdmittedBatch(seq=seq, batch=signing.sign(who, signing.ROLLOUT_BATCH, body),
                                admitted_prompt_indices=admitted_)

    found = rt.admitted_groups([batch(other, [0, 1], [1], 1), batch(me, [2], [2], 2)], exclude_peer=me.peer_id)
    assert [g.prompt_index for g in found] == [1]
    copied = rt.relabel(found[0], 9, [4, 4], version=3)
    assert copied.prompt_index == 9 and list(copied.prompt_token_ids) == [4, 4]
    assert [list(c.token_ids) for c in copied.completions] == [list(c.token_ids) for c in found[0].completions]
    assert all(c.policy_version == 3 for c in copied.completions) and found[0].prompt_index == 1


# ---- the validator rungs that catch the admitted modes (tiny model) -------------------------------

def _sampled(w: World, index: int, adapter: str | None, seed: int, version: int = 1) -> pb.Group:
    ids = prompt_ids(w, index)
    out = w.backend.generate([ids], Sampling(n=G, max_new_tokens=MAX_NEW, temperature=1.0, seed=seed), adapter=adapter)[0]
    comps = [graded(w, index, c.token_ids, c.logprobs, c.finish_reason, version=version) for c in out]
    return pb.Group(prompt_index=index, prompt_token_ids=ids, completions=comps)


def test_base_model_only_fails_logprob_once_the_adapter_moved(world: World, validator) -> None:  # noqa: F811
    g = _sampled(world, 0, adapter=None, seed=11)   # adapter disabled, version 1 claimed
    only_failure(judge(validator, world, admitted(ALICE, [g], seq=101)), LOGPROB)


def test_stale_version_fails_logprob(world: World, validator) -> None:  # noqa: F811
    v0, _ = world.adapters.state(0)
    world.backend.set_adapter("stale", v0)
    try:
        g = _sampled(world, 1, adapter="stale", seed=12, version=0)
    finally:
        world.backend.remove_adapter("stale")
    rt.claim_version([g], 1)
    only_failure(judge(validator, world, admitted(ALICE, [g], seq=102)), LOGPROB)


def test_random_tokens_fail_logprob(world: World, validator) -> None:  # noqa: F811
    rng = random.Random(3)
    allowed = list(range(4, world.backend.vocab_size))
    comps = [rt.random_completion(rng, allowed, MAX_NEW, world.backend.vocab_size) for _ in range(G)]
    graded_ = [graded(world, 2, list(c.token_ids), list(c.logprobs), "length") for c in comps]
    g = pb.Group(prompt_index=2, prompt_token_ids=prompt_ids(world, 2), completions=graded_)
    only_failure(judge(validator, world, admitted(ALICE, [g], seq=103)), LOGPROB)


def test_fabricated_logprobs_and_inflated_rewards_fail_their_rungs(world: World, validator) -> None:  # noqa: F811
    fab = copy(world.honest[0])
    rt.fabricate_logprobs([fab])
    only_failure(judge(validator, world, admitted(ALICE, [fab], seq=104)), LOGPROB)
    inflated = copy(world.honest[1])
    assert any(c.reward < ENV.reward_range[1] for c in inflated.completions)
    rt.inflate_rewards([inflated], ENV.reward_range[1])
    only_failure(judge(validator, world, admitted(BOB, [inflated], seq=105)), REGRADE)


def test_copycat_relabelled_copies_fail_and_the_original_keeps_credit(world: World, validator) -> None:  # noqa: F811
    original = admitted(ALICE, [copy(world.honest[0])], seq=106)
    assert all(v.passed for v in judge(validator, world, original))
    stolen = rt.relabel(world.honest[0], 3, prompt_ids(world, 3), version=1)
    verdicts = judge(validator, world, admitted(BOB, [stolen], seq=107))
    failed = [v for v in verdicts if not v.passed]
    assert failed and failed[0].peer_id == BOB.peer_id and failed[0].check in (LOGPROB, REGRADE)
    assert all(v.passed for v in judge(validator, world, original))


# ---- the drill's summary ---------------------------------------------------------------------------

def test_red_team_summary_fields() -> None:
    from swarmrl.node.local.summary import red_team_summary

    keys = {n: Identity.from_seed(n.encode().ljust(32, b"_")) for n in ("worker0", "redteam-nan_logprobs",
                                                                         "redteam-replay")}
    nan, replay, honest = (keys[n].peer_id for n in ("redteam-nan_logprobs", "redteam-replay", "worker0"))
    st = pb.JobStatus(groups_dropped_banned=2, peers=[
        pb.PeerInfo(peer_id=nan, groups_admitted=0, banned=True, banned_at_ms=13_500, first_seen_ms=10_000,
                    rejected_by_reason={"non_finite": 6, "banned": 2}),
        pb.PeerInfo(peer_id=replay, groups_admitted=2, rejected_by_reason={"replay": 2, "lease_expired": 1}),
        pb.PeerInfo(peer_id=honest, groups_admitted=9, rejected_by_reason={"stale": 1})])
    states = {"redteam-nan_logprobs": {"red_team": {"submitted_groups": 6, "first_submit_ms": 11_000}},
              "redteam-replay": {"red_team": {"submitted_groups": 6, "first_submit_ms": 9_000}}}
    out = red_team_summary(st, {"redteam-nan_logprobs": "nan_logprobs", "redteam-replay": "replay"}, states, keys,
                           ["worker0"])
    assert out["honest_banned"] == 0 and out["groups_dropped_banned"] == 2
    row = out["red_team"]["nan_logprobs"]
    assert (row["submitted"], row["admitted_before_ban"], row["detected"], row["seconds_to_ban"]) == (6, 0, True, 2.5)
    assert row["rejected"] == {"non_finite": 6}
    row = out["red_team"]["replay"]
    assert row["detected"] and not row["banned"] and row["seconds_to_ban"] is None and row["rejected"] == {"replay": 2}


def test_forged_env_reply_rewrites_every_environment_span_and_flags_single_turn() -> None:
    episode = pb.Completion(token_ids=[5, 6, 7, 8, 9, 10], logprobs=[-0.5, -1.0, 0.0, 0.0, 0.0, -0.25],
                            token_mask=[1, 1, 0, 0, 0, 1], turns=2)
    single = pb.Completion(token_ids=[5, 6], logprobs=[-0.5, -1.0])
    groups = [pb.Group(completions=[episode, single])]
    assert rt.forge_env_replies(groups, [42, 43]) == 2
    c, s = groups[0].completions
    assert list(c.token_ids) == [5, 6, 42, 43, 10] and list(c.token_mask) == [1, 1, 0, 0, 1]
    assert list(c.logprobs) == [-0.5, -1.0, 0.0, 0.0, -0.25]
    assert list(s.token_mask) == [1, 0] and s.turns == 1 and list(s.logprobs) == [-0.5, 0.0]
