"""The simulator's shortcuts give the product's answers (the memoised admission verdict, the
counter lease ids, the one-shot HMAC draw), and its collector thresholds don't outlive a run."""

from __future__ import annotations

import gc
import hashlib
import hmac
import itertools

import pytest

from swarmrl.protocol import admission as adm
from swarmrl.protocol.leases import LeaseBook
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.red_team_modes import MODES
from swarmrl.simulations import cheaters as ch
from swarmrl.simulations.run import GC_THRESHOLDS, fewer_collections
from swarmrl.validator.sampling import unit_draw


def _direct(mode: str, lease: pb.Lease, index: int, current_version: int, lim: adm.AdmissionLimits) -> str:
    """The check on the stand-in group built for this very lease and index (no memo)."""
    prompt = [9, 9] if mode == ch.PROMPT_SWAP else ch._PROMPT
    group = pb.Group(prompt_index=index, prompt_token_ids=prompt,
                     completions=[ch._completion(mode, lease.policy_version)] * lim.group_size)
    return adm.check_group(group, lease, current_version=current_version,
                           expected_prompt_ids={i: ch._PROMPT for i in lease.prompt_indices},
                           already_admitted=(), lim=lim)


def test_memoised_verdict_is_the_direct_check_for_every_mode_and_version():
    reasons = set()
    for level, mode, lease_v, current_v, leased in itertools.product(
            (0, 2), (ch.HONEST, *MODES), range(4), range(6), (True, False)):
        lim = ch.limits(level)
        lease = pb.Lease(lease_id="L", policy_version=lease_v, prompt_indices=[40, 41, 42, 43], peer_id="p")
        index = 42 if leased else 10**9 + 43
        got = ch.group_reason(mode, lease, index, current_v, lim)
        assert got == _direct(mode, lease, index, current_v, lim), (level, mode, lease_v, current_v, leased)
        reasons.add(got)
    # the grid reaches admitted groups and several distinct refusals, so the comparison means something
    assert "" in reasons and {adm.NOT_IN_LEASE, adm.STALE, adm.PROMPT_MISMATCH} <= reasons


def test_lease_ids_come_from_the_injected_factory_and_default_to_random_hex():
    ids = itertools.count()
    book = LeaseBook("J", ttl_ms=100, new_lease_id=lambda: f"0-{next(ids)}")
    sampling = pb.SamplingParams(n=2)
    assert [book.issue("p", 1, 0, sampling, 0).lease_id for _ in range(3)] == ["0-0", "0-1", "0-2"]
    assert book.get("0-1") is not None
    default = LeaseBook("J", ttl_ms=100).issue("p", 1, 0, sampling, 0).lease_id
    assert len(default) == 24 and int(default, 16) >= 0


def test_one_shot_hmac_draw_equals_the_streaming_one():
    key = bytes(range(32))
    for batch, index in (("b1", 0), ("batch-xyz", 7), ("", 10**9)):
        msg = f"full\x00{batch}\x00{index}".encode()
        expected = int.from_bytes(hmac.new(key, msg, hashlib.sha256).digest()[:8], "big") / 2.0**64
        assert unit_draw(key, "full", batch, index) == expected


def test_fewer_collections_restores_the_thresholds_even_on_error():
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), fewer_collections():
        assert gc.get_threshold() == GC_THRESHOLDS
        raise RuntimeError("interrupted")
    assert gc.get_threshold() == before
