"""Engine faults in the worker, without a real engine: retries after `recover()` with a 2 s / 4 s
backoff and a give-up on the 3rd failure (node/worker/engine.py); groups with non-finite sampling
log-probs dropped unsigned and counted (JobSession.generate); the HF sampler's NaN-row clamp; a
job whose log-prob convention the backend can't honour skipped as a configuration error."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from swarmrl.node.inference.base import BackendError, SampledCompletion, Sampling
from swarmrl.node.inference.hf import _Sampler
from swarmrl.node.ops.metrics import Families
from swarmrl.node.swarm.catchup import SyncStats
from swarmrl.node.worker.engine import EngineFailed, with_recovery
from swarmrl.node.worker.main import Worker
from swarmrl.node.worker.metrics import session_families
from swarmrl.node.worker.session import JobSession
from swarmrl.node.worker.stats import SessionStats
from swarmrl.protocol.envs import PromptSpec
from swarmrl.protocol.pb import swarm_pb2 as pb


class FlakyBackend:
    """Fails the first `failures` calls with BackendError; counts recoveries."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls, self.recoveries = failures, 0, 0

    def call(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise BackendError(f"server died (call {self.calls})")
        return "ok"

    def recover(self) -> None:
        self.recoveries += 1


def test_a_fault_is_retried_after_recovery() -> None:
    backend, waits, faults = FlakyBackend(1), [], []
    assert with_recovery(backend, backend.call, sleep=waits.append, on_fault=lambda: faults.append(1)) == "ok"  # type: ignore[arg-type]
    assert waits == [2.0] and backend.recoveries == 1 and len(faults) == 1


def test_the_third_failure_gives_up_after_2_then_4_seconds() -> None:
    backend, waits = FlakyBackend(5), []
    with pytest.raises(EngineFailed, match="failed 3 times"):
        with_recovery(backend, backend.call, sleep=waits.append)  # type: ignore[arg-type]
    assert waits == [2.0, 4.0] and backend.calls == 3 and backend.recoveries == 2


def test_request_errors_are_not_engine_faults() -> None:
    def bad() -> None:
        raise ValueError("prompt 0 is empty")

    with pytest.raises(ValueError):
        with_recovery(FlakyBackend(0), bad, sleep=lambda s: None)  # type: ignore[arg-type]


class NaNBackend:
    """Returns one completion per prompt; prompt 1's has a NaN log-prob."""

    tokenizer: Any = None

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, adapter: str | None = None):
        lp = lambda i: [-0.5, math.nan] if i == 1 else [-0.5, -0.25]
        return [[SampledCompletion([5, 6], lp(i), "length", "xy") for _ in range(sampling.n)]
                for i in range(len(prompt_ids))]


def bare_session(backend: Any) -> JobSession:
    session = object.__new__(JobSession)
    session.backend, session.stats, session.loaded_version, session.loaded_hash = backend, SessionStats(), 3, bytes(32)
    session.record = SimpleNamespace(job_id="job-1234567890ab", head_version=3)
    session.spec = SimpleNamespace(chat_template=False)
    session.env = SimpleNamespace()   # a single-turn environment (not an EpisodeEnv)
    return session


def test_groups_with_nonfinite_logprobs_are_dropped_and_counted(monkeypatch) -> None:
    monkeypatch.setattr("swarmrl.node.worker.session.render_prompt", lambda tok, p, chat: [1, 2, p.index + 3])
    session = bare_session(NaNBackend())
    lease = pb.Lease(lease_id="L", sampling=pb.SamplingParams(n=2, max_new_tokens=2, temperature=1.0, top_p=1.0))
    prompts = [PromptSpec(index=i, text=f"p{i}", info={}) for i in range(3)]
    groups = session.generate(prompts, lease)
    assert [g.prompt_index for g in groups] == [0, 2]
    assert session.stats.groups_dropped == {"nonfinite_logprobs": 1}
    f = Families()
    session_families(f, "job", SimpleNamespace(stats=session.stats, record=session.record,
                                               replica=SimpleNamespace(version=3),
                                               sync=SimpleNamespace(stats=SyncStats(), gossip=None)))
    dropped = [s for m in f for s in m.samples if s.name == "swarmrl_worker_groups_dropped_total"]
    assert [(s.labels["reason"], s.value) for s in dropped] == [("nonfinite_logprobs", 1)]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_hf_sampler_clamps_a_nan_row_and_records_nan(temperature: float) -> None:
    sampler = _Sampler(Sampling(n=1, max_new_tokens=1, temperature=temperature, seed=0), torch.device("cpu"))
    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0], [math.nan, 1.0, 0.0, 0.0]])
    forced = sampler(torch.zeros((2, 1), dtype=torch.long), scores)  # type: ignore[arg-type]
    lp = sampler.logprobs(1)[:, 0]
    assert math.isfinite(lp[0].item()) and math.isnan(lp[1].item())
    assert all(int((row == 0).sum()) == 1 for row in forced)   # one forced token per row, in range


def test_a_job_the_backend_cannot_score_is_a_configuration_error() -> None:
    worker = object.__new__(Worker)
    problem = "processed_logprobs at top_p=0.9 can't be converted"
    worker.backends = {"ab" * 32: SimpleNamespace(sampling_problem=lambda t, p: problem if p < 1 else "")}
    rec = SimpleNamespace(record=SimpleNamespace(base_model_sha256=bytes.fromhex("ab" * 32)))
    spec = lambda p: SimpleNamespace(sampling=SimpleNamespace(temperature=1.0, top_p=p))
    assert worker._sampling_problem(rec, spec(0.9)) == f"configuration error: {problem}"  # type: ignore[arg-type]
    assert worker._sampling_problem(rec, spec(1.0)) == ""  # type: ignore[arg-type]


def test_episode_groups_get_the_same_recovery_and_nonfinite_drop(monkeypatch) -> None:
    """Multi-turn jobs go through the engine-fault retry (one 2 s backoff here) and the non-finite
    drop as single-turn ones do."""
    from swarmrl.protocol.envs import get_environment

    calls = []

    def episodes(backend, spec, env, prompts, lease, *, adapter, policy_version, adapter_hash=b""):
        calls.append(1)
        if len(calls) == 1:
            raise BackendError("engine died")
        return [pb.Group(prompt_index=p.index, completions=[pb.Completion(
            token_ids=[5, 6], token_mask=[1, 1], logprobs=[-0.5, math.nan if p.index == 1 else -0.2])])
            for p in prompts]

    monkeypatch.setattr("swarmrl.node.worker.session.episode_groups", episodes)
    backend = SimpleNamespace(recover=lambda: None)
    session = bare_session(backend)
    session.env = get_environment("wordle")
    prompts = [PromptSpec(index=i, text=f"p{i}", info={}) for i in range(3)]
    groups = session.generate(prompts, pb.Lease(lease_id="L", sampling=pb.SamplingParams(n=1)))
    assert len(calls) == 2 and [g.prompt_index for g in groups] == [0, 2]
    assert session.stats.groups_dropped == {"nonfinite_logprobs": 1}
