"""DiLoCo's outer step (protocol/diloco.py): the Nesterov math by hand, parity with torch's SGD,
and the job settings that refuse a DiLoCo job that can't work."""

from __future__ import annotations

import pydantic
import pytest
import torch

from swarmrl.protocol import diloco
from swarmrl.protocol.jobspec import JobSpec

BASE = {"base_model": "tiny", "base_model_sha256": "0" * 64}


def test_two_outer_steps_by_hand():
    # theta = 1, Delta = 0.5, lr 0.7, mu 0.9:
    # step 1: m = 0.9*0 + 0.5 = 0.5; theta = 1 - 0.7*(0.5 + 0.9*0.5) = 1 - 0.665 = 0.335
    outer = [torch.tensor([1.0, -2.0])]
    delta = [torch.tensor([0.5, 0.0])]
    s1 = diloco.nesterov_step(outer, delta, diloco.zero_momentum(outer), lr=0.7, momentum=0.9)
    assert torch.allclose(s1.momentum_P[0], torch.tensor([0.5, 0.0]))
    assert torch.allclose(s1.params_P[0], torch.tensor([0.335, -2.0]))
    # step 2 with Delta = -0.25: m = 0.45 - 0.25 = 0.2; theta = 0.335 - 0.7*(-0.25 + 0.18) = 0.384
    s2 = diloco.nesterov_step(s1.params_P, [torch.tensor([-0.25, 0.0])], s1.momentum_P, lr=0.7, momentum=0.9)
    assert torch.allclose(s2.momentum_P[0], torch.tensor([0.2, 0.0]))
    assert torch.allclose(s2.params_P[0], torch.tensor([0.384, -2.0]))
    assert torch.equal(outer[0], torch.tensor([1.0, -2.0]))   # inputs untouched


def test_momentum_zero_is_plain_sgd_and_lr_one_adopts_the_average():
    outer, inner = [torch.tensor([3.0, 1.0])], [torch.tensor([2.0, 1.5])]
    delta = diloco.pseudo_gradient(outer, inner)
    assert torch.equal(delta[0], torch.tensor([1.0, -0.5]))
    step = diloco.nesterov_step(outer, delta, diloco.zero_momentum(outer), lr=1.0, momentum=0.0)
    assert torch.equal(step.params_P[0], inner[0])   # lr 1, no momentum: the inner state itself


def test_matches_torch_sgd_nesterov():
    torch.manual_seed(0)
    theta = [torch.randn(4, 8), torch.randn(8, 3)]
    params = [torch.nn.Parameter(t.clone()) for t in theta]
    sgd = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    momentum = diloco.zero_momentum(theta)
    for _ in range(3):
        delta = [torch.randn_like(t) * 1e-2 for t in theta]
        for p, d in zip(params, delta):
            p.grad = d.clone()
        sgd.step()
        step = diloco.nesterov_step(theta, delta, momentum, lr=0.7, momentum=0.9)
        theta, momentum = step.params_P, step.momentum_P
        for mine, ref in zip(theta, params):   # to rounding: SGD fuses `alpha` multiplies, we don't
            assert torch.allclose(mine, ref.detach(), rtol=1e-6, atol=1e-7)
        for mine, p in zip(momentum, params):
            assert torch.equal(mine, sgd.state[p]["momentum_buffer"])


def test_same_bits_whatever_the_thread_count():
    torch.manual_seed(1)
    theta, delta = [torch.randn(70_001)], [torch.randn(70_001) * 1e-3]
    momentum = [torch.randn(70_001) * 1e-3]
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(diloco.nesterov_step(theta, delta, momentum, lr=0.7, momentum=0.9))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0].params_P[0], outs[1].params_P[0])
    assert torch.equal(outs[0].momentum_P[0], outs[1].momentum_P[0])


def test_outer_step_refuses_bad_input():
    t = [torch.zeros(2)]
    with pytest.raises(ValueError, match="learning rate"):
        diloco.nesterov_step(t, t, t, lr=0.0, momentum=0.9)
    with pytest.raises(ValueError, match="momentum"):
        diloco.nesterov_step(t, t, t, lr=0.7, momentum=1.0)
    with pytest.raises(ValueError, match="shape"):
        diloco.nesterov_step(t, [torch.zeros(3)], t, lr=0.7, momentum=0.9)
    with pytest.raises(ValueError, match="not finite"):
        diloco.nesterov_step(t, [torch.tensor([0.0, float("nan")])], t, lr=0.7, momentum=0.9)


def test_outer_versions_and_hash():
    assert [v for v in range(10) if diloco.is_outer_version(v, 4)] == [0, 4, 8]
    assert diloco.last_outer_version(7, 4) == 4 and diloco.last_outer_version(8, 4) == 8
    a = [torch.tensor([1.0, 2.0])]
    assert diloco.tensors_hash(a) == diloco.tensors_hash([torch.tensor([1.0, 2.0])])
    assert diloco.tensors_hash(a) != diloco.tensors_hash([torch.tensor([1.0, 2.0 + 1e-6])])


@pytest.mark.parametrize(("bad", "field"), [
    ({"inner_steps": 0}, "inner_steps"),
    ({"outer_learning_rate": 0.0}, "outer_learning_rate"),
    ({"outer_learning_rate": -1.0}, "outer_learning_rate"),
    ({"outer_momentum": 1.0}, "outer_momentum"),
    ({"outer_momentum": -0.1}, "outer_momentum"),
    ({"inner_steps": 3, "steps": 10}, "inner_steps"),
])
def test_a_diloco_job_that_cant_work_is_refused_naming_the_field(bad, field):
    with pytest.raises(pydantic.ValidationError, match=field):
        JobSpec(**BASE, sync="diloco", **{"steps": 12, **bad})


def test_diloco_settings_need_sync_diloco_and_stay_out_of_other_jobs_ids():
    with pytest.raises(pydantic.ValidationError, match="inner_steps is a DiLoCo setting"):
        JobSpec(**BASE, inner_steps=4)
    plain = JobSpec(**BASE)
    assert '"sync"' not in plain.canonical_json() and '"inner_steps"' not in plain.canonical_json()
    job = JobSpec(**BASE, sync="diloco", inner_steps=4, steps=8, outer_learning_rate=0.5)
    assert JobSpec.from_json(job.canonical_json()) == job
    assert job.sync_settings() == {"sync": "diloco", "inner_steps": 4, "outer_learning_rate": 0.5,
                                   "outer_momentum": 0.9, "outer_codec": "int8"}
    assert '"outer_codec"' not in plain.canonical_json()
    with pytest.raises(pydantic.ValidationError, match="outer_codec"):
        JobSpec(**BASE, sync="diloco", inner_steps=4, steps=8, outer_codec="int4")
    with pytest.raises(pydantic.ValidationError, match="outer_codec is a DiLoCo setting"):
        JobSpec(**BASE, outer_codec="float32")
