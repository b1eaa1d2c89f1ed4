"""DiLoCo's outer-round payload (issue 26 item 2): hivemind's uniform 8-bit quantisation where it
suits a part and float32 where it doesn't (`OuterInt8`), and a reducer that leaves a part of the
wrong shape out of the average (zeros, weight 0, the sender counted as excluded), as it does a
non-finite one."""

from __future__ import annotations

import asyncio

import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from swarmrl.node.swarm.exact_allreduce import ExactAllReduceRunner, ZeroSafeReducer
from swarmrl.node.swarm.outer_round import MIN_QUANTISED, OuterInt8


def _roundtrip(x: torch.Tensor) -> tuple[runtime_pb2.Tensor, torch.Tensor]:
    codec = OuterInt8()
    data = codec.compress(x, CompressionInfo.from_tensor(x))
    return data, deserialize_torch_tensor(data)


def test_large_parts_travel_in_a_quarter_of_the_bytes_within_the_quantisation_error() -> None:
    x = torch.randn(10_240, generator=torch.Generator().manual_seed(0)) * 1e-3
    data, back = _roundtrip(x)
    assert data.compression == runtime_pb2.UNIFORM_8BIT
    assert len(data.buffer) <= x.numel() + 4 * 256 + 8            # 1 byte a value + a 256-entry codebook
    bucket = 6 * float(x.std()) / 256   # hivemind's uniform grid spans 6 sigma; values past +-3 sigma clip
    assert float((back - x).pow(2).mean().sqrt()) <= bucket
    assert torch.equal(_roundtrip(x)[1], back)                     # deterministic: the same bytes every time


def test_small_constant_and_non_finite_parts_travel_as_float32() -> None:
    for x in (torch.randn(MIN_QUANTISED - 1), torch.full((4096,), 0.25), torch.tensor([1.0, float("nan")] * 512)):
        data, back = _roundtrip(x)
        assert data.compression == runtime_pb2.NONE
        assert torch.equal(back.isnan(), x.isnan()) and torch.equal(back.nan_to_num(), x.nan_to_num())


def test_a_part_of_the_wrong_shape_is_left_out_of_the_average() -> None:
    runner = object.__new__(ExactAllReduceRunner)   # only the reducer's side: no p2p, no group
    runner.excluded = set()

    async def go() -> tuple[torch.Tensor, torch.Tensor]:
        runner.tensor_part_reducer = ZeroSafeReducer([torch.Size((4,))], 2)
        bad = runner._accumulate_checked("peer-b", 1, 0, torch.ones(3), 1.0)
        good = runner._accumulate_checked("peer-a", 0, 0, torch.full((4,), 2.0), 1.0)
        out = await asyncio.gather(good, bad)
        return out[0], out[1]

    averaged, same = asyncio.run(go())
    assert torch.equal(averaged, torch.full((4,), 2.0)) and torch.equal(same, averaged)
    assert runner.excluded == {"peer-b"}
