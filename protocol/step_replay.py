"""Checking a published version against a recomputed step (issue 27 item 3; docs/CREDIT.md
section 3, "a recomputed step"): pure arithmetic on adapter states, used by `swarmrl audit
--replay`.

An auditor that replays a job's training from version 0 on the groups its statements credit
holds, at each version v, the published state W_{v-1} (rebuilt from the trainer's signed deltas
and checked against their hashes), and its own optimizer step's change `step_delta` (AdamW, with
the moments of every earlier replayed step). The trainer publishes `W_v = W_{v-1} + Q(x)`, where
`x = step_delta + r` and Q is the job's delta codec (`protocol.delta_codec`: block-quantised, or
exact float32), and carries `r' = x - Q(x)` into the next version (error feedback). So the
replay predicts `W_v` with the same codec and residual (`predict`), and the published state must
agree with the prediction up to floating-point noise: `mismatch` is
`||predicted - W_v|| / ||W_v - W_{v-1}||` (0 for a step made from exactly the credited groups; a
step that trained on other groups, or left some out, moves by a different direction and size).
A trainer that restarted between two versions lost its residual, so `predict` also gives the
prediction without one, and the smaller mismatch of the two counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from swarmrl.protocol import adapter as ad
from swarmrl.protocol import delta_codec as dc

TOLERANCE = 0.05   # mismatch above which a published version is not the credited step (honest: < 1e-3, measured)


def predict(prev: Mapping[str, torch.Tensor], step_delta: Mapping[str, torch.Tensor],
            residual: Mapping[str, torch.Tensor], codec: dc.DeltaCodec) -> tuple[ad.State, ad.State]:
    """(predicted W_v, x): the state the trainer publishes after a step that changes its
    adapter by `step_delta` from `prev`, with `residual` carried (empty: none), under `codec`."""
    x = {k: step_delta[k] + residual[k] for k in step_delta} if residual.keys() == step_delta.keys() \
        else dict(step_delta)
    _, sent = dc.encode_delta(x, codec)
    return ad.apply_delta(prev, sent), x


def mismatch(predicted: Mapping[str, torch.Tensor], published: Mapping[str, torch.Tensor],
             prev: Mapping[str, torch.Tensor]) -> float:
    """||predicted - published|| / ||published - prev|| over every tensor (inf when the published
    version did not move but the prediction did; 0 when neither moved)."""
    num = math.sqrt(sum(float((predicted[k].double() - published[k].double()).pow(2).sum()) for k in published))
    den = math.sqrt(sum(float((published[k].double() - prev[k].double()).pow(2).sum()) for k in published))
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def next_residual(x: Mapping[str, torch.Tensor], prev: Mapping[str, torch.Tensor],
                  published: Mapping[str, torch.Tensor], codec: dc.DeltaCodec) -> ad.State:
    """The residual the trainer carries after publishing `published` from `prev` (x - what was
    sent); empty for the exact float32 codec (nothing is left out)."""
    if codec == "float32":
        return {}
    return {k: x[k] - (published[k] - prev[k]) for k in x}
