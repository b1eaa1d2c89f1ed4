"""Cheaters: what each red-team mode does to a round and which rung of the product catches it.

The modes and their catchers are those of the red-team drill (node/worker/red_team.py's table;
the names are repeated here because simulations may not import node/); the simulated job is single-turn,
so forged_env_reply claims a completion's last token as the environment's, which admission refuses
(unexpected_trace). Admission-caught modes
are not given a probability: the simulator builds the doctored group as protobuf and runs the
real checks (protocol/admission.py), then `verdicts.is_attributable` decides whether it strikes.
Validator-caught modes fail a rung the validator runs on a sampled group (validator/sampling.py's
keyed draw at the peer's rate from validator/policy.py), with the detection probability per
checked group that the drill observed (every checked group of these modes failed its rung).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from swarmrl.protocol import admission as adm
from swarmrl.protocol.envs.trace import ENV, MODEL
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.red_team_modes import (
    BASE_MODEL_ONLY,
    COPYCAT,
    FABRICATED_LOGPROBS,
    FORGED_ENV_REPLY,
    INFLATED_REWARD,
    NAN_LOGPROBS,
    PROMPT_SWAP,
    RANDOM_TOKENS,
    STALE_VERSION,
)

HONEST = ""
REPLAY_GROUPS = 4   # earlier groups a replaying worker re-signs per round (red_team.REPLAY_GROUPS)
STALE_LAG = 2       # versions behind the lease's that stale_version samples with (red_team.STALE_LAG)


@dataclass(frozen=True)
class ValidatorCatch:
    """Which validator rung catches a mode, with what probability per checked group."""

    rung: str          # "regrade" (every sampled group) or "logprob" (the prefill rung, rate**2)
    p_detect: float
    needs_moved_policy: bool = False   # indistinguishable while the lease's version is 0 (the base model)


VALIDATOR_CAUGHT: dict[str, ValidatorCatch] = {
    INFLATED_REWARD: ValidatorCatch("regrade", 1.0),
    FABRICATED_LOGPROBS: ValidatorCatch("logprob", 1.0),
    RANDOM_TOKENS: ValidatorCatch("logprob", 1.0),
    COPYCAT: ValidatorCatch("logprob", 1.0),
    BASE_MODEL_ONLY: ValidatorCatch("logprob", 1.0, needs_moved_policy=True),
    STALE_VERSION: ValidatorCatch("logprob", 1.0, needs_moved_policy=True),
}

_LIMITS = adm.AdmissionLimits(group_size=2, vocab_size=1000, max_prompt_tokens=64, max_new_tokens=64,
                              reward_range=(0.0, 1.0), num_reward_funcs=1, max_async_level=0)
_PROMPT = [1, 2, 3]


def limits(max_async_level: int) -> adm.AdmissionLimits:
    """Admission limits of the simulated job (only the staleness window varies)."""
    return adm.AdmissionLimits(**{**_LIMITS.__dict__, "max_async_level": max_async_level})


def _completion(mode: str, version: int) -> pb.Completion:
    logprob = math.nan if mode == NAN_LOGPROBS else -0.5
    if mode == FORGED_ENV_REPLY:   # the simulated job is single-turn: the last token claimed as the environment's
        return pb.Completion(token_ids=[7, 8], logprobs=[-0.5, 0.0], token_mask=[MODEL, ENV], finish_reason="stop",
                             policy_version=version, reward=1.0, rewards=[1.0])
    return pb.Completion(token_ids=[7, 8], logprobs=[-0.5, logprob], finish_reason="stop", policy_version=version,
                         reward=1.0, rewards=[1.0])


def group_reason(mode: str, lease: pb.Lease, index: int, current_version: int, lim: adm.AdmissionLimits) -> str:
    """Admission's verdict ("" admitted, else the reason) on the group a worker in `mode` returns
    for prompt `index` of `lease`: a two-completion stand-in carrying what the mode doctors.

    `adm.check_group` reads of the lease only its policy version and whether `index` is one of its
    prompts, so the verdict is a function of (mode, lease version, leased or not, current version,
    limits): the real check runs once per distinct key (`_verdict`, memoised), not per group."""
    return _verdict(mode, lease.policy_version, index in lease.prompt_indices, current_version, lim)


@functools.lru_cache(maxsize=1 << 14)
def _verdict(mode: str, lease_version: int, leased: bool, current_version: int, lim: adm.AdmissionLimits) -> str:
    """`adm.check_group` on the stand-in group for prompt 0 of a lease at `lease_version` that
    holds prompt 0 when `leased`, else only prompt 1."""
    lease = pb.Lease(policy_version=lease_version, prompt_indices=[0 if leased else 1])
    prompt = [9, 9] if mode == PROMPT_SWAP else _PROMPT
    group = pb.Group(prompt_index=0, prompt_token_ids=prompt,
                     completions=[_completion(mode, lease_version)] * lim.group_size)
    return adm.check_group(group, lease, current_version=current_version,
                           expected_prompt_ids={i: _PROMPT for i in lease.prompt_indices},
                           already_admitted=(), lim=lim)


def batch_reason(peer_id: str, lease: pb.Lease | None, job_id: str, *, now_ms: int, seen: bool,
                 banned: set[str]) -> str:
    """Admission's batch-level verdict (signature already verified)."""
    batch = pb.RolloutBatch(job_id=job_id, peer_id=peer_id, lease_id=lease.lease_id if lease else "")
    return adm.check_batch_envelope(batch, peer_id, lease, now_ms=now_ms, batch_seen=seen, banned=banned)


def validator_detects(mode: str, lease_version: int) -> ValidatorCatch | None:
    """The rung that would catch a checked group of `mode` at this lease version, or None."""
    catch = VALIDATOR_CAUGHT.get(mode)
    if catch is None or (catch.needs_moved_policy and lease_version == 0):
        return None
    return catch
