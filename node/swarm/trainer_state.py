"""A trainer's shareable job state: adapter tensors + AdamW state, as (metadata, tensor list).

Trainers of one job must hold identical optimizer state, or the same averaged gradient moves
their adapters differently. A trainer that fell behind (it restarted, joined late, or missed a
round) downloads this from a cotrainer (`DecentralizedAverager.load_state_from_peers`). The
metadata names the version and adapter hash; the adapter is then checked against a cotrainer's
signed update for that version before it is adopted (`node.trainer.job.JobRuntime.sync_from`).

Tensor order: the adapter's tensors sorted by name, then per optimizer parameter index
(exp_avg, exp_avg_sq, step as a 1-element tensor); parameters without state yet (no step taken)
send zeros and are marked absent in the metadata. A DiLoCo job's state (always an outer version)
adds the outer momentum, one tensor per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmrl.protocol import adapter as ad

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class SharedState:
    """What one trainer shares (or received) for a job."""

    job_id: str
    trainer_id: str
    version: int
    adapter_hash: bytes
    adapter: ad.State
    optimizer: dict[str, Any]   # a torch optimizer state_dict
    outer_momentum: list[torch.Tensor] | None = None   # DiLoCo: the outer momentum at this (outer) version


def pack(state: SharedState, params: Sequence[torch.Tensor]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """(metadata, tensors) for hivemind's state sharing; `params` gives the optimizer's shapes."""
    names = sorted(state.adapter)
    tensors = [state.adapter[n].detach().float().contiguous() for n in names]
    opt_state = state.optimizer.get("state", {})
    present = []
    for i, p in enumerate(params):
        s = opt_state.get(i)
        present.append(s is not None)
        if s is None:
            tensors += [torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32),
                        torch.zeros(1)]
        else:
            tensors += [s[k].detach().float().contiguous() for k in ADAM_KEYS]
            tensors.append(torch.as_tensor(s["step"], dtype=torch.float32).reshape(1))
    if state.outer_momentum is not None:
        tensors += [m.detach().float().contiguous() for m in state.outer_momentum]
    meta = {"job_id": state.job_id, "outer_momentum": state.outer_momentum is not None, "trainer": state.trainer_id, "version": state.version,
            "hash": state.adapter_hash.hex(), "names": names, "present": present,
            "param_groups": state.optimizer.get("param_groups", [])}
    return meta, tensors


def unpack(meta: dict[str, Any], tensors: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
           param_groups: list[dict[str, Any]]) -> SharedState:
    """Inverse of `pack`, checked against our own layout and the claimed adapter hash.

    `param_groups` are ours (same job spec, same hyper-parameters).

    Raises:
        ValueError: the layout, shapes or adapter hash do not match.
    """
    try:
        names, present = list(meta["names"]), list(meta["present"])
        version, claimed = int(meta["version"]), bytes.fromhex(meta["hash"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed shared state metadata: {exc}") from exc
    outer = bool(meta.get("outer_momentum", False))
    if len(present) != len(params) or len(tensors) != len(names) + (4 if outer else 3) * len(params):
        raise ValueError("shared state does not match this job's layout")
    adapter = {n: t.float().contiguous() for n, t in zip(names, tensors[:len(names)])}
    if ad.adapter_hash(adapter) != claimed:
        raise ValueError("shared adapter does not match its claimed hash")
    state: dict[int, dict[str, Any]] = {}
    rest = tensors[len(names):]
    for i, (p, has) in enumerate(zip(params, present)):
        exp_avg, exp_avg_sq, step = rest[3 * i: 3 * i + 3]
        if exp_avg.shape != p.shape or exp_avg_sq.shape != p.shape:
            raise ValueError(f"optimizer state {i} has shape {tuple(exp_avg.shape)}, expected {tuple(p.shape)}")
        if has:
            state[i] = {"step": step.reshape(()).clone(), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
    momentum = None
    if outer:
        momentum = [m.float().clone() for m in rest[3 * len(params):]]
        if [m.shape for m in momentum] != [p.shape for p in params]:
            raise ValueError("shared outer momentum does not match this job's LoRA parameters")
    return SharedState(str(meta.get("job_id", "")), str(meta.get("trainer", "")), version, claimed, adapter,
                       {"state": state, "param_groups": param_groups}, momentum)


def priority(version: int, trainer_id: str) -> float:
    """State-sharing priority: the newest version first; at one version, the smaller trainer id
    (the side a split round resolves towards)."""
    return float(version) + 0.5 * (1.0 - int(trainer_id[:8], 16) / float(1 << 32))
