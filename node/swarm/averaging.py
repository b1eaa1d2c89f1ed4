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

A round *agrees* when the member received every part from its reducer. Only then may a trainer
use the result; otherwise it falls back to its own gradient (see `node.trainer.job`), and the
version/hash reconciliation between trainers repairs a split (`node.swarm.cotrainers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import BannedException, TensorPartContainer, TensorPartReducer
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression, deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import (
    aiter_with_timeout,
    amap_in_executor,
    as_aiter,
    attach_event_on_finished,
    azip,
    enter_asynchronously,
)

log = logging.getLogger(__name__)

VERSION_BITS = 32


def _part_ok(part: torch.Tensor, weight: float) -> bool:
    return math.isfinite(weight) and weight >= 0 and bool(torch.isfinite(part).all())


class ZeroSafeReducer(TensorPartReducer):
    """hivemind's reducer, except that a part nobody gave weight to averages to zeros."""

    def check_current_part_finished(self) -> None:
        """Once every sender's share of the current part is in, resolve it: the weighted sum over
        the total weight, or zeros when the total weight is 0 (where hivemind divides 0 by 0: NaN).
        """
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            total = self.accumulator.div_(self.denominator) if self.denominator > 0 else self.accumulator.zero_()
            self.current_part_future.set_result(total)
            self.reset_accumulators()


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce whose members end with identical averaged bits and whose reducers
    leave non-finite parts out of the sum (see the module docstring)."""

    tensor_part_reducer: TensorPartReducer   # hivemind's until __init__ swaps in a ZeroSafeReducer

    def __init__(self, *, tensors: Sequence[torch.Tensor], peer_fractions: tuple[float, ...], **kwargs: Any) -> None:
        container_kwargs = {k: kwargs[k] for k in ("compression", "part_size_bytes", "tensor_infos") if k in kwargs}
        super().__init__(tensors=tensors, peer_fractions=peer_fractions, **kwargs)
        index = self.ordered_peer_ids.index(self.peer_id)
        self.tensor_part_container = TensorPartContainer(tensors, peer_fractions, return_deltas=False,
                                                         **container_kwargs)
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(index)
        unused = self.tensor_part_reducer   # hivemind's, replaced below: retire it quietly
        unused.current_part_future.cancel()
        unused.finished.set()
        self.tensor_part_reducer = ZeroSafeReducer(tuple(p.shape for p in self.parts_for_local_averaging),
                                                   len(self.sender_peer_ids))
        self.excluded: set[PeerID] = set()
        self.failed_reducers: set[PeerID] = set()
        self.bytes_sent = 0   # serialized AveragingData this member sent: its parts out, averaged parts back
        self.local_tensors = list(tensors)
        self.lossy = not isinstance(self.tensor_part_container.compression, NoCompression)
        self.send_error = [torch.zeros_like(t) for t in tensors] if self.lossy else None
        self._replies: dict[int, asyncio.Future[runtime_pb2.Tensor]] = {}

    def _record_send_error(self, part: torch.Tensor, sent: runtime_pb2.Tensor) -> None:
        """Add `part` - what the reducer will decode from `sent` to `send_error`, where `part` (a
        view of one of the local tensors, as hivemind's partition makes them) lies."""
        if self.send_error is None:
            return
        err = part.detach().float() - deserialize_torch_tensor(sent).float().view(-1)
        ptr = part.data_ptr()
        for t, e in zip(self.local_tensors, self.send_error):
            start = t.data_ptr()
            if start <= ptr < start + t.numel() * t.element_size():
                offset = (ptr - start) // t.element_size()
                e.view(-1)[offset: offset + part.numel()] = err
                return

    async def _reply_for(self, part_index: int, averaged: torch.Tensor) -> runtime_pb2.Tensor:
        """The averaged part as every member receives it: serialized once (the first member to
        ask computes it) with this runner's compression, so all members decode the same bytes."""
        future = self._replies.get(part_index)
        if future is None:
            future = self._replies[part_index] = asyncio.get_event_loop().create_future()
            compression = self.tensor_part_container.compression
            try:
                data = await asyncio.get_event_loop().run_in_executor(
                    None, lambda: compression.compress(averaged, CompressionInfo.from_tensor(averaged)))
            except BaseException as exc:   # every member waiting on this part fails now, not at the timeout
                future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
                raise
            future.set_result(data)
        return await future

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        raw = [part for part, _ in self.tensor_part_container._input_parts_by_peer[peer_index]]
        sent = 0
        async for msg in super()._generate_input_for_peer(peer_index):
            self.bytes_sent += msg.ByteSize()
            if sent < len(raw):
                self._record_send_error(raw[sent], msg.tensor_part)
            sent += 1
            yield msg

    async def _accumulate_checked(self, sender: PeerID, sender_index: int, part_index: int,
                                  part: torch.Tensor, weight: float) -> torch.Tensor:
        shape = tuple(self.tensor_part_reducer.part_shapes[part_index]) if part_index < len(
            self.tensor_part_reducer.part_shapes) else None
        if tuple(part.shape) != shape or not _part_ok(part, weight):
            if sender not in self.excluded:
                log.warning("averaging: excluding %s: a part of shape %s (expected %s) or non-finite",
                            sender, tuple(part.shape), shape)
            self.excluded.add(sender)
            part, weight = torch.zeros(shape or part.shape), 0.0
        averaged: torch.Tensor = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part,
                                                                              weight=weight)
        return averaged

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id == self.peer_id:
            sender_index = self.sender_peer_ids.index(peer_id)
            for part_index, part in enumerate(self.parts_for_local_averaging):
                averaged = await self._accumulate_checked(peer_id, sender_index, part_index, part, self.weight)
                reply = await self._reply_for(part_index, averaged)   # the bytes every member decodes
                self.tensor_part_container.register_processed_part(peer_index, part_index,
                                                                   deserialize_torch_tensor(reply))
            return
        try:
            done_sending = asyncio.Event()
            inputs = self._generate_input_for_peer(peer_index)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(attach_event_on_finished(inputs, done_sending))
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            part_index = 0

            def _decode(msg: averaging_pb2.AveragingData) -> torch.Tensor:
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                part: torch.Tensor = deserialize_torch_tensor(msg.tensor_part)
                if not bool(torch.isfinite(part).all()):
                    raise AllreduceException(f"{peer_id} sent a non-finite averaged part")
                return part

            async for averaged in amap_in_executor(_decode, aiter_with_timeout(stream, self.reducer_timeout),
                                                   max_prefetch=self.tensor_part_container.prefetch):
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
                part_index += 1
            if part_index != self.tensor_part_container.num_parts_by_peer[peer_index]:
                raise AllreduceException(f"{peer_id} sent {part_index} parts, expected "
                                         f"{self.tensor_part_container.num_parts_by_peer[peer_index]}")
        except BaseException as exc:
            log.debug("averaging: reducer %s failed: %r", peer_id, exc)
            self.failed_reducers.add(peer_id)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        sender = self.sender_peer_ids[sender_index]
        part_index = 0
        try:
            async for part, weight in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight),
                stream, max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged = await self._accumulate_checked(sender, sender_index, part_index, part, weight)
                    part_index += 1
                except BannedException:
                    break
                data = await self._reply_for(part_index - 1, averaged)
                reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=data)
                self.bytes_sent += reply.ByteSize()
                yield reply
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(sender)


class ExactAverager(hivemind.averaging.DecentralizedAverager):
    """A DecentralizedAverager that runs `ExactAllReduceRunner`, copies (not adds) the result and
    reports, per round, the gathered metadata, the excluded senders and failed reducers. Its
    shareable state (for `load_state_from_peers`) comes from `state_provider`, set in the host."""

    state_provider: Callable[[], tuple[Any, Sequence[torch.Tensor]]] | None = None

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> dict[str, Any]:
        try:
            bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            gathered = {p.to_base58(): self.serializer.loads(b) for p, b in zip(group_info.peer_ids, user_bytes)}
            modes = tuple(map(AveragingMode, mode_ids))
            download = [b if m != AveragingMode.CLIENT else 0.0 for b, m in zip(bandwidths, modes)]
            fractions = await asyncio.get_event_loop().run_in_executor(
                None, load_balance_peers, self.total_size, download, min_vector_size)
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                runner = await self._run_exact(local_tensors, group_info, peer_fractions=fractions, **kwargs)
            return {"gathered": gathered, "excluded": sorted(p.to_base58() for p in runner.excluded),
                    "failed_reducers": sorted(p.to_base58() for p in runner.failed_reducers),
                    "group_size": len(group_info.peer_ids), "bytes_sent": runner.bytes_sent,
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
    DiLoCo's pseudo-gradients, `node.swarm.outer_round`).
    """

    def __init__(self, dht: hivemind.DHT, job_id: str, template: Sequence[torch.Tensor], *,
                 matchmaking_s: float = 2.0, chunk_timeout_s: float = 30.0, allreduce_timeout_s: float = 60.0,
                 kind: str = "avg", start_timeout_s: float = START_TIMEOUT_S,
                 compression: CompressionBase | None = None) -> None:
        """compression: how tensor parts travel (default: float32, lossless).

        Raises:
            AveragerStartFailed: the averager's process was not ready within `start_timeout_s`
                (it is terminated; the caller may try again later)."""
        self.dht = dht
        self.prefix = f"swarmrl_{kind}_{job_id}"
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
        """Start matchmaking for `version` now; `info` is gathered from every member (msgpack-able).
        With `expected` members (this trainer included), the group starts as soon as all joined."""
        if expected != self._target:
            self.averager.set_target_group_size(expected)
            self._target = expected
        self.averager.set_group_bits(self.bits(version))
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
        sent = int(result.get("bytes_sent", 0))
        if result["failed_reducers"]:
            return RoundOutcome(False, group_size=result["group_size"], excluded=result["excluded"],
                                gathered=result["gathered"], reason="failed_reducer", bytes_sent=sent)
        with self.averager.get_tensors() as tensors:
            averaged = [t.detach().clone() for t in tensors]
        if not all(bool(torch.isfinite(t).all()) for t in averaged):
            return RoundOutcome(False, group_size=result["group_size"], excluded=result["excluded"],
                                gathered=result["gathered"], reason="non_finite_result", bytes_sent=sent)
        error = result.get("send_error")
        return RoundOutcome(True, averaged[:-1], bool(averaged[-1].item() > 0), result["group_size"],
                            result["excluded"], result["gathered"], bytes_sent=sent,
                            send_error=None if error is None else [torch.from_numpy(e) for e in error[:-1]])

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
