"""Compute only where there is signal: lease a prompt less while its recent groups all had equal rewards.

A group whose rewards are all equal (every completion solved, or every one failed) has zero
group-relative advantage: it teaches nothing (DAPO's dynamic sampling drops such groups after
generating them; Yu et al. 2025, arXiv:2503.14476). When a job's prompts recur (a data set or a
finite problem set, seen once per epoch) the trainer can avoid generating them in the first
place. `PromptSignal` keeps, per prompt (keyed by its prompt token ids, so any environment
works), whether its last `window` groups were all zero-variance; with the job's `lease_filter =
"signal"` the lease book skips a new index whose prompt is such a one (`LeaseBook.issue`'s
`skip`), except for a `keep_share` of them, so a prompt the policy has since learned (or
unlearned) is tried again and can earn its way back.

Every choice stays the trainer's and stays reproducible: whether index i is kept is a keyed draw
from (job seed, i), not the trainer's whim or the worker's; a lease still names its indices,
signed by the trainer, and a validator recomputes each prompt from the job seed and index as
before. The record is in memory: a restarted trainer starts with no record (it leases every
prompt until groups come back), so nothing here needs a ledger.

Also counted here, for the figure the rule is judged by: completion tokens admitted, and those
in zero-variance groups.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import torch

from swarmrl.protocol.grpo.advantages import group_advantages
from swarmrl.protocol.pb import swarm_pb2 as pb

KEEP_SHARE = 0.25      # of the prompts with no recent signal, the share still leased (a keyed draw per index)
WINDOW = 1             # a prompt's last groups that must all be zero-variance for it to be skipped
MAX_PROMPTS = 200_000  # prompts remembered (the least recently seen are forgotten first)


def prompt_key(prompt_token_ids: Sequence[int]) -> bytes:
    """A prompt's identity: sha256 over its token ids (16 bytes)."""
    h = hashlib.sha256(b"swarmrl-prompt\x00")
    for t in prompt_token_ids:
        h.update(int(t).to_bytes(4, "little", signed=False))
    return h.digest()[:16]


def zero_variance(rewards: Sequence[float]) -> bool:
    """True when a group carries no signal, by the trainer's own rule (`protocol.grpo.advantages`:
    fewer than two finite rewards, or a spread within float noise)."""
    return group_advantages(torch.tensor(list(rewards), dtype=torch.float32)).zero_variance


def kept(seed: int, index: int, share: float) -> bool:
    """The keyed draw: whether index `index` of the job with seed `seed` is leased although its
    prompt had no recent signal (true for about `share` of indices)."""
    digest = hashlib.sha256(f"swarmrl-keep/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


class PromptSignal:
    """Recent signal per prompt, the skip rule and the token counts (module docstring). Not
    thread-safe: the trainer calls it under its admission gate."""

    def __init__(self, seed: int, *, keep_share: float = KEEP_SHARE, window: int = WINDOW,
                 max_prompts: int = MAX_PROMPTS) -> None:
        """Raises:
            ValueError: `keep_share` outside [0, 1] or `window` < 1."""
        if not 0.0 <= keep_share <= 1.0 or window < 1:
            raise ValueError("keep_share must lie in [0, 1] and window be at least 1")
        self.seed, self.keep_share, self.window, self.max_prompts = seed, keep_share, window, max_prompts
        self._recent: OrderedDict[bytes, list[bool]] = OrderedDict()   # prompt -> its last groups' zero-variance
        self.tokens = 0                # completion tokens of the groups recorded
        self.tokens_zero_variance = 0  # of those, in zero-variance groups
        self.groups = 0
        self.groups_zero_variance = 0
        self.skipped = 0               # indices the rule skipped

    def record(self, group: pb.Group) -> bool:
        """Record an admitted group's outcome under its prompt; returns whether it was zero-variance."""
        rewards = [c.reward for c in group.completions]
        flat = zero_variance(rewards)
        tokens = sum(len(c.token_ids) for c in group.completions)
        self.groups += 1
        self.tokens += tokens
        if flat:
            self.groups_zero_variance += 1
            self.tokens_zero_variance += tokens
        key = prompt_key(group.prompt_token_ids)
        recent = self._recent.pop(key, [])
        self._recent[key] = (recent + [flat])[-self.window:]
        while len(self._recent) > self.max_prompts:
            self._recent.popitem(last=False)
        return flat

    def skip(self, index: int, prompt_token_ids: Sequence[int]) -> bool:
        """Whether to skip index `index` (its prompt's last `window` groups were all zero-variance,
        and the keyed draw did not keep it); counts a skip."""
        recent = self._recent.get(prompt_key(prompt_token_ids))
        if recent is None or len(recent) < self.window or not all(recent):
            return False
        if kept(self.seed, index, self.keep_share):
            return False
        self.skipped += 1
        return True

    def figures(self) -> dict[str, float]:
        """The token and group counts, and the zero-variance share of tokens (0 before any group)."""
        return {"tokens": float(self.tokens), "tokens_zero_variance": float(self.tokens_zero_variance),
                "zero_variance_token_share": self.tokens_zero_variance / self.tokens if self.tokens else 0.0,
                "groups": float(self.groups), "groups_zero_variance": float(self.groups_zero_variance),
                "prompts_skipped": float(self.skipped)}
