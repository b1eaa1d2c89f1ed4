"""The validator's judgement of one admitted batch: the ladder of checks -> verdicts -> reputation.

Legend: G = completions of a group, T = tokens of one completion.

`Validator.validate_batch` needs no network: the caller hands it the trainer's `AdmittedBatch`,
the job's spec, the trainer's head version and an `AdapterSource`. Per admitted group:

1. cheap rungs on every group: structure -> freshness -> duplicate (every distinctive
   completion is registered, so the first submitter keeps the credit);
2. with the peer's sample rate (`Reputation.sample_rate`, keyed draw in `sampling.plan_group`):
   regrade, and among those, the prefill rungs logprob + plausibility.

A group gets a verdict when a rung failed (its name is the verdict's check) or when it was
sampled and every rung it ran passed (check "all"). Groups only cheaply checked and clean get no
verdict; neither does a group whose rungs could not decide. Verdicts update the reputation of the
batch's signer; a batch whose signature does not verify is judged (its groups must go) but
counts against nobody, since anyone can put another peer's name on a forged envelope.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmrl.node.inference.base import InferenceBackend
from swarmrl.node.models.causal_lm import render_prompt
from swarmrl.node.tasks.episode_play import grade_rows
from swarmrl.node.tasks.grading import GradingError, GradingPool
from swarmrl.node.tasks.job_file import grader_for
from swarmrl.protocol import signing
from swarmrl.protocol.envs import job_environment
from swarmrl.protocol.envs.base import Environment, Grade
from swarmrl.protocol.envs.episode import EpisodeEnv
from swarmrl.protocol.episode_limits import episode_limits, job_limits
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import VersionNotKept
from swarmrl.protocol.verdicts import ALL, FRESHNESS, LOGPROB, REGRADE
from swarmrl.validator import checks as ck
from swarmrl.validator.adapters import AdapterReplaced, AdapterSource, VersionUnavailable
from swarmrl.validator.episodes import check_replay, model_only, model_stats
from swarmrl.validator.plausibility import DEFAULT_ALPHA, completion_plausibility, log_threshold
from swarmrl.validator.reputation import Reputation
from swarmrl.validator.rescoring import Rescored, rescore
from swarmrl.validator.sampling import GroupPlan, plan_group
from swarmrl.validator.seen import SeenStore
from swarmrl.validator.stats import CheckStats

log = logging.getLogger(__name__)
_PROMPT_CACHE = 4096  # recomputed prompt token ids kept per job


@dataclass(frozen=True)
class ValidatorSettings:
    """Policy knobs (built from `ValidatorConfig` by the service).

    base_rate: floor of the share of groups checked fully (a job's `validation_rate` can raise it).
    logprob: tolerance of the logprob rung, raised to the model dtype's honest floor
        (`checks.HONEST_MEAN_FLOOR`) if below it; None: that floor.
    alpha: false-alarm bound of the plausibility rung, per completion.
    grade_timeout_s: wall-clock limit of one reward-function call.
    """

    base_rate: float = 0.25
    logprob: ck.LogprobTolerance | None = field(default_factory=lambda: ck.LogprobTolerance.from_mean(0.05))
    alpha: float = DEFAULT_ALPHA
    grade_timeout_s: float = 10.0


@dataclass
class _GroupWork:
    """One admitted group on its way up the ladder."""

    group: pb.Group
    plan: GroupPlan
    results: list[ck.CheckResult] = field(default_factory=list)

    @property
    def failed(self) -> ck.CheckResult | None:
        return next((r for r in self.results if not r.passed and r.conclusive), None)

    @property
    def undecided(self) -> bool:
        return any(not r.conclusive for r in self.results)


GraderFactory = Callable[[str, str], GradingPool]


class Validator:
    """Checks admitted rollouts with one loaded base model (one adapter slot per job).

    backend: the base model with its adapter slots (slot name = job id).
    seen / reputation: the validator's stores. sampling_key: secret key of the group draws.
    grader_factory: (environment, version) -> GradingPool; default a pool with the settings'
        timeout. clock_ms: unix milliseconds (tests and simulations pass their own).
    """

    def __init__(
        self,
        backend: InferenceBackend,
        *,
        seen: SeenStore,
        reputation: Reputation,
        sampling_key: bytes,
        settings: ValidatorSettings | None = None,
        grader_factory: GraderFactory | None = None,
        clock_ms: Callable[[], int] | None = None,
    ) -> None:
        self.backend = backend
        self.seen = seen
        self.reputation = reputation
        self.sampling_key = sampling_key
        self.settings = settings or ValidatorSettings()
        dtype = str(backend.dtype).removeprefix("torch.")
        sampled = str(backend.sampled_dtype or backend.dtype).removeprefix("torch.")   # workers elsewhere
        configured = self.settings.logprob or ck.LogprobTolerance.from_mean(min(ck.HONEST_MEAN_FLOOR.values()))
        self.logprob_tolerance = configured.floored(dtype, sampled)
        if self.logprob_tolerance != self.settings.logprob:
            log.info("logprob tolerance %s for a %s model sampled in %s (configured %s)", self.logprob_tolerance,
                     dtype, sampled, self.settings.logprob)
        self.log_threshold = log_threshold(self.settings.alpha)
        self._grader_factory = grader_factory or (
            lambda name, version: GradingPool(name, version, timeout_s=self.settings.grade_timeout_s))
        self._clock_ms = clock_ms or (lambda: int(time.time() * 1000))
        self._graders: dict[tuple[str, str], GradingPool] = {}   # (task, version[@seed]) -> its pool
        self.envs: dict[tuple[str, int], Environment] = {}   # (environment id, seed) -> environment
        self._slot_hash: dict[str, bytes] = {}
        self._prompt_ids: dict[tuple[str, int], list[int]] = {}
        self.vocab_size = backend.vocab_size
        self.stats = CheckStats()   # groups and seconds per rung (validator.metrics)

    def close(self) -> None:
        """Stop the grading pools."""
        for pool in self._graders.values():
            pool.close()
        self._graders.clear()

    # ---- the batch

    def validate_batch(
        self, admitted: pb.AdmittedBatch, spec: JobSpec, *, job_id: str, head_version: int, adapters: AdapterSource,
        audit: bool = False,
    ) -> list[pb.Verdict]:
        """Judge the admitted groups of one batch; returns their verdicts (see the module doc).

        head_version: the trainer's head read after the batch was admitted (for an audit: the
        version its statement credits it to). audit: an audit's recheck of a credited batch
        (`validator.audits`): every group is re-graded and re-scored, and the verdicts are only
        returned: neither the peer's reputation here nor its sample rate changes.
        Raises what `adapters` raises for network failures (e.g. grpc.RpcError): the batch can be
        validated again later with the same outcome (first sightings are keyed by batch).
        """
        now = self._clock_ms()
        envelope, opened = ck.check_envelope(admitted, job_id)
        indices = list(admitted.admitted_prompt_indices)
        if opened is None:
            log.warning("job %s seq %d: %s", job_id[:12], admitted.seq, envelope.detail)
            batch_id = signing.envelope_id(admitted.batch)
            return [_verdict(job_id, admitted.lease.peer_id, batch_id, i, envelope) for i in indices]
        peer = opened.signer
        if not audit:
            self.reputation.seen(peer, now)
        if not envelope.passed:
            verdicts = [_verdict(job_id, peer, opened.batch_id, i, envelope) for i in indices]
            return verdicts if audit else self._record(verdicts, [envelope] * len(verdicts), now)
        rate = 1.0 if audit else self.reputation.sample_rate(peer, max(self.settings.base_rate, spec.validation_rate), now)
        t = time.monotonic()
        works = self._cheap_rungs(admitted, opened, spec, job_id, head_version, rate, now)
        self.stats.ran("cheap", len(works), t)
        regrade, t = [w for w in works if w.plan.regrade and not w.failed], time.monotonic()
        self._regrade(spec, job_id, regrade)
        self.stats.ran("regrade", len(regrade), t)
        prefill, t = [w for w in works if w.plan.logprob and not w.failed], time.monotonic()
        self._prefill_rungs(spec, job_id, adapters, prefill)
        self.stats.ran("prefill", len(prefill), t)
        return self._judge(works, job_id, peer, opened.batch_id, now, record=not audit)

    def add_env(self, spec: JobSpec, env: Environment) -> None:
        """Use `env` for jobs with `spec`'s task (a data-set job's env needs its fetched bytes)."""
        self.envs[(spec.environment_id, spec.seed)] = env

    def env_of(self, spec: JobSpec) -> Environment:
        """The job's environment (an installed one is loaded on first use)."""
        key = (spec.environment_id, spec.seed)
        if key not in self.envs:
            self.envs[key] = job_environment(spec)
        return self.envs[key]

    def _cheap_rungs(
        self, admitted: pb.AdmittedBatch, opened: ck.OpenedBatch, spec: JobSpec, job_id: str,
        head_version: int, rate: float, now: int,
    ) -> list[_GroupWork]:
        env = self.env_of(spec)
        limits = job_limits(spec, env, self.vocab_size)
        lease, indices = admitted.lease, list(admitted.admitted_prompt_indices)
        works = []
        for g in opened.batch.groups:
            if g.prompt_index not in indices:
                continue  # refused at admission: not the validator's business
            work = _GroupWork(g, plan_group(self.sampling_key, opened.batch_id, g.prompt_index, rate))
            works.append(work)
            expected = self._expected_prompt(spec, job_id, g.prompt_index) if g.prompt_index in lease.prompt_indices else None
            work.results.append(ck.check_group_structure(g, lease, admitted_indices=indices,
                                                         expected_prompt_ids=expected, limits=limits))
            if not work.failed and isinstance(env, EpisodeEnv):
                work.results.append(self._replay(spec, env, g))
            if not work.failed:
                work.results.append(ck.check_freshness(g, lease, head_version))
            if not work.failed:
                work.results.append(ck.check_duplicate(opened.batch_id, self._first_seen(g, opened, job_id, admitted.seq, now)))
        return works

    def _replay(self, spec: JobSpec, env: EpisodeEnv, g: pb.Group) -> ck.CheckResult:
        limits = episode_limits(spec, env)
        assert limits is not None
        return check_replay(env, env.prompt(spec.seed, g.prompt_index), self.backend.tokenizer, g, limits)

    def _expected_prompt(self, spec: JobSpec, job_id: str, index: int) -> list[int]:
        key = (job_id, index)
        if key not in self._prompt_ids:
            if len(self._prompt_ids) >= _PROMPT_CACHE:
                self._prompt_ids.clear()
            prompt = self.env_of(spec).prompt(spec.seed, index)
            self._prompt_ids[key] = render_prompt(self.backend.tokenizer, prompt, spec.chat_template)
        return self._prompt_ids[key]

    def _first_seen(
        self, g: pb.Group, opened: ck.OpenedBatch, job_id: str, seq: int, now: int
    ) -> list[ck.FirstSeen | None]:
        return [
            self.seen.first_seen(ck.completion_key(job_id, g.prompt_index, c.token_ids), job_id=job_id,
                                 prompt_index=g.prompt_index, peer_id=opened.signer, batch_id=opened.batch_id,
                                 seq=seq, now_ms=now)
            if ck.is_distinctive(c) else None
            for c in g.completions
        ]

    # ---- regrade

    def _grader(self, spec: JobSpec) -> GradingPool:
        key = (spec.environment_id, spec.environment_version)
        if spec.reasoning_gym is not None:   # its graders rebuild the data sets from the job seed
            key = (spec.environment_id, f"{spec.environment_version}@seed{spec.seed}")
        if key not in self._graders:
            self._graders[key] = (self._grader_factory(*key) if not spec.carries_task
                                  else grader_for(spec, self.settings.grade_timeout_s))
        return self._graders[key]

    def _regrade(self, spec: JobSpec, job_id: str, works: list[_GroupWork]) -> None:
        """One grading call for every sampled group of the batch."""
        if not works:
            return
        env = self.env_of(spec)
        prompts: list[str] = []
        texts: list[str] = []
        infos: list[dict[str, Any]] = []
        for w in works:   # whole groups, so group-level rewards see the worker's rows again
            p = env.prompt(spec.seed, w.group.prompt_index)
            group_texts, group_infos = grade_rows(self.backend.tokenizer, env, p, w.group)
            prompts += [p.text] * len(group_texts)
            texts += group_texts
            infos += group_infos
        try:
            grades: Sequence[Grade] = self._grader(spec).grade(prompts, texts, infos)
        except GradingError as exc:
            for w in works:
                w.results.append(ck.undecided(REGRADE, f"grading unavailable: {exc}"))
            return
        lo = 0
        for w in works:
            n = len(w.group.completions)
            w.results.append(ck.check_regrade(w.group.completions, grades[lo: lo + n], env.regrade_tolerance))
            lo += n

    # ---- logprob and plausibility

    def _prefill_rungs(self, spec: JobSpec, job_id: str, adapters: AdapterSource, works: list[_GroupWork]) -> None:
        for w in works:
            try:
                recomputed = self._rescore_group(spec, job_id, adapters, w.group)
            except VersionUnavailable as exc:
                w.results.append(ck.fail(FRESHNESS, f"version {exc.version} was never published (the trainer can't serve it)"))
                continue
            except VersionNotKept as exc:  # published, then pruned: this validator lagged too far behind
                w.results.append(ck.undecided(LOGPROB, str(exc)))
                continue
            except AdapterReplaced as exc:   # sampled with a version the trainer replaced (admitted before)
                w.results.append(ck.undecided(LOGPROB, str(exc)))
                continue
            except ValueError as exc:  # ad.AdapterError, or a state that doesn't fit the job's LoRA shape
                w.results.append(ck.undecided(LOGPROB, f"adapter unavailable: {exc}"))
                continue
            masks = [list(c.token_mask) for c in w.group.completions]   # model tokens only (episodes)
            claimed = [model_only(c.logprobs, m) for c, m in zip(w.group.completions, masks, strict=True)]
            again = [model_only(r.logprobs_T.tolist(), m) for r, m in zip(recomputed, masks, strict=True)]
            w.results.append(ck.check_logprobs(claimed, again, self.logprob_tolerance))
            if w.failed:
                continue
            low_test = spec.sampling.top_p >= 1.0
            scores = []
            for r, c, lp, m in zip(recomputed, w.group.completions, again, masks, strict=True):
                stats, ids = model_stats(r.stats, list(c.token_ids), m)
                scores.append(completion_plausibility(torch.tensor(lp), ids, stats, low_test=low_test))
            w.results.append(ck.check_plausibility(scores, self.log_threshold))

    def _rescore_group(self, spec: JobSpec, job_id: str, adapters: AdapterSource, g: pb.Group) -> list[Rescored]:
        """Recompute every completion under its own claimed version (one prefill per version).

        Raises VersionUnavailable for a version the source does not have, AdapterReplaced for a
        completion that names another adapter hash than the source's for its version, ValueError
        (AdapterError) for an adapter that does not verify or fit the job's LoRA shape.
        """
        out: list[Rescored | None] = [None] * len(g.completions)
        for version in sorted({c.policy_version for c in g.completions}):
            rows = [i for i, c in enumerate(g.completions) if c.policy_version == version]
            digest = self._load_adapter(spec, job_id, adapters, version)
            named = {bytes(g.completions[i].adapter_hash) for i in rows} - {b"", digest}
            if named:   # the trainer checked at admission that it published this hash as `version`
                raise AdapterReplaced(f"sampled with adapter {named.pop().hex()[:12]} of version {version}, which "
                                      f"the trainer has since replaced by {digest.hex()[:12]} (a split repaired)")
            with self.backend.activated(job_id) as model:
                scored = rescore(model, [list(g.prompt_token_ids)] * len(rows),
                                 [list(g.completions[i].token_ids) for i in rows],
                                 temperature=spec.sampling.temperature, pad_id=self.backend.pad_token_id)
            for i, r in zip(rows, scored, strict=True):
                out[i] = r
        return [r for r in out if r is not None]

    def _load_adapter(self, spec: JobSpec, job_id: str, adapters: AdapterSource, version: int) -> bytes:
        state, digest = adapters.state(version)
        if self._slot_hash.get(job_id) == digest:
            return digest
        self.backend.add_slot(job_id, spec.lora)
        self.backend.set_adapter(job_id, state)
        self._slot_hash[job_id] = digest
        return digest

    def forget_job(self, job_id: str) -> None:
        """Free the job's adapter slot (a finished job)."""
        if job_id in self.backend.adapters:
            self.backend.remove_adapter(job_id)
        self._slot_hash.pop(job_id, None)

    # ---- verdicts

    def _judge(self, works: list[_GroupWork], job_id: str, peer: str, batch_id: str, now: int, *,
               record: bool = True) -> list[pb.Verdict]:
        verdicts, results = [], []
        for w in works:
            failed = w.failed
            if failed is not None:
                verdicts.append(_verdict(job_id, peer, batch_id, w.group.prompt_index, failed))
                results.append(failed)
            elif w.undecided:
                log.info("job %s batch %s prompt %d: undecided (%s)", job_id[:12], batch_id[:12], w.group.prompt_index,
                         "; ".join(r.detail for r in w.results if not r.conclusive))
            elif w.plan.regrade:
                ran = ",".join(r.check for r in w.results)
                passed = ck.ok(ALL, ran, soft_flags=sum(r.soft_flags for r in w.results))
                verdicts.append(_verdict(job_id, peer, batch_id, w.group.prompt_index, passed))
                results.append(passed)
        return self._record(verdicts, results, now) if record else verdicts

    def _record(self, verdicts: list[pb.Verdict], results: Sequence[ck.CheckResult], now: int) -> list[pb.Verdict]:
        for v, r in zip(verdicts, results, strict=True):
            if self.reputation.record(v.peer_id, passed=v.passed, check=v.check, now_ms=now, soft_flags=r.soft_flags):
                log.warning("peer %s banned at this validator: %s %s", v.peer_id[:12], v.check, v.detail)
        return verdicts


def _verdict(job_id: str, peer: str, batch_id: str, prompt_index: int, r: ck.CheckResult) -> pb.Verdict:
    return pb.Verdict(job_id=job_id, peer_id=peer, batch_id=batch_id, prompt_index=prompt_index,
                      passed=r.passed, check=r.check, detail=r.detail[:200])

