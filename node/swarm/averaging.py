"""Gradient averaging among one job's trainers: hivemind's DecentralizedAverager, exact and NaN-proof.

Legend: tensors here are flat lists of LoRA gradient tensors in the learner's parameter order.

Trainers of one job average their LoRA gradients before every optimizer step, weighted by the
tokens each admitted, so that they take the same step and publish the same adapter version. The
group key holds the job and the policy version, so only trainers at the same version meet.
Two changes to hivemind's butterfly all-reduce (`hivemind.averaging.allreduce`, Ryabinin et al.
2021, "Moshpit SGD") make that safe:

1. Exact. hivemind's reducer sends each member `average - local` and the member adds it back,
   which differs from `average` in the last bit. Here the reducer of a part sends the averaged
   part itself and every member copies it, so all members of a round that completes hold
   bit-identical tensors.
2. Malformed inputs are excluded. A reducer checks every incoming part (its own included) and
   its weight; a part of the wrong shape or holding NaN/inf, or a non-finite or negative weight,
   enters the sum as zeros with weight 0 and the sender is counted as excluded. A part whose senders all have
   weight 0 averages to zeros (not 0/0). A member that receives a non-finite averaged part
   treats that reducer as failed.
3. Compressed rounds stay exact. With a lossy `compression` (DiLoCo's int8 outer rounds,
   `OuterInt8`) a reducer quantises each averaged part once and sends every member, itself
   included, those same bytes, so the members still hold bit-identical results. A member's
   own quantisation error on the parts it sent (`send_error`, float32, shaped like the tensors)
   comes back with the round, for error feedback (`node.swarm.outer_round`).
4. Did anyone contribute? Every member also averages a one-element tensor holding 1: the result
   is 1 when some member had weight > 0 and 0 when none had, the same at every member.
5. Authenticated members. hivemind knows a member only by its libp2p peer id. Each trainer
   gathers a ticket signed with its trainer key (`protocol.averaging_ticket`); a member whose
   ticket is missing, forged, replayed or made for another round, or whose key the job does not
   allow, reduces no part and none of its parts is taken: the round goes on without it, and the
   outcome names it with the reason (`RoundOutcome.refused`). Points 1-3 run in
   `node.swarm.exact_allreduce`.

A round *agrees* when the member received every part from its reducer. Only then may a trainer
use the result; otherwise it falls back to its own gradient (see `node.trainer.job`), and the
version/hash reconciliation between trainers repairs a split (`node.swarm.cotrainers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.compression import CompressionBase, NoCompression
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import as_aiter, azip, enter_asynchronously

from swarmrl.node.swarm.admitting_matchmaking import admitting_matchmaking
from swarmrl.node.swarm.exact_allreduce import ExactAllReduceRunner
from swarmrl.protocol.averaging_ticket import TICKET_KEY, admit_members, make_ticket
from swarmrl.protocol.identity import Identity

log = logging.getLogger(__name__)

VERSION_BITS = 32


@dataclass(frozen=True)
class RoundAdmission:
    """Which members an averager lets into its rounds (`protocol.averaging_ticket`): members whose
    ticket for this job and `kind` verifies and, with `allowed` (trainer ids), names one of them."""

    job_id: str
    kind: str
    allowed: frozenset[str] | None = None


class ExactAverager(hivemind.averaging.DecentralizedAverager):
    """A DecentralizedAverager that runs `ExactAllReduceRunner`, copies (not adds) the result and
    reports, per round, the gathered metadata, the excluded senders and failed reducers. With
    `admission` set, a member whose ticket is refused takes no part in the round: it reduces no
    part and its parts are not taken (hivemind's AUX mode with a zero share, so it is no sender);
    the round goes on without it, and the outcome names it with the reason. Its shareable state
    (for `load_state_from_peers`) comes from `state_provider`, set in the host."""

    state_provider: Callable[[], tuple[Any, Sequence[torch.Tensor]]] | None = None
    admission: RoundAdmission | None = None

    def run(self) -> None:
        """The averager's process: with `admission`, its matchmaking leader turns away joiners
        whose ticket is refused (`node.swarm.admitting_matchmaking`; patched in this process only)."""
        if self.admission is not None:
            a = self.admission
            hivemind.averaging.averager.Matchmaking = admitting_matchmaking(a.job_id, a.kind, a.allowed)
        super().run()

    def _admit(self, group_info: GroupInfo, infos: list[Any],
               modes: list[AveragingMode]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """Check the members' tickets: (gathered metadata of the admitted members, with "trainer"
        set to the trainer id that signed, refused peer -> reason); refused members' modes become AUX.

        Raises:
            AllreduceException: this averager's own ticket was refused.
        """
        infos = [i if isinstance(i, dict) else {} for i in infos]
        peers = group_info.peer_ids
        if self.admission is None:
            return {p.to_base58(): i for p, i in zip(peers, infos)}, {}
        mine = infos[peers.index(self.peer_id)]
        checks = admit_members([(p.to_bytes(), i) for p, i in zip(peers, infos)], job_id=self.admission.job_id,
                               kind=self.admission.kind, version=int(mine.get("version", -1)),
                               allowed=self.admission.allowed)
        admitted, refused = {}, {}
        for k, (p, info, check) in enumerate(zip(peers, infos, checks)):
            if check.admitted:
                admitted[p.to_base58()] = {**{key: v for key, v in info.items() if key != TICKET_KEY},
                                           "trainer": check.trainer_id}
            else:
                refused[p.to_base58()] = check.reason
                modes[k] = AveragingMode.AUX
        if self.peer_id.to_base58() in refused:
            raise AllreduceException(f"our own ticket was refused: {refused[self.peer_id.to_base58()]}")
        for p, why in refused.items():
            log.warning("averaging %s: member %s refused: %s", self.prefix, p, why)
        at_the_door = self._matchmaking.refused   # joiners this leader turned away (`admitting_matchmaking`)
        if at_the_door:
            refused = {**at_the_door, **refused}
            at_the_door.clear()
        return admitted, refused

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> dict[str, Any]:
        try:
            bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            modes = list(map(AveragingMode, mode_ids))
            gathered, refused = self._admit(group_info, [self.serializer.loads(b) for b in user_bytes], modes)
            download = [0.0 if m == AveragingMode.CLIENT or p.to_base58() in refused else b
                        for p, b, m in zip(group_info.peer_ids, bandwidths, modes)]
            fractions = await asyncio.get_event_loop().run_in_executor(
                None, load_balance_peers, self.total_size, download, min_vector_size)
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                runner = await self._run_exact(local_tensors, group_info, peer_fractions=fractions,
                                               modes=tuple(modes), **kwargs)
            return {"gathered": gathered, "excluded": sorted(p.to_base58() for p in runner.excluded),
                    "failed_reducers": sorted(p.to_base58() for p in runner.failed_reducers),
                    "group_size": len(gathered), "bytes_sent": runner.bytes_sent, "refused": refused,
                    "send_error": None if runner.send_error is None else [e.numpy() for e in runner.send_error]}
        except BaseException as exc:
            if isinstance(exc, Exception):
                log.debug("averaging round failed: %r", exc)
            raise MatchmakingException(f"Unable to run All-Reduce: {exc}") from exc

    async def _run_exact(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                         **kwargs: Any) -> ExactAllReduceRunner:
        runner = ExactAllReduceRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                                      group_id=group_info.group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
        self._running_groups[group_info.group_id].set_result(runner)
        async for tensor, averaged in azip(as_aiter(*tensors), runner):
            tensor.copy_(averaged)
        return runner

    def set_target_group_size(self, size: int | None) -> None:
        """Assemble a group as soon as `size` members joined (None: wait the whole matchmaking time)."""
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_set_target_group_size", [], {"size": size, "future": future}))
        future.result()

    async def _set_target_group_size(self, size: int | None, future: MPFuture) -> None:
        self._matchmaking.target_group_size = size
        future.set_result(None)

    def get_current_state(self) -> tuple[Any, list[torch.Tensor], Any]:
        """(metadata, tensors, infos) for a peer's `load_state_from_peers`: `state_provider`'s when set."""
        if self.state_provider is None:
            state: tuple[Any, list[torch.Tensor], Any] = super().get_current_state()
            return state
        metadata, tensors = self.state_provider()
        return metadata, list(tensors), None


@dataclass
class RoundOutcome:
    """What one averaging round gave this trainer.

    averaged: the averaged tensors (bit-identical at every member) when `agreed`, else None.
    """

    agreed: bool
    averaged: list[torch.Tensor] | None = None
    contributed: bool = False          # some member had weight > 0 (else the average is all zeros)
    group_size: int = 1
    excluded: list[str] = field(default_factory=list)
    gathered: dict[str, dict[str, Any]] = field(default_factory=dict)
    reason: str = ""
    bytes_sent: int = 0                # tensor bytes this member put on the wire (protobuf-serialized parts)
    send_error: list[torch.Tensor] | None = None   # lossy rounds: what its sent parts lost to quantisation
    refused: dict[str, str] = field(default_factory=dict)   # members whose ticket was refused: peer -> reason


TicketSigner = Callable[[str, str, int, bytes, dict[str, Any]], bytes]
"""(job id, kind, version, averager peer id, metadata) -> the signed ticket (`make_ticket`'s signature)."""


@dataclass
class PendingRound:
    """A round whose matchmaking has begun; gradients go in with `GradientAveraging.finish`."""

    version: int
    control: StepControl


START_TIMEOUT_S = 60.0   # the averager's process must be ready this soon (seconds), else AveragerStartFailed


class AveragerStartFailed(RuntimeError):
    """The averager's background process did not become ready in time (it was terminated)."""


class GradientAveraging:
    """One job's gradient averager in a trainer (host side of an `ExactAverager` process).

    `template` gives the shapes (the LoRA parameters, in order). Rounds for version v use the
    group key `swarmrl_{kind}_{job}.0b{v as 32 bits}` (kind "avg": per-step gradients; "outer":
    DiLoCo's pseudo-gradients, `node.swarm.outer_round`). Every round is authenticated: this
    trainer gathers a ticket signed with `identity` and admits only members whose tickets hold for
    this job and kind and, with `allowed` (trainer ids), name an allowed trainer
    (`protocol.averaging_ticket`).
    """

    def __init__(self, dht: hivemind.DHT, job_id: str, template: Sequence[torch.Tensor], *, identity: Identity,
                 allowed: frozenset[str] | None = None,
                 matchmaking_s: float = 2.0, chunk_timeout_s: float = 30.0, allreduce_timeout_s: float = 60.0,
                 kind: str = "avg", start_timeout_s: float = START_TIMEOUT_S,
                 compression: CompressionBase | None = None) -> None:
        """compression: how tensor parts travel (default: float32, lossless). `allowed` need not
        hold this trainer's own id.

        Raises:
            AveragerStartFailed: the averager's process was not ready within `start_timeout_s`
                (it is terminated; the caller may try again later)."""
        self.dht, self.job_id, self.kind = dht, job_id, kind
        self.prefix = f"swarmrl_{kind}_{job_id}"
        self.sign_ticket: TicketSigner = lambda *args: make_ticket(identity, *args)
        self.matchmaking_s = matchmaking_s
        self.allreduce_timeout_s = allreduce_timeout_s
        tensors = [torch.zeros_like(t, dtype=torch.float32, device="cpu") for t in template] + [torch.zeros(1)]
        ctrl_c = signal.getsignal(signal.SIGINT)   # hivemind's run_in_background sets SIG_IGN in *this* process
        try:
            self.averager = ExactAverager(
                tensors, dht, start=False, prefix=self.prefix, min_group_size=2, initial_group_bits="0" * VERSION_BITS,
                min_matchmaking_time=matchmaking_s, request_timeout=min(1.0, matchmaking_s / 2),
                next_chunk_timeout=chunk_timeout_s, allreduce_timeout=allreduce_timeout_s, declare_state_period=10.0,
                compression=compression or NoCompression(),
            )
            self.averager.admission = RoundAdmission(
                job_id, kind, None if allowed is None else frozenset(allowed) | {identity.peer_id})
            try:   # hivemind's start=True waits for the process with no limit: it hung a restarted trainer
                self.averager.run_in_background(await_ready=True, timeout=start_timeout_s)
            except TimeoutError as exc:
                self.averager.terminate()
                self.averager.join(5.0)
                raise AveragerStartFailed(f"the averager's process was not ready after {start_timeout_s:.0f}s") \
                    from exc
        finally:   # so a trainer with cotrainers still stops on Ctrl-C (its handler from node.runtime.lifecycle)
            if ctrl_c is not None:
                signal.signal(signal.SIGINT, ctrl_c)
        self.peer_id = dht.peer_id
        self._target: int | None = None

    @staticmethod
    def bits(version: int) -> str:
        """`version` modulo 2**VERSION_BITS as a zero-padded binary string (its matchmaking group bits)."""
        return format(version % (1 << VERSION_BITS), f"0{VERSION_BITS}b")

    def group_key(self, version: int) -> str:
        """The DHT key where averagers matchmaking for `version` meet."""
        return f"{self.prefix}.0b{self.bits(version)}"

    def peer_round_open(self, version: int) -> bool:
        """True when another averager is looking for a group at `version` (so this trainer joins)."""
        found = self.dht.get(self.group_key(version), latest=True)
        if found is None or not isinstance(found.value, dict):
            return False
        mine = self.peer_id.to_bytes()
        return any(k != mine and bool(v.value) for k, v in found.value.items())

    def begin(self, version: int, info: dict[str, Any], expected: int | None = None) -> PendingRound:
        """Start matchmaking for `version` now; `info` is gathered from every member (plain JSON-able
        values; its "version" is set to `version`, and its signed ticket is added).
        With `expected` members (this trainer included), the group starts as soon as all joined."""
        if expected != self._target:
            self.averager.set_target_group_size(expected)
            self._target = expected
        self.averager.set_group_bits(self.bits(version))
        info = {**info, "version": version}   # every member checks the tickets against its own round's version
        info[TICKET_KEY] = self.sign_ticket(self.job_id, self.kind, version, self.peer_id.to_bytes(), info)
        timeout = self.matchmaking_s + 1.0
        control = self.averager.step(gather=info, weight=0.0, timeout=timeout, allow_retries=False,
                                     require_trigger=True, wait=False)
        return PendingRound(version, control)

    def finish(self, pending: PendingRound, grads: Sequence[torch.Tensor], weight: float) -> RoundOutcome:
        """Put this trainer's gradients (weight = the loss's denominator,
        `LossNormalizer.denominator`; 0 to only help) into the round and wait for it. Never raises for a failed round: the outcome says why."""
        control = pending.control
        with self.averager.get_tensors() as tensors:
            for t, g in zip(tensors, grads):
                t.copy_(g)
            tensors[-1].fill_(1.0)
        if not control.done():
            with contextlib.suppress(AssertionError):
                control.weight = float(weight)
            control.allow_allreduce()
        try:
            result = control.result(timeout=self.matchmaking_s * 2 + self.allreduce_timeout_s + 5)
        except Exception as exc:  # noqa: BLE001 - a failed/lonely round is an outcome, not an error
            return RoundOutcome(False, reason=_reason(exc))
        if result is None:
            return RoundOutcome(False, reason="no_group")
        sent, refused = int(result.get("bytes_sent", 0)), dict(result.get("refused", {}))
        if result["group_size"] < 2:   # every other member was refused: a round of one is no round
            return RoundOutcome(False, group_size=result["group_size"], gathered=result["gathered"],
                                reason="others_refused", bytes_sent=sent, refused=refused)
        if result["failed_reducers"]:
            return RoundOutcome(False, group_size=result["group_size"], excluded=result["excluded"],
                                gathered=result["gathered"], reason="failed_reducer", bytes_sent=sent, refused=refused)
        with self.averager.get_tensors() as tensors:
            averaged = [t.detach().clone() for t in tensors]
        if not all(bool(torch.isfinite(t).all()) for t in averaged):
            return RoundOutcome(False, group_size=result["group_size"], excluded=result["excluded"],
                                gathered=result["gathered"], reason="non_finite_result", bytes_sent=sent,
                                refused=refused)
        error = result.get("send_error")
        return RoundOutcome(True, averaged[:-1], bool(averaged[-1].item() > 0), result["group_size"],
                            result["excluded"], result["gathered"], bytes_sent=sent,
                            send_error=None if error is None else [torch.from_numpy(e) for e in error[:-1]],
                            refused=refused)

    def set_state(self, provider: Callable[[], tuple[Any, Sequence[torch.Tensor]]], priority: float) -> None:
        """Share this trainer's state (`provider()` -> (metadata, tensors)) with peers that load it;
        peers prefer the highest `priority`."""
        self.averager.state_provider = provider
        self.averager.state_sharing_priority = priority

    def load_state(self, timeout_s: float = 30.0) -> tuple[Any, list[torch.Tensor]] | None:
        """Download the state of the peer with the highest priority (None when none answers)."""
        try:
            got = self.averager.load_state_from_peers(timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - peers can fail; the caller retries later
            log.warning("loading state from peers failed: %r", exc)
            return None
        if got is None:
            return None
        metadata, tensors = got
        return metadata, list(tensors)

    def shutdown(self) -> None:
        """Stop the averager's process (best effort, never raises)."""
        with contextlib.suppress(Exception):
            self.averager.shutdown()


def _reason(exc: BaseException) -> str:
    text = str(exc)
    if "could not find a group" in text or isinstance(exc, TimeoutError):
        return "no_group"
    return f"failed: {type(exc).__name__}: {text[:120]}"
