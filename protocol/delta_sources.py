"""Where a catching-up replica gets an adapter update: the pure rule of the delta gossip.

The swarm layer (`node/swarm/catchup.py`) and the simulator (`simulations/gossip.py`) both follow
it: more than `max_gap` versions behind (or holding nothing) take one snapshot, else deltas one
version at a time; ask the peers that announce the update (not ourselves, not peers dropped for
sending something that did not verify, only updates signed by a trainer we accept) in random
order; when none announces it yet, wait a random share of `peer_wait_s` for one to appear, then
fall back to the trainer.
"""

from __future__ import annotations

import random
from collections.abc import Container, Iterable
from typing import Protocol, TypeVar


class HolderLike(Protocol):
    """What the source choice reads of a DHT holder record (a real `Holder` or the simulator's).

    Read-only properties, so frozen dataclasses satisfy it (a plain attribute here would demand
    a settable one)."""

    @property
    def holder_id(self) -> str:
        """The holder's Ed25519 peer id."""
        ...

    @property
    def signer(self) -> str:
        """The trainer that signed the held update's header (as the holder claims)."""
        ...


H = TypeVar("H", bound=HolderLike)


def needs_snapshot(have: int, want: int, max_gap: int) -> bool:
    """True when a replica at version `have` (-1: nothing) should take a snapshot to reach `want`."""
    if max_gap < 1:
        raise ValueError(f"max_gap must be >= 1, got {max_gap}")
    return have < 0 or want - have > max_gap


def candidates(holders: Iterable[H], *, me: str, dropped: Container[str], signers: Container[str]) -> list[H]:
    """Holders worth asking: not us, not dropped, holding an update signed by a trainer we accept."""
    return [h for h in holders if h.holder_id != me and h.holder_id not in dropped and h.signer in signers]


def ask_order(found: list[H], rng: random.Random) -> list[H]:
    """The order to ask candidates in: uniformly random (spreads a fresh version's load over its
    holders). Shuffles `found` in place and returns it; its first element is a uniform draw."""
    rng.shuffle(found)
    return found


def holder_wait_s(peer_wait_s: float, rng: random.Random) -> float:
    """How long to wait for a peer to announce an update before asking the trainer: a random share
    of `peer_wait_s`, so the first fetches of a fresh version spread out."""
    if peer_wait_s < 0:
        raise ValueError(f"peer_wait_s must be >= 0, got {peer_wait_s}")
    return rng.uniform(0, peer_wait_s) if peer_wait_s > 0 else 0.0
