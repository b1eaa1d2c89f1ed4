"""Compute only where there is signal (issue 25, item 3): a prompt whose last group had all-equal
rewards is leased less, by a keyed draw from the job seed and index (`protocol.prompt_signal`,
`LeaseBook.issue`'s skip, `lease_filter = "signal"`), and the zero-variance share of tokens is
counted under either rule."""

from __future__ import annotations

import pytest

from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.admission import Admission
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol import admission as adm
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.leases import MAX_SKIPS, LeaseBook
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.prompt_signal import KEEP_SHARE, PromptSignal, kept, zero_variance

PROBLEMS = 5   # the test's environment draws its prompt from 5 problems: index i shows problem i % 5


def _group(index: int, rewards: list[float], tokens: int = 3) -> pb.Group:
    return pb.Group(prompt_index=index, prompt_token_ids=[100 + index % PROBLEMS],
                    completions=[pb.Completion(token_ids=[7] * tokens, logprobs=[-1.0] * tokens, reward=r,
                                               rewards=[r], finish_reason="stop") for r in rewards])


def test_zero_variance_is_the_trainer_s_rule() -> None:
    assert zero_variance([1.0, 1.0, 1.0]) and zero_variance([0.0, 0.0]) and zero_variance([float("nan"), 1.0])
    assert not zero_variance([0.0, 1.0, 1.0])


def test_a_prompt_with_no_signal_is_skipped_but_for_a_keyed_share() -> None:
    sig = PromptSignal(seed=3)
    assert not sig.skip(5, [100])                       # never seen: leased
    sig.record(_group(0, [1.0, 1.0]))                   # problem 0: all solved
    decisions = [sig.skip(i, [100]) for i in range(5, 5 + 4000, 5)]
    kept_share = decisions.count(False) / len(decisions)
    assert abs(kept_share - KEEP_SHARE) < 0.04
    assert decisions == [not kept(3, i, KEEP_SHARE) for i in range(5, 5 + 4000, 5)]   # the job seed's draw
    assert [PromptSignal(seed=4).skip(i, [100]) for i in range(3)] == [False] * 3
    sig.record(_group(10, [0.0, 1.0]))                  # problem 0 has signal again
    assert not any(sig.skip(i, [100]) for i in range(5, 500, 5))


def test_tokens_in_zero_variance_groups_are_counted() -> None:
    sig = PromptSignal(seed=0)
    sig.record(_group(0, [1.0, 1.0], tokens=4))
    sig.record(_group(1, [0.0, 1.0], tokens=6))
    f = sig.figures()
    assert (f["tokens"], f["tokens_zero_variance"], f["groups_zero_variance"]) == (20.0, 8.0, 1.0)
    assert f["zero_variance_token_share"] == pytest.approx(0.4)


def test_skipped_indices_are_consumed_and_a_lease_passes_over_a_bounded_number() -> None:
    book = LeaseBook("J", ttl_ms=100)
    lease = book.issue("w", 3, 0, pb.SamplingParams(), now_ms=0, skip=lambda i: i % 2 == 1)
    assert list(lease.prompt_indices) == [0, 2, 4]
    book.record_answers(lease.lease_id, [0, 2, 4])
    assert book._admitted_below == 5 and not book._admitted        # the prefix moved past the skipped ones
    everything = book.issue("w", 2, 0, pb.SamplingParams(), now_ms=0, skip=lambda i: True)
    assert list(everything.prompt_indices) == [5 + MAX_SKIPS, 6 + MAX_SKIPS]   # then taken as they come


def test_the_filter_changes_no_existing_job_id(model_cache) -> None:
    spec = builtin_job("tiny", model_cache)
    assert "lease_filter" not in spec.canonical_json()
    assert '"lease_filter":"signal"' in spec.model_copy(update={"lease_filter": "signal"}).canonical_json()


def test_a_trainer_with_the_filter_leases_less_of_a_solved_problem(tmp_path, model_cache) -> None:
    spec = builtin_job("tiny", model_cache).model_copy(update={"lease_filter": "signal", "prompts_per_lease": 5,
                                                               "group_size": 2, "batch_groups": 200})
    worker = Identity.from_seed(b"w" * 32)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    clock = [1000.0]
    try:
        limits = adm.AdmissionLimits(group_size=2, vocab_size=1000, max_prompt_tokens=16, max_new_tokens=16,
                                     reward_range=(0.0, 1.0), num_reward_funcs=1, max_async_level=2)
        admission = Admission("J", spec, ledger, limits=limits,
                              prompt_ids=lambda idx: {i: [100 + i % PROBLEMS] for i in idx}, version=lambda: 0,
                              done=lambda: False, identity=Identity.from_seed(b"t" * 32), clock=lambda: clock[0])
        first = admission.request_lease(worker.peer_id, pb.LeaseRequest(job_id="J")).lease
        assert list(first.prompt_indices) == [0, 1, 2, 3, 4]
        groups = [_group(i, [1.0, 1.0] if i == 0 else [0.0, 1.0]) for i in first.prompt_indices]   # 0 is solved
        batch = pb.RolloutBatch(job_id="J", lease_id=first.lease_id, peer_id=worker.peer_id, groups=groups)
        assert admission.admit(signing.sign(worker, signing.ROLLOUT_BATCH, batch), 1 << 24).accepted
        later = [i for _ in range(40) for i in admission.request_lease(
            worker.peer_id, pb.LeaseRequest(job_id="J")).lease.prompt_indices]
        solved = [i for i in later if i % PROBLEMS == 0]
        assert len(solved) < 0.5 * len(later) / PROBLEMS                 # leased less: a keyed share of it
        assert all(kept(spec.seed, i, KEEP_SHARE) for i in solved)
        assert admission.signal.skipped > 0 and admission.signal.tokens_zero_variance == 6
    finally:
        ledger.close()
