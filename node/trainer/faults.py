"""Fault drills for trainers, injected from outside the step (`TrainerConfig.fault`).

`nan_gradients` makes a trainer a broken peer: the gradients it hands its cotrainers are NaN,
with the weight of its real tokens, so the others must exclude it from the average. The drill
wraps the step's gradient reducer; the step itself (`Learner.step`) knows no drill and never
applies non-finite gradients.

`die_in_outer_round` is a DiLoCo trainer that dies in its second outer round: it joins the
round's group (its cotrainers start the all-reduce with it), then, before its parts go out, it
SIGKILLs its whole process group (itself, its DHT and its averager's process), as a crashed
machine would. The others must finish the round within its
timeout, and the trainer, restarted without the drill, must rejoin from its checkpoint.

`forged_outer_ticket` is a DiLoCo trainer that is not who its round ticket says: its tickets'
signatures do not verify, and the pseudo-gradient it sends is poison (every value 1000, with
weight 1). Its cotrainers must refuse it (`bad_signature`), count it, and agree among themselves
on their own average.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch

from swarmrl.node.trainer.outer import OuterAverager
from swarmrl.protocol.grpo.reduce import GradientReducer, Reduced
from swarmrl.protocol.pb import swarm_pb2 as pb

log = logging.getLogger(__name__)
FAULTS = ("nan_gradients", "die_in_outer_round", "forged_outer_ticket")
POISON = 1000.0       # every value of the forged trainer's pseudo-gradient
DIE_AT_ROUND = 2      # the outer round (counted in this process) the drill dies in
DIE_AFTER_S = 3.0     # seconds after it joined the round's matchmaking: the group has formed by then


class NaNGradients:
    """A reducer wrapper that hands the inner reducer NaN gradients (weight at least 1)."""

    def __init__(self, inner: GradientReducer) -> None:
        self.inner = inner

    def begin(self) -> None:
        """Begin the inner reducer's round."""
        self.inner.begin()

    def reduce(self, grads: list[torch.Tensor], weight: float) -> Reduced:
        """Give the inner reducer NaNs shaped as `grads`, claiming `max(weight, 1)` tokens."""
        return self.inner.reduce([torch.full_like(g, float("nan")) for g in grads], max(weight, 1.0))


def _kill_my_group() -> None:
    log.warning("fault drill die_in_outer_round: SIGKILL to this trainer's process group, mid-round")
    os.killpg(os.getpgid(0), signal.SIGKILL)


class DieInOuterRound:
    """The `die_in_outer_round` drill (module docstring): wraps each outer step's averager."""

    def __init__(self, at_round: int = DIE_AT_ROUND, after_s: float = DIE_AFTER_S,
                 kill: Callable[[], None] = _kill_my_group) -> None:
        self.at_round, self.after_s, self.kill, self.rounds = at_round, after_s, kill, 0

    def wrap(self, inner: OuterAverager) -> OuterAverager:
        """`inner`, except that its `at_round`-th round (in this process) ends in the kill."""
        drill = self

        class Dying:
            def run(self, version: int, start_hash: bytes, delta_P: list[torch.Tensor], weight: float,
                    expected: int) -> Any:
                drill.rounds += 1
                if drill.rounds != drill.at_round:
                    return inner.run(version, start_hash, delta_P, weight, expected)
                averaging = getattr(inner, "averaging", None)   # `OuterRounds`: join the group, send nothing
                if averaging is not None:
                    averaging.begin(version, {"version": version, "start": start_hash.hex(), "trainer": "drill"},
                                    expected=expected)
                    time.sleep(drill.after_s)
                drill.kill()
                raise RuntimeError("die_in_outer_round: the kill did not end this process")

        return Dying()


def forge(ticket: bytes) -> bytes:
    """`ticket` (a serialized signed envelope) with its signature's first byte flipped."""
    envelope = pb.Signed.FromString(ticket)
    sig = bytearray(envelope.signature)
    sig[0] ^= 0xFF
    envelope.signature = bytes(sig)
    return envelope.SerializeToString(deterministic=True)


class ForgedOuterTicket:
    """The `forged_outer_ticket` drill (module docstring): wraps each outer step's averager."""

    def __init__(self) -> None:
        self.forging: object = None   # the averager whose tickets this drill forges now

    def wrap(self, inner: OuterAverager) -> OuterAverager:
        """`inner`, signing forged tickets and sending a poisoned pseudo-gradient."""
        averaging = getattr(inner, "averaging", None)   # `OuterRounds`: its tickets are signed here
        if averaging is not None and averaging is not self.forging:   # each outer step wraps the same one
            sign = averaging.sign_ticket
            averaging.sign_ticket = lambda *args: forge(sign(*args))
            self.forging = averaging

        class Forged:
            def run(self, version: int, start_hash: bytes, delta_P: list[torch.Tensor], weight: float,
                    expected: int) -> Any:
                log.warning("fault drill forged_outer_ticket: a forged ticket and a poisoned pseudo-gradient")
                return inner.run(version, start_hash, [torch.full_like(d, POISON) for d in delta_P], 1.0, expected)

        return Forged()


OuterDrill = DieInOuterRound | ForgedOuterTicket


def _check(fault: str | None) -> None:
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown trainer fault {fault!r}; known: {', '.join(FAULTS)}")


def reducer_wrap(fault: str | None) -> Callable[[GradientReducer], GradientReducer] | None:
    """The reducer wrapper of a trainer fault drill (None: no drill, or not a reducer's).

    Raises:
        ValueError: an unknown fault name.
    """
    _check(fault)
    return NaNGradients if fault == "nan_gradients" else None


def outer_drill(fault: str | None) -> OuterDrill | None:
    """The outer-round drill of a trainer fault (None: no drill, or not an outer round's).

    Raises:
        ValueError: an unknown fault name.
    """
    _check(fault)
    if fault == "forged_outer_ticket":
        return ForgedOuterTicket()
    return DieInOuterRound() if fault == "die_in_outer_round" else None
