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

With `codec = "int8"` (the job's `outer_codec`, the default) the parts travel as hivemind's
uniform 8-bit quantisation (`OuterInt8`: a 256-entry codebook per part, about a quarter of the
float32 bytes), still bit-identical at every member (`node.swarm.averaging`, point 3). What a
trainer's own parts lost to it comes back as `OuterOutcome.send_error`, which the trainer adds
to its next pseudo-gradient (error feedback, as in 1-bit SGD, Seide et al. 2014, and EF-SGD,
Karimireddy et al. 2019, arXiv:1901.09847), so the loss does not accumulate over rounds. The
reducer's quantisation of the averaged part is the same at every member and is not fed back.

Rounds are authenticated (`node.swarm.averaging`, point 5): each member's signed ticket ties its
libp2p peer to a trainer key of the job, and a member whose ticket is refused (or whose payload
has the wrong shape or a non-finite value) is left out of the round, which goes on without it;
`OuterOutcome.refused` names each one with its reason. The start states and the split's winner
are read from admitted members only, under the trainer ids their tickets prove.

A round waits `timeout_s` for the expected members (the trainer and its live cotrainers) and
starts as soon as all of them joined; a member that never comes is left out when the time is
up, so a dead or slow trainer stalls the others by at most `timeout_s`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import hivemind
import torch
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression, Uniform8BitQuantization
from hivemind.proto import runtime_pb2

from swarmrl.node.swarm.averaging import GradientAveraging, RoundOutcome
from swarmrl.protocol.identity import Identity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OuterOutcome:
    """What one outer round gave this trainer.

    agreed: the round completed and every member started from our outer state.
    delta_P: the averaged pseudo-gradient when `agreed` and some member had weight, else None.
    group_size: members of the round (1: alone).
    bytes_sent: tensor bytes this trainer put on the wire in the round.
    reason: why it did not agree ("" when it did).
    send_error_P: int8 rounds that agreed: what this trainer's sent parts lost to quantisation
        (float32, shaped like `delta_P`), for the next round's error feedback; else None.
    split_winner: when the members started from different outer states (a split), the smallest
        trainer id among them if it is not this trainer's (this trainer then adopts that one's
        outer version, `node.trainer.job`); "" otherwise.
    refused: members left out of the round: peer -> reason (a ticket's, `protocol.averaging_ticket`,
        or "bad_payload": a part of the wrong shape or not finite).
    """

    agreed: bool
    delta_P: list[torch.Tensor] | None
    group_size: int
    bytes_sent: int
    reason: str = ""
    send_error_P: list[torch.Tensor] | None = None
    split_winner: str = ""
    refused: dict[str, str] = field(default_factory=dict)


MIN_QUANTISED = 256   # parts with fewer elements travel as float32 (a 1-element std is undefined)


class OuterInt8(CompressionBase):  # type: ignore[misc]  # hivemind ships no type hints
    """hivemind's `Uniform8BitQuantization` for the parts it suits: a part that is small, constant
    or not finite travels as float32 instead (so a NaN still reaches the reducer, which leaves
    the sender out, and a constant part is not divided by a zero spread)."""

    compression_type = runtime_pb2.UNIFORM_8BIT

    def __init__(self) -> None:
        self.int8, self.plain = Uniform8BitQuantization(), NoCompression()

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        """Serialize one tensor part (quantised where it suits; see the class docstring)."""
        x = tensor.detach()
        if x.numel() < MIN_QUANTISED or not bool(torch.isfinite(x).all()) or float(x.float().std()) == 0.0:
            return self.plain.compress(tensor, info, allow_inplace)
        return self.int8.compress(tensor, info, allow_inplace=False)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        """Decode a part that `compress` made (either form)."""
        codec = self.int8 if serialized_tensor.compression == runtime_pb2.UNIFORM_8BIT else self.plain
        part: torch.Tensor = codec.extract(serialized_tensor)
        return part

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        """About a quarter of float32 (8-bit indices)."""
        return 0.25


class OuterRounds:
    """One DiLoCo job's outer rounds in one trainer (see the module docstring)."""

    def __init__(self, dht: hivemind.DHT, job_id: str, template: Sequence[torch.Tensor], *, timeout_s: float,
                 identity: Identity, allowed: frozenset[str] | None = None, codec: str = "float32") -> None:
        """codec: "int8" (`OuterInt8`) or "float32"; identity: this trainer's key (its tickets);
        allowed: the trainer ids admitted to its rounds (None: any trainer key).

        Raises:
            AveragerStartFailed: the averager's process did not start in time.
        """
        self.my_id = identity.peer_id
        self.averaging = GradientAveraging(dht, job_id, template, identity=identity, allowed=allowed,
                                           matchmaking_s=timeout_s,
                                           chunk_timeout_s=timeout_s / 2, allreduce_timeout_s=timeout_s, kind="outer",
                                           compression=OuterInt8() if codec == "int8" else None)

    def run(self, version: int, start_hash: bytes, delta_P: Sequence[torch.Tensor], weight: float,
            expected: int) -> OuterOutcome:
        """Average `delta_P` (weight: 1.0 for a trainer that stepped, 0.0 to only help) with the
        members meeting for outer `version`; `expected` members (this trainer included) start
        the round at once. Never raises for a failed round: the outcome says why."""
        t0 = time.monotonic()
        pending = self.averaging.begin(version, {"version": version, "start": start_hash.hex(),
                                                 "trainer": self.my_id}, expected=expected)
        got = self.averaging.finish(pending, delta_P, weight)
        log.info("outer round v%d: %s, %d of %d expected members, %.1fs, %d bytes sent", version,
                 "agreed" if got.agreed else f"failed ({got.reason})", got.group_size, expected,
                 time.monotonic() - t0, got.bytes_sent)
        refused = _refused(got)
        if not got.agreed:
            return OuterOutcome(False, None, got.group_size, got.bytes_sent, got.reason or "failed", refused=refused)
        starts = {str(g.get("start", "")) for g in got.gathered.values()}
        if starts != {start_hash.hex()}:
            winner = min((str(g.get("trainer", "")) for g in got.gathered.values()), default="")
            log.warning("outer round %d: members started from %d different outer states (a split); %s", version,
                        len(starts), f"adopting {winner[:12]}'s" if winner < self.my_id else "the others adopt ours")
            return OuterOutcome(False, None, got.group_size, got.bytes_sent, "different_start",
                                split_winner=winner if winner and winner < self.my_id else "", refused=refused)
        return OuterOutcome(True, got.averaged if got.contributed else None, got.group_size, got.bytes_sent,
                            send_error_P=got.send_error, refused=refused)

    def shutdown(self) -> None:
        """Stop the averager's process (best effort)."""
        self.averaging.shutdown()


def _refused(got: RoundOutcome) -> dict[str, str]:
    """The members a round left out: refused tickets, then senders of a bad payload."""
    return {**{p: "bad_payload" for p in got.excluded}, **got.refused}
