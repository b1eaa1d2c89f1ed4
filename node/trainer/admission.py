"""The trainer's front desk for one job: leases, admission of signed rollout batches, strikes and
bans, with what each does to the others.

Leasing, admitting and banning are atomic with respect to each other (one lock, `gate`): a ban
that lands while a peer asks for a lease either comes first (the request is answered `banned`)
or after (the fresh lease is revoked by the ban and its prompts go back to the queue), and a ban
never races a batch of the same peer into the ledger. Signatures are checked outside the lock.
The clock is injected (unix seconds), as `LeaseBook` takes times, so tests drive time instead of
sleeping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from swarmrl.node.trainer.bans import BanBook
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol import admission as adm
from swarmrl.protocol import receipts, signing
from swarmrl.protocol.demand import open_capacity
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.leases import BUSY_RETRY_MS, LeaseBook
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.prompt_signal import PromptSignal
from swarmrl.protocol.verdicts import BAD_SIGNATURE_ON_OWN_LEASE, BAN_MS, BANNING_CHECKS, is_attributable

log = logging.getLogger(__name__)
Clock = Callable[[], float]
PEER_VERSIONS_KEPT = 10_000   # peers whose adapter version is remembered (those that asked last)


class Admission:
    """Leases, admission and bans of one job (thread-safe; see the module docstring).

    limits: the admission checks' bounds (`protocol.admission.AdmissionLimits`).
    prompt_ids: index -> token ids of each of the given prompt indices, derived from (job seed,
        index) (`JobRuntime.prompt_ids_of`).
    version, done: the job's current policy version and whether it ended (read at each use).
    clock: unix seconds (time.time, or a test's clock): bans, the ledger's times, a lease's wire
        `issued_ms` / `deadline_ms`.
    monotonic: seconds on a clock that never jumps: lease deadlines and expiry, so a wall clock
        stepped by an hour either way changes neither. Default time.monotonic, or `clock` itself
        when that is a test's clock (one clock drives both unless a test passes two).
    identity: the trainer's key, which signs the receipt of every accepted batch
        (`protocol.receipts`).
    published: (version, adapter hash) -> whether this trainer published that hash as that
        version (`AdapterStore.published`); a completion naming another hash is refused as
        `adapter_unknown`, without blame. None: hashes are not checked.
    """

    def __init__(self, job_id: str, spec: JobSpec, ledger: Ledger, *, limits: adm.AdmissionLimits,
                 prompt_ids: Callable[[Iterable[int]], dict[int, list[int]]], version: Callable[[], int], done: Callable[[], bool],
                 identity: Identity, prompt_shard: tuple[int, int] = (0, 1), clock: Clock,
                 monotonic: Clock | None = None, published: Callable[[int, bytes], bool] | None = None) -> None:
        self.job_id, self.spec, self.ledger, self.limits, self.identity = job_id, spec, ledger, limits, identity
        self.prompt_ids, self.version, self.done, self.clock = prompt_ids, version, done, clock
        self.published = published
        self.monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self.leases = LeaseBook(job_id, ttl_ms=int(spec.lease_ttl_s * 1000), shard=prompt_shard)
        self.signal = PromptSignal(spec.seed)   # each prompt's recent signal; the skip rule with lease_filter
        self.leases.restore(ledger.leases(job_id, open_only=True), ledger.admitted_indices(job_id),
                            now_ms=self.lease_ms(), wall_ms=self.now_ms())
        self.bans = BanBook(job_id, ledger)
        self.gate = threading.RLock()
        self.rejections_since_step = 0
        self.refused: Counter[str] = Counter()   # calls refused before admission (rate limits), by reason
        # peer -> adapter version it held at its last lease request, for the newest
        # `peer_versions_kept` peers to ask (a peer id costs nothing to make: no entry per id ever seen)
        self.peer_versions: OrderedDict[str, int] = OrderedDict()
        self.peer_versions_kept = PEER_VERSIONS_KEPT

    def now_ms(self) -> int:
        """The injected clock in unix milliseconds."""
        return int(self.clock() * 1000)

    def lease_ms(self) -> int:
        """The lease book's clock (monotonic) in milliseconds."""
        return int(self.monotonic() * 1000)

    def _lease_expired(self, lease: pb.Lease, now_ms: int) -> bool:
        """Whether `lease` is past its deadline: on the monotonic clock while it is open or after
        the book expired it; on the wall clock (`now_ms`) for one closed otherwise (answered in
        full, revoked, or closed before a restart) (caller holds the gate)."""
        deadline = self.leases.deadline_of(lease.lease_id)
        if deadline is not None:
            return self.lease_ms() > deadline
        return self.leases.expired_recently(lease.lease_id) or now_ms > lease.deadline_ms

    @property
    def banned(self) -> dict[str, str]:
        """peer -> reason of the job's bans (see `ban` and protocol.verdicts)."""
        return self.bans.banned

    @property
    def strikes(self) -> Counter[str]:
        """peer -> attributable admission failures (groups), durable."""
        return self.bans.strikes

    # ---- leases
    def sampling(self) -> pb.SamplingParams:
        """The job's sampling parameters as a lease carries them."""
        s = self.spec.sampling
        return pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                                 n=self.spec.group_size, stop=list(s.stop))

    def request_lease(self, peer_id: str, req: pb.LeaseRequest) -> pb.LeaseReply:
        """Grant a lease of at most the job's open capacity (`capacity`), or say why not
        (`banned`, `job_done`, `busy` with a retry hint when the capacity is spent).

        The clock is read once, before the gate; from the ban check to the issued lease nothing
        else runs under the gate that a ban takes too.
        """
        now, lease_now = self.now_ms(), self.lease_ms()
        with self.gate:
            self._note_version(peer_id, int(req.adapter_version))
            self.bans.expire(now)
            if peer_id in self.banned:
                return pb.LeaseReply(reason=adm.BANNED)
            if self.done():
                return pb.LeaseReply(reason="job_done")
            self._expire_leases(lease_now)
            capacity = self._capacity()
            if capacity == 0:
                # The promise is spent: more rollouts would only go stale before a step could use them.
                return pb.LeaseReply(reason="busy", retry_after_ms=BUSY_RETRY_MS)
            n = max(1, min(req.max_prompts or self.spec.prompts_per_lease, self.spec.prompts_per_lease, capacity))
            lease = self.leases.issue(peer_id, n, self.version(), self.sampling(), lease_now, wall_ms=now,
                                      skip=self._skip if self.spec.lease_filter == "signal" else None)
            self.ledger.add_lease(lease)
            return pb.LeaseReply(lease=lease)

    def _skip(self, index: int) -> bool:
        """`lease_filter = "signal"`: pass over `index` (`PromptSignal.skip`; caller holds the gate)."""
        return self.signal.skip(index, self.prompt_ids([index])[index])

    def capacity(self) -> int:
        """Prompts this job can lease now and still train before they go stale
        (`protocol.demand.open_capacity`: the window less pending groups and open leases'
        prompts), after closing the leases past their deadline."""
        now = self.lease_ms()
        with self.gate:
            self._expire_leases(now)
            return self._capacity()

    def _capacity(self) -> int:
        """`capacity` without expiring (caller holds the gate)."""
        return open_capacity(self.spec, self.ledger.count_pending(self.job_id), self.leases.open_prompts())

    def _note_version(self, peer_id: str, version: int) -> None:
        """Remember the peer's adapter version, forgetting the peers that asked longest ago
        beyond `peer_versions_kept` (caller holds the gate)."""
        self.peer_versions[peer_id] = version
        self.peer_versions.move_to_end(peer_id)
        while len(self.peer_versions) > self.peer_versions_kept:
            self.peer_versions.popitem(last=False)

    def expire_leases(self) -> None:
        """Close the leases past their deadline; their unanswered prompts go back to the queue."""
        now = self.lease_ms()
        with self.gate:
            self._expire_leases(now)

    def _expire_leases(self, now: int) -> None:
        for lease_id in self.leases.expire(now):
            self.ledger.close_lease(lease_id)

    def count_refusal(self, reason: str) -> None:
        """Count a call refused before admission (e.g. a rate limit) under `reason` (in memory:
        a refusal must cost no disk write)."""
        with self.gate:
            self.refused[reason] += 1

    # ---- admission
    def admit(self, envelope: pb.Signed, max_bytes: int, *,
              on_verified: Callable[[str], None] | None = None) -> pb.BatchReceipt:
        """Verify and admit one signed rollout batch; every refusal is counted with its reason.
        Admitted groups are in the ledger (durable) before the receipt is returned: the sync
        waits outside the gate, so batches arriving together share one (`Ledger`). An accepted
        batch's answer carries the trainer's signed receipt (`protocol.receipts`), signed after
        the sync (it promises the groups are on disk) and outside the gate.

        on_verified(signer): called once the signature verified, before anything is recorded
        (the service's per-peer rate limit; it may raise to refuse the call).
        """
        batch_id = signing.envelope_id(envelope)
        signer = signing.signer_id(envelope) if len(envelope.public_key) == 32 else "unknown"
        if envelope.ByteSize() > max_bytes:
            return self._refuse(batch_id, signer, adm.OVERSIZED, 1)
        try:
            batch, signer = signing.open_signed(envelope, signing.ROLLOUT_BATCH, pb.RolloutBatch)
        except signing.SignatureError as exc:
            with self.gate:
                holder = self._private_lease_holder(envelope, signer)
                if holder:
                    forged = pb.RolloutBatch.FromString(envelope.body)
                    self._strike(holder, BAD_SIGNATURE_ON_OWN_LEASE, forged.lease_id, count=max(1, len(forged.groups)))
                return self._refuse(batch_id, signer, exc.reason, 1)
        if on_verified is not None:
            on_verified(signer)
        if batch.job_id != self.job_id:   # routed here by a claim read before verification
            return self._refuse(batch_id, signer, adm.UNKNOWN_JOB, max(1, len(batch.groups)))
        now = self.now_ms()
        with self.gate:
            if self.done():   # its groups would never be trained: no receipt may promise them (`JobRuntime.train_step`)
                self.count_refusal(adm.JOB_DONE)   # a late honest batch, not a rejection of its groups
                return pb.BatchReceipt(batch_id=batch_id, accepted=False, reason=adm.JOB_DONE)
            self.bans.expire(now)
            lease = self.leases.get(batch.lease_id) or self.ledger.lease(batch.lease_id)
            reason = adm.check_batch_envelope(
                batch, signer, lease, now_ms=now, batch_seen=self.ledger.batch_seen(batch_id), banned=self.banned,
                lease_expired=None if lease is None else self._lease_expired(lease, now),
            )
            if reason:
                if is_attributable(reason):
                    self._strike(signer, reason, batch.lease_id, count=max(1, len(batch.groups)))
                return self._refuse(batch_id, signer, reason, max(1, len(batch.groups)))
            assert lease is not None
            answer, receipt = self._admit_groups(batch_id, envelope, batch, lease, now)
        self.ledger.sync()   # on disk before the receipt; outside the gate, so the next batch's commit shares the sync
        answer.signed.CopyFrom(receipts.sign_receipt(self.identity, receipt))
        return answer

    def _admit_groups(self, batch_id: str, envelope: pb.Signed, batch: pb.RolloutBatch, lease: pb.Lease,
                      now: int) -> tuple[pb.BatchReceipt, pb.AdmissionReceipt]:
        """Check each group; record the batch, its admitted groups, its rejections and (when
        every prompt of the lease is now answered) the lease's closing in ONE ledger transaction,
        committed but not yet synced: the caller syncs it before answering. Returns the answer
        and the receipt to sign into it."""
        expected = self.prompt_ids(lease.prompt_indices)
        taken = self.ledger.admitted_among(self.job_id, expected)
        verdicts, admitted, rejected = [], [], Counter[str]()
        version = self.version()
        for g in batch.groups:
            reason = adm.check_group(g, lease, current_version=version, expected_prompt_ids=expected,
                                     already_admitted=taken, lim=self.limits) or self._adapters_known(g)
            verdicts.append(pb.GroupVerdict(prompt_index=g.prompt_index, admitted=not reason, reason=reason))
            if reason:
                rejected[reason] += 1
            else:
                admitted.append(g)
                taken.add(g.prompt_index)
                self.signal.record(g)
        closes = bool(admitted) and taken >= set(lease.prompt_indices)
        self.ledger.admit(batch_id, batch, envelope, admitted, now, close_lease=closes,   # synced by `admit`
                          rejections=rejected, sync=False)
        self.rejections_since_step += sum(rejected.values())
        if admitted:
            self.leases.record_answers(lease.lease_id, [g.prompt_index for g in admitted])
        blamed = [v.reason for v in verdicts if is_attributable(v.reason)]
        if blamed:
            self._strike(batch.peer_id, blamed[-1], lease.lease_id, count=len(blamed))
        receipt = receipts.admission_receipt(batch_id, batch, [g.prompt_index for g in admitted],
                                             policy_version=version, at_ms=now)
        return pb.BatchReceipt(batch_id=batch_id, accepted=True, groups=verdicts), receipt

    def _adapters_known(self, g: pb.Group) -> str:
        """`adapter_unknown` when a completion names an adapter hash this trainer did not publish
        as its version (content-addressed versions: `pb.Completion.adapter_hash`), else ""."""
        if self.published is None:
            return ""
        named = {(int(c.policy_version), bytes(c.adapter_hash)) for c in g.completions if c.adapter_hash}
        if any(len(h) != adm.ADAPTER_HASH_BYTES or not self.published(v, h) for v, h in named):
            return adm.ADAPTER_UNKNOWN
        return ""

    def _private_lease_holder(self, envelope: pb.Signed, named: str) -> str:
        """The peer a batch with a bad signature can be pinned on, or "": the body names an open
        lease of the very peer whose public key the envelope carries, and no batch answering that
        lease was recorded yet (SampleAdmitted never showed its id), so only that peer knew it."""
        try:
            lease_id = pb.RolloutBatch.FromString(envelope.body).lease_id
        except Exception:  # noqa: BLE001 - garbage: nothing to pin
            return ""
        lease = self.leases.get(lease_id)
        if lease is None or lease.peer_id != named or self.ledger.lease_exposed(lease_id):
            return ""
        return named

    def _refuse(self, batch_id: str, signer: str, reason: str, groups: int) -> pb.BatchReceipt:
        self._count_rejection(signer=signer, reason=reason, count=groups)
        return pb.BatchReceipt(batch_id=batch_id, accepted=False, reason=reason)

    def _count_rejection(self, *, signer: str, reason: str, count: int = 1) -> None:
        self.ledger.reject(self.job_id, signer, reason, self.now_ms(), count)
        self.rejections_since_step += count

    # ---- strikes and bans (the record: bans.BanBook; the consequences: here)
    def _strike(self, peer_id: str, reason: str, lease_id: str = "", count: int = 1) -> None:
        """`count` attributable admission failures (provably wrong signed groups, or a forged
        batch on the peer's private lease); STRIKES_TO_BAN of them ban the peer. The peer's lease
        it answered is revoked (its prompts go back to the queue at once)."""
        with self.gate:
            open_leases = self.leases.open_of(peer_id)
            self._revoke(open_leases if not lease_id else [lease_id] if lease_id in open_leases else [])
            if self.bans.strike(peer_id, count):
                self.ban(peer_id, f"admission: {self.strikes[peer_id]} attributable failures, last {reason}")

    def ban(self, peer_id: str, reason: str, duration_ms: int = BAN_MS) -> int:
        """Ban `peer_id` from the job (no leases, batches refused), revoke its open leases (their
        prompts go back to the queue) and drop its untrained groups. Returns how many groups were
        dropped. Durable (ledger): a restart keeps the ban."""
        now = self.now_ms()
        with self.gate:
            reason = self.bans.add(peer_id, reason, now, duration_ms)
            self._revoke(self.leases.open_of(peer_id))
            dropped = self.ledger.drop_peer(self.job_id, peer_id, note=f"banned: {reason}"[:200])
        log.warning("job %s: banned %s (%s), dropped %d groups", self.job_id, peer_id, reason, dropped)
        return dropped

    def _revoke(self, lease_ids: list[str]) -> None:
        for lease_id in self.leases.revoke(lease_ids):
            self.ledger.close_lease(lease_id)

    def lift_ban(self, peer_id: str) -> None:
        """End a ban now and clear the peer's strikes (its history stays in the ledger)."""
        with self.gate:
            self.bans.lift(peer_id)

    def apply_verdicts(self, validator_id: str, report: pb.VerdictReport) -> list[str]:
        """Record a trusted validator's verdicts; ban peers with a failed banning check. Returns
        the newly banned peers.

        Only verdicts the ledger has not recorded yet are acted on: a report delivered twice (a
        retry after a lost ack, or a replay) counts once, so replaying it after the ban it caused
        has expired does not ban the peer again. The bans are made before the verdicts are
        recorded: a crash (or a failed ban) in between leaves them unrecorded, and the
        validator's retry bans then."""
        newly = []
        with self.gate:   # one report at a time: two deliveries at once can't both find it new
            fresh = self.ledger.unseen_verdicts(validator_id, report.verdicts)
            for v in fresh:
                if not v.passed and v.check in BANNING_CHECKS and v.peer_id not in self.banned:
                    self.ban(v.peer_id, f"{v.check}: {v.detail}")
                    newly.append(v.peer_id)
            self.ledger.add_verdicts(self.job_id, validator_id, fresh, self.now_ms())
        return newly

    def take_rejections(self) -> int:
        """Groups rejected since the last call (for the step's metrics row)."""
        with self.gate:
            n, self.rejections_since_step = self.rejections_since_step, 0
        return n
