"""The trainer's pure admission checks, one rejection reason each."""

import math
import random

from swarmrl.protocol import admission as adm
from swarmrl.protocol.pb import swarm_pb2 as pb

LIM = adm.AdmissionLimits(group_size=2, vocab_size=100, max_prompt_tokens=16, max_new_tokens=4,
                          reward_range=(0.0, 1.0), num_reward_funcs=1, max_async_level=2)
LEASE = pb.Lease(lease_id="L", job_id="J", peer_id="P", prompt_indices=[7], policy_version=3, deadline_ms=1000)
PROMPT = [1, 5, 6]


def _completion(**kw):
    c = pb.Completion(token_ids=[4, 5], logprobs=[-0.5, -1.0], finish_reason="stop", policy_version=3,
                      rewards=[1.0], reward=1.0)
    for k, v in kw.items():
        if isinstance(v, list):
            getattr(c, k)[:] = v
        else:
            setattr(c, k, v)
    return c


def _group(**kw):
    return pb.Group(prompt_index=7, prompt_token_ids=PROMPT, completions=[_completion(**kw), _completion()])


def _check(group, version=4, admitted=()):
    return adm.check_group(group, LEASE, current_version=version, expected_prompt_ids={7: PROMPT},
                           already_admitted=set(admitted), lim=LIM)


def test_honest_group_is_admitted():
    assert _check(_group()) == ""


def test_each_bad_group_has_its_own_reason():
    cases = {
        adm.TOKEN_OUT_OF_VOCAB: _group(token_ids=[4, 100]),
        adm.NON_FINITE: _group(logprobs=[-0.5, math.nan]),
        adm.LENGTH_MISMATCH: _group(logprobs=[-0.5]),
        adm.TOO_LONG: _group(token_ids=[1, 2, 3, 4, 5], logprobs=[-1.0] * 5),
        adm.EMPTY_COMPLETION: _group(token_ids=[], logprobs=[]),
        adm.LOGPROB_RANGE: _group(logprobs=[-0.5, 0.5]),
        adm.BAD_FINISH_REASON: _group(finish_reason="eos?"),
        adm.FUTURE_VERSION: _group(policy_version=9),
        adm.BELOW_LEASE_VERSION: _group(policy_version=2),
        adm.REWARD_RANGE: _group(reward=5.0),
    }
    for reason, group in cases.items():
        assert _check(group) == reason, reason


def test_staleness_window():
    assert _check(_group(), version=5) == ""          # 5 - 3 = 2 <= max_async_level
    assert _check(_group(), version=6) == adm.STALE   # 3 behind


def test_failed_grade_needs_a_reason():
    assert _check(_group(reward=math.nan, rewards=[math.nan], grade_error="timeout")) == ""
    assert _check(_group(reward=math.nan, rewards=[math.nan])) == adm.NON_FINITE


def test_group_level_lease_checks():
    assert _check(pb.Group(prompt_index=8, prompt_token_ids=PROMPT, completions=[_completion()] * 2)) == adm.NOT_IN_LEASE
    assert _check(_group(), admitted={7}) == adm.DUPLICATE_GROUP
    assert _check(pb.Group(prompt_index=7, prompt_token_ids=PROMPT, completions=[_completion()])) == adm.GROUP_SIZE
    swapped = pb.Group(prompt_index=7, prompt_token_ids=[1, 9, 9], completions=[_completion()] * 2)
    assert _check(swapped) == adm.PROMPT_MISMATCH


def test_batch_envelope_checks():
    batch = pb.RolloutBatch(job_id="J", lease_id="L", peer_id="P")
    ok = {"now_ms": 10, "batch_seen": False, "banned": set()}
    assert adm.check_batch_envelope(batch, "P", LEASE, **ok) == ""
    assert adm.check_batch_envelope(batch, "Q", LEASE, **ok) == adm.SIGNER_MISMATCH
    assert adm.check_batch_envelope(batch, "P", None, **ok) == adm.UNKNOWN_LEASE
    assert adm.check_batch_envelope(batch, "P", LEASE, now_ms=2000, batch_seen=False, banned=set()) == adm.LEASE_EXPIRED
    assert adm.check_batch_envelope(batch, "P", LEASE, now_ms=10, batch_seen=True, banned=set()) == adm.REPLAY
    assert adm.check_batch_envelope(batch, "P", LEASE, now_ms=10, batch_seen=False, banned={"P"}) == adm.BANNED
    other = pb.Lease(lease_id="L", job_id="J", peer_id="Q", deadline_ms=1000)
    assert adm.check_batch_envelope(batch, "P", other, **ok) == adm.LEASE_PEER_MISMATCH


def test_group_fast_path_gives_the_per_completion_verdict():
    """check_group folds the completion checks over the group and looks completion by completion
    only when that fails: on random groups with 0-3 faults each (NaN, infinities, bounds, exact
    edges, traces on a single-turn job, failed grades) its verdict is always the first failing
    completion's `check_completion` reason, or "" when every completion passes."""
    rng = random.Random(11)
    faults = [
        ("token_ids", []), ("token_ids", [1, 2, 3, 4, 5]), ("token_ids", [4, 100]), ("token_ids", [99, 0]),
        ("logprobs", [-0.5]), ("logprobs", [-0.5, math.nan]), ("logprobs", [math.inf, -1.0]),
        ("logprobs", [-math.inf, -1.0]), ("logprobs", [-0.5, 0.5]), ("logprobs", [-0.5, 1e-4]),
        ("logprobs", [-0.5, 2e-4]), ("logprobs", [-3e38, -3e38]), ("finish_reason", "eos?"), ("finish_reason", "length"),
        ("policy_version", 1), ("policy_version", 2), ("policy_version", 4), ("policy_version", 5), ("policy_version", 9),
        ("rewards", []), ("rewards", [math.nan]), ("rewards", [math.inf]), ("rewards", [-math.inf]), ("rewards", [1.0, 0.0]),
        ("reward", math.nan), ("reward", math.inf), ("reward", -1.0), ("reward", 1.0 + 1e-7), ("reward", 1.0 + 1e-5),
        ("reward", -1e-7), ("grade_error", "timeout"), ("token_mask", [1, 1]), ("turns", 1),
    ]
    lim = adm.AdmissionLimits(group_size=3, vocab_size=100, max_prompt_tokens=16, max_new_tokens=4,
                              reward_range=(0.0, 1.0), num_reward_funcs=1, max_async_level=2)
    seen = set()
    for _ in range(3000):
        completions = [_completion() for _ in range(lim.group_size)]
        for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
            field, value = rng.choice(faults)
            c = rng.choice(completions)
            if isinstance(value, list):
                getattr(c, field)[:] = value
            else:
                setattr(c, field, value)
        group = pb.Group.FromString(pb.Group(prompt_index=7, prompt_token_ids=PROMPT,
                                             completions=completions).SerializeToString())
        version = rng.choice((3, 4, 5, 6))
        exact = next((r for c in group.completions if (r := adm.check_completion(c, LEASE, version, lim))), "")
        got = adm.check_group(group, LEASE, current_version=version, expected_prompt_ids={7: PROMPT},
                              already_admitted=set(), lim=lim)
        assert got == exact, (got, exact, group)
        seen.add(got)
    assert "" in seen and len(seen) >= 12, seen   # both paths ran, on many kinds of fault
