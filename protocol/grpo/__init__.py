# Legend: B = sequences (completions), T = completion tokens (right-padded), G = group size.
"""Pure GRPO math: group-relative advantages, the GRPO-family policy losses, off-policy metrics.

Imports only torch, pydantic and the standard library.
"""

from swarmrl.protocol.grpo.advantages import GroupAdvantages, batch_advantages, group_advantages
from swarmrl.protocol.grpo.config import LOSS_VARIANTS, LossConfig
from swarmrl.protocol.grpo.losses import LossNormalizer, policy_loss
from swarmrl.protocol.grpo.metrics import effective_sample_size, logprob_drift, staleness_histogram

__all__ = [
    "LOSS_VARIANTS",
    "GroupAdvantages",
    "LossConfig",
    "LossNormalizer",
    "batch_advantages",
    "effective_sample_size",
    "group_advantages",
    "logprob_drift",
    "policy_loss",
    "staleness_histogram",
]
