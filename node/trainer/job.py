"""One job hosted by a trainer: its head adapter, and the step that moves it.

The step reads like the walk in DESIGN.md: take a batch of admitted groups -> learner step
(gradients reduced with cotrainers' when there are any) -> publish the new version as a signed
delta -> mark the groups trained -> checkpoint. Leases, admission and bans are
`admission.Admission`; cotrainers are `cotraining.CotrainerSync`; `swarmrl status` is
`status.job_status` (it reads a job; the job never calls it). The clock is injected (unix seconds), so tests drive time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from peft import PeftModel

from swarmrl.node.models.card import write_model_card
from swarmrl.node.models.causal_lm import render_prompts, vocab_size
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.node.swarm.job_swarm import JobSwarm
from swarmrl.node.trainer.adapter_store import AdapterStore, StoredUpdate
from swarmrl.node.trainer.admission import Admission
from swarmrl.node.trainer.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from swarmrl.node.trainer.cotraining import CotrainerSync
from swarmrl.node.trainer.faults import OuterDrill
from swarmrl.node.trainer.learner import Learner
from swarmrl.node.trainer.ledger import Ledger, PendingGroup, Probation
from swarmrl.node.trainer.outer import OuterAverager, OuterOptimizer
from swarmrl.node.trainer.red_team import StatementDrill
from swarmrl.node.trainer.statements import StatementBook
from swarmrl.protocol import adapter as ad
from swarmrl.protocol import delta_codec as dc
from swarmrl.protocol import diloco
from swarmrl.protocol.demand import IntakeMeter, demand
from swarmrl.protocol.envs import job_environment
from swarmrl.protocol.episode_limits import completion_budget, job_limits
from swarmrl.protocol.grpo.reduce import GradientReducer, LocalReduce
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

log = logging.getLogger(__name__)
STALE_AT_STEP = "stale_at_step"
NO_SIGNAL = "no_signal"
JOB_DONE = "job_done"   # the note of groups still pending when the job took its last step
"""The ledger state of groups a step consumed without making a version (all-equal rewards in
every group: no advantage, no gradient); "trained" means trained into a published version."""
PROMPT_CACHE = 4096   # prompts' token ids kept by index (least recently used dropped first; JobRuntime.prompt_ids_of)
_PROMPT_MEMO = 4096   # distinct prompts (text, chat turns) whose token ids JobRuntime.prompt_ids_of keeps
SPLIT_WAIT_ROUNDS = 2   # DiLoCo: round timeouts a trainer that lost a split waits for the winner's version
LEDGER_KEEP_MS = 3600 * 1000   # default of TrainerConfig.ledger_keep_s (tests check they agree)
ReducerWrap = Callable[[GradientReducer], GradientReducer]


def now_ms() -> int:
    """The wall clock in unix milliseconds."""
    return int(time.time() * 1000)


class JobRuntime:
    """Everything a trainer holds for one job. Thread-safe: gRPC threads admit and lease while
    the trainer's main loop calls `train_step`.

    probation_ms: how long the admitted groups of a peer without a passing verdict from a
        trusted validator wait before a step may use them (0: no probation; `trainable_cutoff`);
        probation_last_chance: a held group may still be trained at its last fresh step.
    clock: unix seconds (default time.time; tests pass their own).
    monotonic: the lease book's clock, seconds that never jump (`Admission`; default
        time.monotonic, or `clock` when a test passes its own).
    wrap_reducer, outer_drill: fault drills wrap the step's gradient reducer and the DiLoCo
        outer round's averager (`node.trainer.faults`); the step itself carries no drill.
    device: where the learner's model runs (`node.inference.device.resolve_device`).
    ledger_keep_ms: how long a finished batch stays whole in the ledger after it arrived (for
        validators' SampleAdmitted); each step then clears older ones (`compact_ledger`).
    weight: the weight its record announces (`spec.weight`, or less: the trainer's cap for the
        job's submitter; `hosting.Trainer`). Raises ValueError unless 0 < weight <= spec.weight.
    """

    def __init__(
        self, job_id: str, spec: JobSpec, *, identity: Identity, model_path: Path, state_dir: Path, ledger: Ledger,
        prompt_shard: tuple[int, int] = (0, 1), probation_ms: int = 0, probation_last_chance: bool = True,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] | None = None,
        wrap_reducer: ReducerWrap | None = None, dataset: bytes | None = None, device: str = "cpu",
        ledger_keep_ms: int = LEDGER_KEEP_MS, weight: float | None = None,
        statement_drill: StatementDrill | None = None, outer_drill: OuterDrill | None = None,
    ) -> None:
        self.weight = spec.weight if weight is None else weight
        if not 0 < self.weight <= spec.weight:
            raise ValueError(f"announced weight {self.weight} is not in (0, the job's weight {spec.weight}]")
        self.job_id, self.spec, self.identity, self.ledger = job_id, spec, identity, ledger
        self.probation_ms, self.clock, self.wrap_reducer = probation_ms, clock, wrap_reducer
        self.probation_last_chance = probation_last_chance
        self.outer_drill = outer_drill
        self.split: tuple[int, bytes, str, float] | None = None   # (version, own hash, winner, deadline)
        self.ledger_keep_ms = ledger_keep_ms
        self.dir = state_dir / "jobs" / job_id
        self.dataset = dataset
        self.env = job_environment(spec, dataset)
        self.learner = Learner(model_path, spec, device=device, token_budget=completion_budget(spec, self.env))
        self.store = AdapterStore(self.dir / "adapters", job_id, identity, codec=spec.delta_codec)
        self._prompt_ids: OrderedDict[int, list[int]] = OrderedDict()   # LRU of PROMPT_CACHE prompts
        self._ids_by_prompt: dict[tuple[str, str], list[int]] = {}   # see prompt_ids_of
        self._prompt_lock = threading.Lock()
        self.lock = threading.RLock()
        self.version = 0
        self.head_hash = b""
        self.head_state: ad.State = {}
        self.cotraining: CotrainerSync | None = None
        self.upload_bytes: Counter[str] = Counter()
        self.published_at = 0.0
        self.batches_without_signal = 0   # consumed batches that changed nothing, since the last version
        self.outer = OuterOptimizer(spec, self.learner.params) if spec.diloco else None   # DiLoCo (`outer`)
        self._resume()
        self.statements = StatementBook(job_id, identity, ledger, self.store, self.now_ms,   # `protocol.credit`
                                        drill=statement_drill)
        self.statements.fill(self.version)   # a step that crashed before its statement: an empty one
        limits = job_limits(spec, self.env, vocab_size(self.learner.model))
        self.admission = Admission(job_id, spec, ledger, limits=limits, prompt_ids=self.prompt_ids_of,
                                   version=lambda: self.version, done=lambda: self.done, identity=identity,
                                   prompt_shard=prompt_shard, clock=clock, monotonic=monotonic,
                                   published=self.store.published)
        self.intake = IntakeMeter()   # groups consumed per minute (on the admission's monotonic clock)

    def _resume(self) -> None:
        """Start fresh (publish version 0) or resume from the checkpoint plus later deltas."""
        ckpt = load_checkpoint(self.dir / "checkpoints")
        if ckpt is None:
            state = self.learner.state()
            self.head_hash = self.store.put_snapshot(0, state)
        else:
            state, step = ckpt.state, ckpt.step
            for v in range(step + 1, self.store.latest_version() + 1):
                update = self.store.delta(v)
                if update is None:
                    break
                state, step = ad.apply_delta(state, dc.decode_delta(update.payload)), v
            self.learner.load_state(state)
            self.learner.load_optimizer_state(ckpt.optimizer)
            if self.outer is not None and ckpt.outer is not None:
                self.outer.load_state_dict(ckpt.outer)
            self.version = step
            self.head_hash = ad.adapter_hash(state)
            log.info("job %s resumed at version %d (checkpoint %d)", self.job_id, step, ckpt.step)
        self.head_state = state

    def now_ms(self) -> int:
        """The injected clock in unix milliseconds."""
        return int(self.clock() * 1000)

    @property
    def done(self) -> bool:
        """Whether the job has taken all its steps."""
        return self.version >= self.spec.steps

    def record(self, endpoint: str) -> pb.JobRecord:
        """The DHT record announcing this job, with its demand (`demand`) and head statement."""
        statement_version, statement_sha = self.statements.head()
        return pb.JobRecord(
            job_id=self.job_id, trainer_id=self.identity.peer_id, endpoint=endpoint, base_model=self.spec.base_model,
            base_model_sha256=bytes.fromhex(self.spec.base_model_sha256), environment=self.spec.environment_id,
            env_version=self.spec.environment_version, head_version=self.version, head_hash=self.head_hash,
            updated_ms=self.now_ms(), done=self.done, spec_json=self.spec.canonical_json(),
            trainer_public_key=self.identity.public_key,
            cotrainer_keys=self._vouched_keys(),
            demand=self.demand(), statement_version=statement_version, statement_sha256=statement_sha,
        )

    def _vouched_keys(self) -> list[bytes]:
        """The cotrainers whose signed updates this job's workers may take: the live ones, or
        none with DiLoCo (a cotrainer's inner version of a number is not ours)."""
        if self.cotraining is None or self.outer is not None:
            return []
        return [c.public_key for c in self.cotraining.swarm.cotrainers.live()]

    def demand(self) -> pb.Demand:
        """What the job can still use, as its record announces it (`protocol.demand`): open
        capacity (0 once done), groups consumed per minute lately, weight."""
        capacity = 0 if self.done else self.admission.capacity()
        return demand(capacity, self.intake.per_minute(self.admission.monotonic()), self.weight)

    def prompt_ids(self, index: int) -> list[int]:
        """Token ids of prompt `index`, derived from (job seed, index)."""
        return self.prompt_ids_of([index])[index]

    def prompt_ids_of(self, indices: Iterable[int]) -> dict[int, list[int]]:
        """index -> token ids of each prompt, derived from (job seed, index); those not cached
        rendered in one batched tokenizer call (thread-safe).

        Two bounded caches: by index, the `PROMPT_CACHE` prompts used last (admission asks for a
        lease's prompts at each batch answering it, and an admitted prompt is never asked for
        again, so it ages out); by prompt (text and chat turns), the ids of up to `_PROMPT_MEMO`
        distinct prompts, since rendering is a pure function of the prompt and an environment
        drawing from a few hundred problems (the built-in arithmetic) shows each at many indices."""
        wanted = list(dict.fromkeys(indices))
        with self._prompt_lock:
            out = {i: self._prompt_ids[i] for i in wanted if i in self._prompt_ids}
            todo = [i for i in wanted if i not in out]
            prompts = {i: self.env.prompt(self.spec.seed, i) for i in todo}
            chat = self.spec.chat_template   # plain rendering reads the text only; a chat one the turns too
            keys = {i: (p.text, repr(p.messages) if chat else "") for i, p in prompts.items()}
            if len(self._ids_by_prompt) + len(keys) > _PROMPT_MEMO:
                self._ids_by_prompt.clear()
            known = {i: self._ids_by_prompt[k] for i, k in keys.items() if k in self._ids_by_prompt}
        fresh = {k: i for i, k in keys.items() if i not in known}   # prompt -> an index showing it
        rendered = dict(zip(fresh, render_prompts(self.learner.tokenizer, [prompts[i] for i in fresh.values()],
                                                  self.spec.chat_template), strict=True)) if fresh else {}
        with self._prompt_lock:
            self._ids_by_prompt.update(rendered)
            out.update({i: known[i] if i in known else rendered[keys[i]] for i in todo})
            for i in wanted:
                self._prompt_ids[i] = out[i]
                self._prompt_ids.move_to_end(i)
            while len(self._prompt_ids) > PROMPT_CACHE:
                self._prompt_ids.popitem(last=False)
        return out

    def cached_prompts(self) -> int:
        """How many prompts' token ids the by-index cache holds (at most `PROMPT_CACHE`)."""
        with self._prompt_lock:
            return len(self._prompt_ids)

    # ---- batches
    def ready(self) -> bool:
        """A batch of trainable groups inside the staleness window is pending: at least
        `spec.batch_min` (older ones are dropped)."""
        if self.done or self.split is not None:   # a split this trainer lost: adopt first (`coordinate`)
            return False
        self.ledger.drop_stale(self.job_id, self.version - self.spec.max_async_level, note=STALE_AT_STEP)
        return self.ledger.count_pending(self.job_id, hold=self.trainable_cutoff()) >= self.spec.batch_min

    def trainable_cutoff(self) -> Probation | None:
        """Probation: a group of a peer that no trusted validator has passed yet may be trained
        only once its batch is `probation_ms` old, or at its last chance: when its policy version
        is at the next step's staleness floor (version - max_async_level), so probation never
        lets a group go stale (None: no probation). A new peer's first groups wait for the
        validator, which checks new peers at rate 1, so a cheater is usually banned (and its
        groups dropped) before any of them is trained; the cutoffs keep a slow or absent
        validator from stalling the job or wasting its work (issue 24: with 10,000 workers, 2
        validators gave a new peer its first verdict after ~25 minutes, and 60 s of probation
        outlasted the ~45 s staleness window, so most groups went stale on probation). The price:
        in a small fast swarm the window is a few seconds, so a new peer's groups are trained
        that soon if no verdict came first; `probation_last_chance=False` (trainer config
        `probation_last_chance`) keeps the hold whole."""
        if self.probation_ms <= 0:
            return None
        floor = self.version - self.spec.max_async_level if self.probation_last_chance else -1
        return Probation(self.now_ms() - self.probation_ms, floor)

    def groups_on_probation(self) -> int:
        """Pending groups a step may not use yet (their peer has no passing verdict; see
        `trainable_cutoff`)."""
        hold = self.trainable_cutoff()
        if hold is None:
            return 0
        return self.ledger.count_on_probation(self.job_id, hold)

    def take_batch(self) -> list[PendingGroup]:
        """The next trainable pending groups still inside the staleness window, oldest first, at
        most `spec.batch_max` (elastic intake: with a range, a step takes what is there up to max)."""
        while True:
            pending = self.ledger.pending(self.job_id, self.spec.batch_max, hold=self.trainable_cutoff())
            stale = [p for p in pending if self.version - min(c.policy_version for c in p.group.completions)
                     > self.spec.max_async_level]
            if not stale:
                return pending
            self.ledger.mark([p.row_id for p in stale], "dropped", note=STALE_AT_STEP)

    # ---- the step
    def train_step(self) -> dict[str, float] | None:
        """batch -> learner step -> publish -> sign the version's statement and mark its groups
        trained (one ledger transaction: `statements.StatementBook`) -> checkpoint. Returns the new
        version's metrics row, or None when no version was made: the averaged step was abandoned
        (a cotrainer got ahead; the groups stay pending) or the batch carried no signal (the
        groups are consumed as NO_SIGNAL, nothing is published; counted in the next row's
        `batches_without_signal`)."""
        t0 = time.monotonic()
        batch = self.take_batch()
        metrics = self.learner.step([p.group for p in batch], self.version, self._reducer(bool(batch)))
        if metrics is None:
            return None
        self.intake.add(self.admission.monotonic(), len(batch))
        if not metrics["stepped"]:
            self.ledger.mark([p.row_id for p in batch], NO_SIGNAL, step=self.version)
            self.compact_ledger()
            self.batches_without_signal += 1
            log.info("job %s: a batch of %d groups carried no signal; version stays %d",
                     self.job_id[:12], len(batch), self.version)
            return None
        if self.outer is not None and diloco.is_outer_version(self.version + 1, self.spec.inner_steps):
            metrics.update(self._outer_step())
        else:
            self.publish(self.learner.state())
        if self.done:   # nothing trains the groups still pending: the last statement lists them dropped
            with self.admission.gate:   # admission refuses a done job's batches: none is admitted after this
                self.ledger.drop_pending(self.job_id, note=JOB_DONE, keep=[p.row_id for p in batch])
        self.statements.state(self.version, [p.row_id for p in batch])   # marks them trained, atomically
        self.compact_ledger()
        self.checkpoint()
        row = self._metrics_row(batch, metrics, time.monotonic() - t0)
        self.ledger.record_step(self.job_id, self.version, row)
        if self.done:
            self.export(self.dir / "final")
        return row

    def compact_ledger(self) -> tuple[int, int]:
        """Clear the job's finished batches older than `ledger_keep_ms` and delete its expired
        closed leases (`Ledger.compact`); returns (batches cleared, leases deleted)."""
        cleared, deleted = self.ledger.compact(self.job_id, self.now_ms() - self.ledger_keep_ms)
        if cleared or deleted:
            log.debug("job %s: ledger compacted (%d batches cleared, %d leases deleted)",
                      self.job_id[:12], cleared, deleted)
        return cleared, deleted

    def _outer_step(self) -> dict[str, float]:
        """DiLoCo: the outer step that makes the next (outer) version, averaged with the live
        cotrainers (`outer.OuterOptimizer.step`); published as a snapshot, the same bytes at every
        trainer of the round. Returns the outer figures for the metrics row."""
        assert self.outer is not None
        swarm = self.cotraining.swarm if self.cotraining is not None and self.cotraining.swarm.active else None
        rounds: OuterAverager | None = swarm.outer_rounds(self.learner.params, self.spec.outer_timeout_s,
                                                          self.spec.outer_codec) if swarm is not None else None
        expected = 1 + len(swarm.cotrainers.live()) if swarm is not None and rounds is not None else 1
        if rounds is not None and self.outer_drill is not None:
            rounds = self.outer_drill.wrap(rounds)
        new_P, metrics = self.outer.step([p.detach() for p in self.learner.params], self.version + 1, rounds, expected)
        if swarm is not None:
            swarm.counters["outer_rounds"] += 1
            swarm.counters["outer_solo"] += int(not metrics["outer_agreed"])
            swarm.counters["outer_bytes_sent"] += int(metrics["outer_bytes_sent"])
            swarm.count_refused(self.outer.refused)
        self.learner.set_params(new_P)
        self.publish_outer(self.learner.state())
        if self.outer.split_winner:   # members started from different outer states: the smallest id's wins
            self.split = (self.version, self.head_hash, self.outer.split_winner,
                          time.monotonic() + SPLIT_WAIT_ROUNDS * self.spec.outer_timeout_s)
        return metrics

    def publish_outer(self, state: ad.State) -> None:
        """Store an outer version as a signed snapshot (no delta: each trainer's workers hold its
        own inner version, and only the snapshot's bytes are the same for all of them)."""
        with self.lock:
            self.store.encoder.reset()
            self.head_hash = self.store.publish_snapshot(self.version + 1, state)
            self.head_state = ad.clone_state(state)
            self.version += 1
            if self.cotraining is not None:
                self.cotraining.keep_shared()
        self.published_at = self.clock()

    def _reducer(self, has_groups: bool) -> GradientReducer | None:
        """The step's gradient reducer: averaging while cotrainers live, else the learner's own
        (always the learner's own with DiLoCo: trainers meet at outer steps only)."""
        swarm = self.cotraining.swarm if self.cotraining is not None and self.outer is None else None
        reducer = swarm.reducer(self.version, self.head_hash, has_groups=has_groups) \
            if swarm is not None and swarm.averaging_now else None
        return self.wrap_reducer(reducer or LocalReduce()) if self.wrap_reducer else reducer

    def publish(self, new_state: ad.State) -> None:
        """Sign and store the next version's delta; adopt the exact reconstructed state (the
        codec's error feedback only while no cotrainer publishes the same versions)."""
        with self.lock:
            alone = self.cotraining is None or not self.cotraining.swarm.active
            exact, update = self.store.publish(self.version + 1, self.head_state, new_state, carry=alone)
            self.learner.load_state(exact)
            self.head_state = exact
            self.version += 1
            self.head_hash = bytes(pb.AdapterUpdate.FromString(update.header.body).to_hash)
            if self.cotraining is not None and self.outer is None:   # DiLoCo shares outer versions only
                self.cotraining.keep_shared()
        self.published_at = self.clock()

    def checkpoint(self) -> None:
        """Write adapter + optimizer + version atomically (`checkpoint.save_checkpoint`)."""
        save_checkpoint(self.dir / "checkpoints",
                        Checkpoint(self.version, self.head_state, self.learner.optimizer_state(),
                                   self.outer.state_dict() if self.outer is not None else None))

    def _metrics_row(self, batch: list[PendingGroup], metrics: dict[str, float], seconds: float) -> dict[str, float]:
        row = {"step": float(self.version), "policy_version": float(self.version),
               "groups_trained": float(len(batch)), "groups_rejected": float(self.admission.take_rejections()),
               "batches_without_signal": float(self.batches_without_signal),
               "seconds": seconds, "time": self.clock(), "published_at": self.published_at}
        self.batches_without_signal = 0
        row.update(metrics)
        return row

    def export(self, out: Path) -> Path:
        """Write the head adapter in PEFT format, with its card, into `out`: built in a sibling folder
        and moved in file by file (`os.replace`), so a reader never finds a half-written file."""
        model, tmp = self.learner.model, out.with_name(f".tmp-{out.name}")
        assert isinstance(model, PeftModel)
        with self.lock:   # a folder a crash left is written over, then emptied and removed
            model.save_pretrained(str(tmp), save_embedding_layers=False)
            version, head_hash = self.version, self.head_hash
        write_model_card(tmp, self.spec, self.job_id, version, self.ledger.steps(self.job_id), adapter_hash=head_hash)
        out.mkdir(parents=True, exist_ok=True)
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
        tmp.rmdir()
        return out

    # ---- cotrainers, adapters, status
    def attach_swarm(self, swarm: JobSwarm) -> None:
        """Train with cotrainers found through `swarm` (see `cotraining`)."""
        self.cotraining = CotrainerSync(self, swarm)

    def coordinate(self, records: list[VerifiedRecord]) -> None:
        """Multi-trainer housekeeping before a step (`CotrainerSync.coordinate`); no-op alone.
        After a DiLoCo round that found a split this trainer loses (`split`), it adopts the
        winner's outer version before it steps again (or steps on after SPLIT_WAIT_ROUNDS round
        timeouts without it)."""
        if self.cotraining is None:
            return
        winner = ""
        if self.split is not None:
            version, own_hash, winner, deadline = self.split
            if (self.version, self.head_hash) != (version, own_hash):
                log.info("job %s: split at v%d repaired: adopted %s", self.job_id[:12], version, self.head_hash.hex()[:12])
                self.split, winner = None, ""
            elif time.monotonic() > deadline:
                log.warning("job %s: split at v%d: %s's version never came; stepping on", self.job_id[:12], version,
                            winner[:12])
                self.split, winner = None, ""
        self.cotraining.coordinate(records, split_winner=winner)

    def cotrainer_ids(self) -> tuple[str, ...]:
        """The live cotrainers (the keys this trainer's record vouches for)."""
        return self.cotraining.cotrainer_ids() if self.cotraining is not None else ()

    def peer_round_open(self) -> bool:
        """True when a cotrainer is looking for an averaging group at our version (join it)."""
        return self.cotraining is not None and self.outer is None and self.cotraining.peer_round_open()

    def updates(self, req: pb.AdapterRequest) -> Iterator[StoredUpdate]:
        """Deltas from `have_version` to the wanted version, or one snapshot."""
        with self.lock:
            head = self.version
        return self.store.updates(req, head)

    def count_upload(self, requester: str, n: int) -> None:
        """Count `n` adapter bytes served to `requester` (peer id, or "other")."""
        with self.lock:
            self.upload_bytes[requester or "other"] += n
