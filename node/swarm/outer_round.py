"""DiLoCo's outer rounds among one job's trainers: hivemind averaging of pseudo-gradients.

Legend: `_P` lists hold float32 tensors in the learner's parameter order.

An outer round is an averaging round of `GradientAveraging` (the exact, NaN-proof butterfly
all-reduce of `node.swarm.averaging`) under its own group key, `swarmrl_outer_{job}.0b{version}`,
where `version` is the outer version the round produces. Each member gathers the hash of the
outer state it starts from (`protocol.diloco.tensors_hash` of the outer parameters and the
momentum); every member reads the same gathered hashes, so all of them decide alike whether
the round counts: only when every member started from this trainer's outer state. The
averaged pseudo-gradient is then bit-identical at every member, and so is the outer step each
takes from it (`protocol.diloco.nesterov_step`).

A round waits `timeout_s` for the expected members (the trainer and its live cotrainers) and
starts as soon as all of them joined; a member that never comes is left out when the time is
up, so a dead or slow trainer stalls the others by at most `timeout_s`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import hivemind
import torch

from swarmrl.node.swarm.averaging import GradientAveraging

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OuterOutcome:
    """What one outer round gave this trainer.

    agreed: the round completed and every member started from our outer state.
    delta_P: the averaged pseudo-gradient when `agreed` and some member had weight, else None.
    group_size: members of the round (1: alone).
    bytes_sent: tensor bytes this trainer put on the wire in the round.
    reason: why it did not agree ("" when it did).
    """

    agreed: bool
    delta_P: list[torch.Tensor] | None
    group_size: int
    bytes_sent: int
    reason: str = ""


class OuterRounds:
    """One DiLoCo job's outer rounds in one trainer (see the module docstring)."""

    def __init__(self, dht: hivemind.DHT, job_id: str, template: Sequence[torch.Tensor], *, timeout_s: float,
                 my_id: str) -> None:
        self.my_id = my_id
        self.averaging = GradientAveraging(dht, job_id, template, matchmaking_s=timeout_s,
                                           chunk_timeout_s=timeout_s / 2, allreduce_timeout_s=timeout_s, kind="outer")

    def run(self, version: int, start_hash: bytes, delta_P: Sequence[torch.Tensor], weight: float,
            expected: int) -> OuterOutcome:
        """Average `delta_P` (weight: 1.0 for a trainer that stepped, 0.0 to only help) with the
        members meeting for outer `version`; `expected` members (this trainer included) start
        the round at once. Never raises for a failed round: the outcome says why."""
        pending = self.averaging.begin(version, {"version": version, "start": start_hash.hex(),
                                                 "trainer": self.my_id}, expected=expected)
        got = self.averaging.finish(pending, delta_P, weight)
        if not got.agreed:
            return OuterOutcome(False, None, got.group_size, got.bytes_sent, got.reason or "failed")
        starts = {str(g.get("start", "")) for g in got.gathered.values()}
        if starts != {start_hash.hex()}:
            log.warning("outer round %d: members started from %d different outer states", version, len(starts))
            return OuterOutcome(False, None, got.group_size, got.bytes_sent, "different_start")
        return OuterOutcome(True, got.averaged if got.contributed else None, got.group_size, got.bytes_sent)

    def shutdown(self) -> None:
        """Stop the averager's process (best effort)."""
        self.averaging.shutdown()
