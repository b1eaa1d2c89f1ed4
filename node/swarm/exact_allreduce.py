"""The butterfly all-reduce of one averaging round, made exact and NaN-proof (`node.swarm.averaging`).

`ExactAllReduceRunner` is hivemind's `AllReduceRunner` (`hivemind.averaging.allreduce`, Ryabinin et
al. 2021, "Moshpit SGD") with the changes that `node.swarm.averaging`'s docstring lists: a reducer
sends the averaged part itself (serialized once, so every member decodes the same bytes), leaves a
part of the wrong shape or holding NaN/inf out of the sum (`ZeroSafeReducer`: a part nobody gave
weight to averages to zeros) and records what a lossy codec took from this member's sent parts.

Legend: tensors are flat lists of float32 tensors in the learner's parameter order; a "part" is
the slice of them one reducer averages.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.averaging.partition import BannedException, TensorPartContainer, TensorPartReducer
from hivemind.compression import CompressionInfo, NoCompression, deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished

log = logging.getLogger(__name__)


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
