"""`Validator.validate_batch` end to end on the tiny model: an honest batch passes every rung, and
each doctored batch fails the rung meant to catch it.

The model is built here (the tiny recipe's tokenizer, a 2-layer Llama from a fixed seed) with an
init scale that gives moderately peaked next-token distributions (mean sampled log-prob ~ -2.4):
near-uniform ones would make random tokens plausible samples, near-deterministic ones would make
greedy decoding indistinguishable from sampling. One backend plays both the worker (slot
"worker", generating with version 1) and the validator (slot = the job id).
Legend: G = completions per group.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import peft
import pytest
import torch
import transformers

from swarmrl.node.inference.base import Sampling
from swarmrl.node.inference.hf import PLACEHOLDER_ADAPTER, HFBackend
from swarmrl.node.models.causal_lm import encode_prompt, lora_config
from swarmrl.node.models.recipes import build_tiny_tokenizer
from swarmrl.node.net.grpc_options import channel_options
from swarmrl.node.runtime.config import ValidatorConfig
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.node.tasks.grading import GradingPool
from swarmrl.node.trainer.adapter_store import AdapterStore
from swarmrl.protocol import signing
from swarmrl.protocol.envs import get_environment
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec, LoraSpec, SamplingSpec
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc
from swarmrl.protocol.updates import chunks
from swarmrl.protocol.verdicts import ALL, DUPLICATE, FRESHNESS, LOGPROB, PLAUSIBILITY, REGRADE, STRUCTURE
from swarmrl.validator import checks as ck
from swarmrl.validator.adapters import InMemoryAdapters
from swarmrl.validator.reputation import Reputation
from swarmrl.validator.rescoring import rescore
from swarmrl.validator.seen import SeenStore
from swarmrl.validator.service import ValidatorService
from swarmrl.validator.validator import Validator, ValidatorSettings

JOB = "job-ladder"
G = 4
MAX_NEW = 24      # honest sampling
GREEDY_NEW = 64   # greedy is told apart from sampling by its length: ~0.8 nats of evidence per token here
ALICE, BOB = Identity.from_seed(b"a" * 32), Identity.from_seed(b"b" * 32)


@dataclass
class World:
    backend: HFBackend
    spec: JobSpec
    env: object
    adapters: InMemoryAdapters
    pool: GradingPool
    honest: dict[int, pb.Group]


def tiny_model() -> tuple[transformers.LlamaForCausalLM, transformers.PreTrainedTokenizerFast]:
    tokenizer = build_tiny_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, tie_word_embeddings=True, initializer_range=0.4, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval(), tokenizer


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    model, tokenizer = tiny_model()
    backend = HFBackend(model, tokenizer, lora_config(4, 8))
    spec = JobSpec(base_model="tiny", base_model_sha256="0" * 64, seed=7, group_size=G,
                   max_async_level=2, lora=LoraSpec(rank=4, alpha=8),
                   sampling=SamplingSpec(temperature=1.0, max_new_tokens=GREEDY_NEW, stop=()))
    template = peft.get_peft_model_state_dict(backend.model, adapter_name=PLACEHOLDER_ADAPTER)
    gen = torch.Generator().manual_seed(0)
    # LoRA's init (A random, B zero), drawn from our own generator so every run sees the same model
    v0 = {k: 0.1 * torch.randn(v.shape, generator=gen) if "lora_A" in k else torch.zeros(v.shape)
          for k, v in template.items()}
    v1 = {k: v + (0.05 * torch.randn(v.shape, generator=gen) if "lora_B" in k else 0) for k, v in v0.items()}
    backend.set_adapter("worker", v1)
    env = get_environment(spec.environment, spec.env_version)
    w = World(backend, spec, env, InMemoryAdapters(JOB, {0: v0, 1: v1}),
              GradingPool(spec.environment, spec.env_version, timeout_s=10.0), {})
    w.honest = {i: sample_group(w, i, seed=100 + i) for i in range(4)}
    yield w
    w.pool.close()


def prompt_ids(w: World, index: int) -> list[int]:
    return encode_prompt(w.backend.tokenizer, w.env.prompt(w.spec.seed, index).text)


def graded(w: World, index: int, token_ids: list[int], logprobs: list[float], finish: str, version: int = 1) -> pb.Completion:
    """A completion as an honest worker records it (rewards computed in-process)."""
    text = w.backend.tokenizer.decode(token_ids, skip_special_tokens=True)
    rewards = w.env.rewards([w.env.prompt(w.spec.seed, index)], [text])[0]
    total = w.env.total(rewards)
    return pb.Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=finish, policy_version=version,
                         rewards=[math.nan if r is None else r for r in rewards],
                         reward=math.nan if total is None else total, grade_error="" if total is not None else "none")


def sample_group(w: World, index: int, *, seed: int, temperature: float = 1.0, max_new: int = MAX_NEW) -> pb.Group:
    ids = prompt_ids(w, index)
    n = G if temperature > 0 else 1
    out = w.backend.generate([ids], Sampling(n=n, max_new_tokens=max_new, temperature=temperature, seed=seed),
                             adapter="worker")[0]
    comps = [graded(w, index, c.token_ids, c.logprobs, c.finish_reason) for c in out]
    return pb.Group(prompt_index=index, prompt_token_ids=ids, completions=(comps * G)[:G])


def admitted(worker: Identity, groups: list[pb.Group], seq: int, *, lease_version: int = 1) -> pb.AdmittedBatch:
    lease = pb.Lease(lease_id=f"lease-{seq}-{worker.peer_id[:6]}", job_id=JOB, peer_id=worker.peer_id,
                     prompt_indices=[g.prompt_index for g in groups], policy_version=lease_version)
    batch = pb.RolloutBatch(job_id=JOB, lease_id=lease.lease_id, peer_id=worker.peer_id, groups=groups,
                            created_ms=1, nonce=os.urandom(8))
    return pb.AdmittedBatch(seq=seq, batch=signing.sign(worker, signing.ROLLOUT_BATCH, batch), lease=lease,
                            admitted_prompt_indices=[g.prompt_index for g in groups])


def copy(g: pb.Group) -> pb.Group:
    out = pb.Group()
    out.CopyFrom(g)
    return out


@pytest.fixture()
def validator(world: World) -> Validator:
    return Validator(world.backend, seen=SeenStore(":memory:"), reputation=Reputation(":memory:"),
                     sampling_key=b"k" * 32, settings=ValidatorSettings(base_rate=0.25),
                     grader_factory=lambda name, version: world.pool)


def judge(v: Validator, w: World, batch: pb.AdmittedBatch, head: int = 1) -> list[pb.Verdict]:
    return v.validate_batch(batch, w.spec, job_id=JOB, head_version=head, adapters=w.adapters)


def only_failure(verdicts: list[pb.Verdict], check: str) -> pb.Verdict:
    failed = [v for v in verdicts if not v.passed]
    assert failed and all(v.check == check for v in failed), [(v.check, v.detail) for v in verdicts]
    return failed[0]


# ---- honest ------------------------------------------------------------------------------------

def test_honest_batch_passes_every_rung(world: World, validator: Validator) -> None:
    verdicts = judge(validator, world, admitted(ALICE, [copy(world.honest[0]), copy(world.honest[1])], seq=1))
    assert [(v.prompt_index, v.passed, v.check) for v in verdicts] == [(0, True, ALL), (1, True, ALL)]
    assert all(v.peer_id == ALICE.peer_id and v.job_id == JOB for v in verdicts)
    assert "logprob" in verdicts[0].detail and "plausibility" in verdicts[0].detail
    rec = validator.reputation.peer(ALICE.peer_id)
    assert rec is not None and (rec.checked, rec.passed) == (2, 2)


# ---- structure ---------------------------------------------------------------------------------

def test_forged_signature_fails_structure_and_blames_nobody(world: World, validator: Validator) -> None:
    batch = admitted(ALICE, [copy(world.honest[0])], seq=2)
    sig = bytearray(batch.batch.signature)
    sig[0] ^= 1
    batch.batch.signature = bytes(sig)
    verdict = only_failure(judge(validator, world, batch), STRUCTURE)
    assert "bad_signature" in verdict.detail
    assert validator.reputation.peer(ALICE.peer_id) is None


def test_swapped_prompt_fails_structure(world: World, validator: Validator) -> None:
    g = copy(world.honest[0])
    g.prompt_token_ids[:] = prompt_ids(world, 3)
    verdict = only_failure(judge(validator, world, admitted(ALICE, [g], seq=3)), STRUCTURE)
    assert "prompt_mismatch" in verdict.detail


# ---- regrade -----------------------------------------------------------------------------------

def test_inflated_reward_fails_regrade(world: World, validator: Validator) -> None:
    g = copy(world.honest[1])
    lo, hi = world.env.reward_range
    c = g.completions[0]
    c.reward = hi if c.reward < hi - 0.5 else lo
    verdict = only_failure(judge(validator, world, admitted(ALICE, [g], seq=4)), REGRADE)
    assert "completion 0" in verdict.detail


# ---- logprob and plausibility ------------------------------------------------------------------

def test_fabricated_logprobs_fail_logprob(world: World, validator: Validator) -> None:
    g = copy(world.honest[2])
    for c in g.completions:
        c.logprobs[:] = [-0.05] * len(c.token_ids)
    only_failure(judge(validator, world, admitted(ALICE, [g], seq=5)), LOGPROB)


def test_random_tokens_with_true_logprobs_fail_plausibility(world: World, validator: Validator) -> None:
    """A cheater that skips generation but fills in the model's real log-probs (one prefill)."""
    gen = torch.Generator().manual_seed(5)
    ids = prompt_ids(world, 2)
    tokens = [torch.randint(4, world.backend.vocab_size, (MAX_NEW,), generator=gen).tolist() for _ in range(G)]
    with world.backend.activated("worker") as model:
        true = rescore(model, [ids] * G, tokens, temperature=1.0, pad_id=world.backend.pad_token_id)
    comps = [graded(world, 2, t, r.logprobs_T.tolist(), "length") for t, r in zip(tokens, true, strict=True)]
    g = pb.Group(prompt_index=2, prompt_token_ids=ids, completions=comps)
    verdict = only_failure(judge(validator, world, admitted(ALICE, [g], seq=6)), PLAUSIBILITY)
    assert "unlikely" in verdict.detail


def test_greedy_passed_off_as_sampling_fails_plausibility(world: World, validator: Validator) -> None:
    greedy = sample_group(world, 0, seed=0, temperature=0.0, max_new=GREEDY_NEW)
    assert len(greedy.completions[0].token_ids) >= 48
    verdict = only_failure(judge(validator, world, admitted(ALICE, [greedy], seq=7)), PLAUSIBILITY)
    assert "predictable" in verdict.detail


# ---- freshness ---------------------------------------------------------------------------------

def test_future_stale_and_unpublished_versions_fail_freshness(world: World, validator: Validator) -> None:
    future = copy(world.honest[0])
    for c in future.completions:
        c.policy_version = 2
    assert "did not exist" in only_failure(judge(validator, world, admitted(ALICE, [future], seq=8), head=1), FRESHNESS).detail
    below = copy(world.honest[0])
    for c in below.completions:
        c.policy_version = 0
    only_failure(judge(validator, world, admitted(ALICE, [below], seq=9), head=1), FRESHNESS)
    unpublished = copy(world.honest[1])
    for c in unpublished.completions:
        c.policy_version = 3  # <= the head the trainer reports, but it serves no such version
    verdict = only_failure(judge(validator, world, admitted(ALICE, [unpublished], seq=10), head=3), FRESHNESS)
    assert "never published" in verdict.detail


# ---- duplicate ---------------------------------------------------------------------------------

def test_copied_group_fails_duplicate_and_the_first_keeps_the_credit(world: World, validator: Validator) -> None:
    original = admitted(ALICE, [copy(world.honest[3])], seq=11)
    assert all(v.passed for v in judge(validator, world, original))
    verdict = only_failure(judge(validator, world, admitted(BOB, [copy(world.honest[3])], seq=12)), DUPLICATE)
    assert verdict.peer_id == BOB.peer_id and ALICE.peer_id[:12] in verdict.detail and "seq 11" in verdict.detail
    assert all(v.passed for v in judge(validator, world, original))  # judging the original again: still first


# ---- sampling ----------------------------------------------------------------------------------

def test_trusted_peers_are_sampled_but_cheap_rungs_run_on_everything(world: World, validator: Validator) -> None:
    for _ in range(300):
        validator.reputation.record(ALICE.peer_id, passed=True, check=ALL, now_ms=0)
    spec = world.spec.model_copy(update={"validation_rate": 0.0})
    validator.settings = ValidatorSettings(base_rate=0.0)
    honest = validator.validate_batch(admitted(ALICE, [copy(world.honest[i]) for i in range(4)], seq=13), spec,
                                      job_id=JOB, head_version=1, adapters=world.adapters)
    assert len(honest) <= 1 and all(v.passed for v in honest)
    g = copy(world.honest[0])
    g.prompt_token_ids[:] = prompt_ids(world, 3)
    swapped = validator.validate_batch(admitted(ALICE, [g], seq=14), spec, job_id=JOB, head_version=1,
                                       adapters=world.adapters)
    only_failure(swapped, STRUCTURE)


# ---- one service round over gRPC ---------------------------------------------------------------

class FakeTrainer(pb_grpc.TrainerServicer):
    """The trainer RPCs a validator calls, over in-memory batches and a real adapter store."""

    def __init__(self, batches: list[pb.AdmittedBatch], store: AdapterStore, head: int) -> None:
        self.batches, self.store, self.head = batches, store, head
        self.reports: list[tuple[pb.VerdictReport, str]] = []
        self.on_report: Callable[[], None] = lambda: None   # called as each report arrives

    def SampleAdmitted(self, request: pb.SampleRequest, context: grpc.ServicerContext) -> Iterator[pb.AdmittedBatch]:
        yield from [b for b in self.batches if b.seq > request.after_seq][: request.max_batches]

    def GetJobStatus(self, request: pb.JobStatusRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        return pb.JobStatus(job_id=request.job_id, state="running", policy_version=self.head)

    def FetchAdapter(self, request: pb.AdapterRequest, context: grpc.ServicerContext) -> Iterator[pb.AdapterChunk]:
        want = request.want_version or self.head
        snap = self.store.snapshot(want) if request.snapshot and want <= self.head else None
        if snap is not None:
            yield from chunks(snap.header, snap.payload)

    def ReportVerdicts(self, request: pb.Signed, context: grpc.ServicerContext) -> pb.VerdictAck:
        report, signer = signing.open_signed(request, signing.VERDICTS, pb.VerdictReport)
        self.reports.append((report, signer))
        self.on_report()
        return pb.VerdictAck(accepted=len(report.verdicts),
                             banned=sorted({v.peer_id for v in report.verdicts if not v.passed}))


@contextlib.contextmanager
def _service_and_trainer(world: World, tmp_path: Path) -> Iterator[tuple[ValidatorService, FakeTrainer, list, str]]:
    """A validator service following a fake trainer that holds two admitted batches (seq 1: Alice's
    honest group; seq 2: Bob's copy of it, a duplicate) at head v1."""
    trainer = Identity.from_seed(b"t" * 32)
    # lossless: the world's rollouts were sampled with v1 itself, not a quantised v1
    store = AdapterStore(tmp_path / "adapters", JOB, trainer, codec="float32")
    v0, _ = world.adapters.state(0)
    v1, _ = world.adapters.state(1)
    store.put_snapshot(0, v0)
    store.publish(1, v0, v1)
    fake = FakeTrainer([admitted(ALICE, [copy(world.honest[0])], seq=1), admitted(BOB, [copy(world.honest[0])], seq=2)],
                       store, head=1)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=channel_options(16))
    pb_grpc.add_TrainerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    cfg = ValidatorConfig(key=tmp_path / "validator.key", state_dir=tmp_path / "state", cache_dir=tmp_path / "models")
    service = ValidatorService(cfg, Identity.load_or_create(cfg.key))
    try:
        service.validators[world.spec.base_model_sha256] = Validator(
            world.backend, seen=service.seen, reputation=service.reputation, sampling_key=service.sampling_key,
            settings=service.settings, grader_factory=lambda name, version: world.pool)
        record = pb.JobRecord(job_id=JOB, trainer_id=trainer.peer_id, endpoint=f"127.0.0.1:{port}", base_model="tiny",
                              base_model_sha256=bytes.fromhex(world.spec.base_model_sha256), head_version=1,
                              spec_json=world.spec.canonical_json(), trainer_public_key=trainer.public_key)
        yield service, fake, [VerifiedRecord(record, trainer.peer_id, trainer.public_key)], trainer.peer_id
    finally:
        service.validators.clear()  # the pool belongs to the module fixture
        service.close()
        server.stop(None)


def test_service_round_reports_signed_verdicts_and_advances(world: World, tmp_path: Path) -> None:
    with _service_and_trainer(world, tmp_path) as (service, fake, found, trainer_id):
        assert service.poll(found) == 2
        assert [signer for _, signer in fake.reports] == [service.identity.peer_id] * 2
        got = [(v.peer_id, v.passed, v.check) for report, _ in fake.reports for v in report.verdicts]
        assert got == [(ALICE.peer_id, True, ALL), (BOB.peer_id, False, DUPLICATE)]
        assert service.seen.cursor(JOB, trainer_id) == 2
        assert service.poll(found) == 0 and len(fake.reports) == 2


def test_a_stop_ends_the_round_after_the_batch_being_judged_and_loses_nothing(world: World, tmp_path: Path) -> None:
    """SIGTERM mid-round (the role's stop event): the batch being judged is reported and its cursor
    stored, the next one waits for the next start (a round of many batches must not outlast the
    shutdown grace at a load of 8)."""
    stop = threading.Event()
    with _service_and_trainer(world, tmp_path) as (service, fake, found, trainer_id):
        fake.on_report = stop.set   # SIGTERM arrives while the first batch's verdicts are on the wire
        assert service.poll(found, stop) == 1
        assert [v.peer_id for r, _ in fake.reports for v in r.verdicts] == [ALICE.peer_id]
        assert service.seen.cursor(JOB, trainer_id) == 1
        assert service.poll(found, stop) == 0                 # stopped: nothing more is judged
        assert service.poll(found) == 1 and service.seen.cursor(JOB, trainer_id) == 2   # the rest, next time


# ---- content-addressed versions ------------------------------------------------------------------

def test_a_group_naming_its_adapter_hash_passes_and_one_naming_a_replaced_adapter_is_undecided(
        world: World, validator: Validator) -> None:
    """Completions name the adapter they were sampled with (`adapter_hash`). Named right, the
    ladder runs as before; naming another hash for the version (the trainer published it, admitted
    the batch, then replaced the version by a cotrainer's) gives no verdict at all, not a failure:
    nobody serves that adapter any more (an honest worker banned for it was the bug)."""
    _, v1_hash = world.adapters.state(1)
    named = copy(world.honest[0])
    for c in named.completions:
        c.adapter_hash = v1_hash
    verdicts = judge(validator, world, admitted(ALICE, [named], seq=30))
    assert [(v.passed, v.check) for v in verdicts] == [(True, ALL)]
    replaced = copy(world.honest[1])
    for c in replaced.completions:
        c.adapter_hash = bytes(32)   # any other hash: what the trainer held before the split
    assert judge(validator, world, admitted(ALICE, [replaced], seq=31)) == []
    rec = validator.reputation.peer(ALICE.peer_id)
    assert rec is not None and (rec.checked, rec.passed) == (1, 1)


def test_a_float32_validator_keeps_the_tolerance_of_the_dtype_workers_sample_in(world: World, monkeypatch) -> None:
    """On a CPU without native bf16 the validator loads a bf16 model in float32 (`device.py`); honest
    workers elsewhere sample in bf16, so its log-prob rung keeps bf16's honest floor, not float32's."""
    assert world.backend.dtype == torch.float32
    def make() -> Validator:
        return Validator(world.backend, seen=SeenStore(":memory:"), reputation=Reputation(":memory:"),
                         sampling_key=b"k" * 32, grader_factory=lambda name, version: world.pool)
    assert make().logprob_tolerance.mean_abs < ck.HONEST_MEAN_FLOOR["bfloat16"]   # the configured one
    monkeypatch.setattr(world.backend, "sampled_dtype", torch.bfloat16)
    assert make().logprob_tolerance.mean_abs == ck.HONEST_MEAN_FLOOR["bfloat16"]
