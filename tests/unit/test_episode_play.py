"""Episodes end to end on the tiny model: the worker plays wordle and calculator episodes, the
traces pass admission, the validator replays them (an honest batch passes every rung, a forged
environment reply fails `episode`), the learner trains on model tokens only, and a failing
environment ends its episode without stopping the others."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import peft
import pytest
import torch

from swarmrl.node.inference.base import Sampling
from swarmrl.node.inference.hf import PLACEHOLDER_ADAPTER, HFBackend
from swarmrl.node.models.causal_lm import lora_config
from swarmrl.node.tasks.episode_play import (
    encode_observation,
    grade_rows,
    play_episodes,
    scripted,
    turn_texts,
)
from swarmrl.node.tasks.grading import GradingPool
from swarmrl.node.trainer.learner import build_step_batch
from swarmrl.node.worker.episodes import episode_groups
from swarmrl.node.worker.red_team import FORGED_REPLY, forge_env_replies
from swarmrl.protocol import admission as adm
from swarmrl.protocol import signing
from swarmrl.protocol.envs import get_environment
from swarmrl.protocol.envs.base import PromptSpec
from swarmrl.protocol.envs.episode import EpisodeEnv, EpisodeSpec, Reply
from swarmrl.protocol.episode_limits import job_limits
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec, LoraSpec, SamplingSpec
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.verdicts import ALL, EPISODE
from swarmrl.validator.adapters import InMemoryAdapters
from swarmrl.validator.reputation import Reputation
from swarmrl.validator.seen import SeenStore
from swarmrl.validator.validator import Validator, ValidatorSettings
from tests.unit.test_validator_ladder import tiny_model

JOB = "job-episodes"
G = 3
ALICE = Identity.from_seed(b"e" * 32)


@dataclass
class World:
    backend: HFBackend
    adapters: InMemoryAdapters


@pytest.fixture(scope="module")
def world() -> World:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    model, tokenizer = tiny_model()
    backend = HFBackend(model, tokenizer, lora_config(4, 8))
    template = peft.get_peft_model_state_dict(backend.model, adapter_name=PLACEHOLDER_ADAPTER)
    gen = torch.Generator().manual_seed(1)
    v0 = {k: 0.1 * torch.randn(v.shape, generator=gen) if "lora_A" in k else torch.zeros(v.shape)
          for k, v in template.items()}
    backend.set_adapter("worker", v0)
    return World(backend, InMemoryAdapters(JOB, {0: v0}))


def job(env: str, stop: tuple[str, ...], version: str = "1") -> JobSpec:
    return JobSpec(base_model="tiny", base_model_sha256="0" * 64, environment=env, env_version=version, seed=3,
                   group_size=G, max_prompt_tokens=512, lora=LoraSpec(rank=4, alpha=8),
                   sampling=SamplingSpec(temperature=1.0, max_new_tokens=6, stop=stop),
                   episode=EpisodeSpec(max_turns=3, max_tokens=40, max_observation_tokens=16))


def play(w: World, spec: JobSpec, indices: Sequence[int], pool: GradingPool) -> list[pb.Group]:
    env = get_environment(spec.environment)  # type: ignore[arg-type]
    assert isinstance(env, EpisodeEnv)
    prompts = env.prompts(spec.seed, indices)
    lease = pb.Lease(sampling=pb.SamplingParams(n=G, max_new_tokens=spec.sampling.max_new_tokens,
                                                temperature=1.0, top_p=1.0, stop=list(spec.sampling.stop)))
    groups = episode_groups(w.backend, spec, env, prompts, lease, adapter="worker", policy_version=0)
    for p, g in zip(prompts, groups, strict=True):
        texts, infos = grade_rows(w.backend.tokenizer, env, p, g)
        for c, grade in zip(g.completions, pool.grade([p.text] * len(texts), texts, infos), strict=True):
            assert grade.error == "", grade.error
            c.rewards.extend(r if r is not None else float("nan") for r in grade.rewards)
            c.reward = grade.reward if grade.reward is not None else float("nan")
    return groups


def admitted(groups: list[pb.Group], seq: int) -> pb.AdmittedBatch:
    lease = pb.Lease(lease_id=f"lease-{seq}", job_id=JOB, peer_id=ALICE.peer_id,
                     prompt_indices=[g.prompt_index for g in groups], policy_version=0)
    batch = pb.RolloutBatch(job_id=JOB, lease_id=lease.lease_id, peer_id=ALICE.peer_id, groups=groups,
                            created_ms=1, nonce=os.urandom(8))
    return pb.AdmittedBatch(seq=seq, batch=signing.sign(ALICE, signing.ROLLOUT_BATCH, batch), lease=lease,
                            admitted_prompt_indices=[g.prompt_index for g in groups])


@pytest.fixture(scope="module", params=[("wordle", ("\n",)), ("calculator", ("</calc>", "\n")),
                                        ("vf_guess", ("\n",), "0.1.0")], ids=lambda p: p[0])
def episodes(request: pytest.FixtureRequest, world: World) -> Iterator[tuple[JobSpec, list[pb.Group]]]:
    if request.param[0] == "vf_guess":   # a verifiers MultiTurnEnv (tests/fixtures/vf_guess); skips without verifiers
        request.getfixturevalue("vf_guess_site")
    spec = job(*request.param)
    with GradingPool(spec.environment_id, spec.env_version, timeout_s=20.0) as pool:
        yield spec, play(world, spec, [0, 1], pool)


def test_traces_are_token_exact_and_admissible(world: World, episodes: tuple[JobSpec, list[pb.Group]]) -> None:
    spec, groups = episodes
    env = get_environment(spec.environment)  # type: ignore[arg-type]
    lim = job_limits(spec, env, world.backend.vocab_size)
    assert lim.max_turns == 3 and lim.max_new_tokens == 40
    tok = world.backend.tokenizer
    multi = 0
    for g in groups:
        assert adm.check_group(g, pb.Lease(policy_version=0), current_version=0,
                               expected_prompt_ids={g.prompt_index: list(g.prompt_token_ids)},
                               already_admitted=(), lim=lim) == ""
        for c in g.completions:
            assert len(c.token_mask) == len(c.token_ids) == len(c.logprobs) and c.turns >= 1
            assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.token_mask, strict=True) if m == 0)
            multi += c.turns > 1
            turns = turn_texts(tok, c)
            prompt = env.prompt(spec.seed, g.prompt_index)
            # every environment span is the environment's reply to the turns before it
            start = 0
            for k, (m, ids) in enumerate(_env_spans(c)):
                reply = env.reply(prompt, turns[:k + 1])  # type: ignore[attr-defined]
                assert ids == encode_observation(tok, reply.observation)[:16], (m, start)
    assert multi > 0 or spec.environment == "calculator"   # random tiny model: wordle goes on, calculator ends


def _env_spans(c: pb.Completion) -> list[tuple[int, list[int]]]:
    from swarmrl.protocol.envs.trace import ENV, spans

    return [(lo, list(c.token_ids[lo:hi])) for m, lo, hi in spans(list(c.token_mask)) if m == ENV]


def test_validator_passes_honest_episodes_and_catches_a_forged_reply(
        world: World, episodes: tuple[JobSpec, list[pb.Group]]) -> None:
    spec, groups = episodes
    pool = GradingPool(spec.environment_id, spec.env_version, timeout_s=20.0)
    v = Validator(world.backend, seen=SeenStore(":memory:"), reputation=Reputation(":memory:"),
                  sampling_key=b"k" * 32, settings=ValidatorSettings(base_rate=1.0),
                  grader_factory=lambda name, version: pool)
    try:
        honest = v.validate_batch(admitted([_copy(g) for g in groups], 1), spec, job_id=JOB, head_version=0,
                                  adapters=world.adapters)
        assert [(x.passed, x.check) for x in honest] == [(True, ALL)] * len(groups), [x.detail for x in honest]
        assert "episode" in honest[0].detail and "logprob" in honest[0].detail
        forged = [_copy(g) for g in groups]
        if forge_env_replies(forged, encode_observation(world.backend.tokenizer, FORGED_REPLY)) == 0:
            assert spec.environment == "calculator"   # the random tiny model never calls the tool
            return
        verdicts = v.validate_batch(admitted(forged, 2), spec, job_id=JOB, head_version=0, adapters=world.adapters)
        failed = [x for x in verdicts if not x.passed]
        assert failed and all(x.check == EPISODE for x in failed), [(x.check, x.detail) for x in verdicts]
    finally:
        v.close()
        pool.close()


def test_learner_masks_environment_tokens(episodes: tuple[JobSpec, list[pb.Group]]) -> None:
    spec, groups = episodes
    batch = build_step_batch(groups, spec.model_copy(update={"loss": spec.loss.model_copy(
        update={"drop_zero_variance_groups": False})}), current_version=0)
    flat = [c for g in groups for c in g.completions]
    for i, c in enumerate(flat):
        n = len(c.token_ids)
        assert batch.mask_BT[i, :n].tolist() == [m == 1 for m in c.token_mask]
        assert not batch.mask_BT[i, n:].any()
        assert batch.completion_ids[i] == list(c.token_ids)   # the stored ids, never re-tokenized


class _Broken(EpisodeEnv):
    name, version = "broken", "1"
    reward_funcs, reward_weights, reward_range = (), (), (0.0, 1.0)
    regrade_tolerance, stop, max_new_tokens = 1e-6, ("\n",), 4

    def prompt(self, seed: int, index: int) -> PromptSpec:
        return PromptSpec(index=index, text=f"Episode {index}:")

    def reply(self, spec: PromptSpec, turns: Sequence[str]) -> Reply:
        if spec.index == 1:
            raise RuntimeError("the tool crashed")
        return Reply(" ok\n", done=False)


def test_an_environment_that_raises_ends_only_its_own_episodes(world: World) -> None:
    env = _Broken()
    tok = world.backend.tokenizer
    specs = [env.prompt(0, 0), env.prompt(0, 1)]
    ids = [tok(s.text).input_ids for s in specs]
    traces = play_episodes(lambda c, s: world.backend.generate(c, s, adapter="worker"), tok, env, specs, ids, n=2,
                           sampling=Sampling(n=1, max_new_tokens=3, seed=1),
                           limits=EpisodeSpec(max_turns=3, max_tokens=64, max_observation_tokens=16))
    assert all(t.turns == 3 for t in traces[0])   # the healthy episodes play to the turn limit
    for t in traces[1]:
        assert t.turns == 1 and t.finish_reason == "stop"
        assert "environment error: RuntimeError: the tool crashed" in t.observations[-1]


def _copy(g: pb.Group) -> pb.Group:
    out = pb.Group()
    out.CopyFrom(g)
    return out


@pytest.mark.parametrize("name", ["wordle", "calculator"])
def test_the_scripted_player_solves_in_two_turns(world: World, name: str) -> None:
    env = get_environment(name)
    assert isinstance(env, EpisodeEnv)
    tok = world.backend.tokenizer
    specs = env.prompts(0, [0, 1])
    traces = play_episodes(lambda c, s: [], tok, env, specs, [tok(s.text).input_ids for s in specs], n=2,
                           sampling=Sampling(n=1, max_new_tokens=8), script=scripted(tok, env),
                           limits=EpisodeSpec(max_turns=6, max_tokens=200, max_observation_tokens=16))
    for spec, group in zip(specs, traces, strict=True):
        for t in group:
            assert t.turns == 2 and t.finish_reason == "stop" and len(t.observations) == 1
            assert env.solved(spec.info, t.turn_texts)
    if name == "calculator":
        assert traces[0][0].observations[0] == f" = {specs[0].info['answer']}"


def test_shared_first_observation_prefill_scores_episodes_as_full_prefills(
        world: World, episodes: tuple[JobSpec, list[pb.Group]]) -> None:
    """The trainer's and validator's shared-prompt prefill: a group's G episodes share their first
    observation, prefilled once; the stored trace ids are scored as they are."""
    from swarmrl.node.inference.scoring import completion_logprobs, shared_prompt_logprobs

    _, groups = episodes
    prompts = [list(g.prompt_token_ids) for g in groups for _ in g.completions]
    traces = [list(c.token_ids) for g in groups for c in g.completions]
    pad = world.backend.pad_token_id
    with torch.no_grad(), world.backend.activated("worker") as model:
        shared_BT, mask_BT = shared_prompt_logprobs(model, prompts, traces, temperature=1.0, pad_id=pad)
        full_BT, _ = completion_logprobs(model, prompts, traces, temperature=1.0, pad_id=pad)
    assert torch.allclose(shared_BT[mask_BT], full_BT[mask_BT], atol=1e-5)
    flat = [c for g in groups for c in g.completions]
    for i, c in enumerate(flat):   # the sampler's log-probs of model tokens are reproduced
        model_T = torch.tensor([m == 1 for m in c.token_mask])
        got = shared_BT[i, :len(c.token_ids)][model_T]
        assert torch.allclose(got, torch.tensor(list(c.logprobs))[model_T], atol=1e-4)


@pytest.mark.parametrize("job", ["wordle_tiny.toml", "calculator_tiny.toml"])
def test_env_check_renders_one_full_episode_with_masked_tokens(job: str, model_cache, capsys) -> None:
    from pathlib import Path

    from swarmrl.node.cli.env import env_check

    path = Path(__file__).resolve().parents[1] / "fixtures" / "jobs" / job
    assert env_check(path, "tiny", model_cache) == 0
    out = capsys.readouterr().out
    assert "episode of prompt 0 (scripted player)" in out and "; solved True" in out
    assert "environment tokens ⟦masked⟧" in out and "mask 1" in out and "0" in out.split("mask ")[-1]
