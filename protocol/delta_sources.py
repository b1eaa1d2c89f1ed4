"""Where a catching-up replica gets an adapter update: the pure rule of the delta gossip.

The swarm layer (`node/swarm/catchup.py`) and the simulator (`simulations/gossip.py`) both follow
it: more than `max_gap` versions behind (or holding nothing) take one snapshot, else deltas one
version at a time; ask the peers that announce the update (not ourselves, not peers dropped for
sending something that did not verify, only updates signed by a trainer we accept) in random
order, at most `max_peer_attempts` of them per update and catch-up (worker config; 0, the
default `MAX_PEER_ATTEMPTS`: all of them); when none announces it yet, wait a random share of
`peer_wait_s` for one to appear (`wait_rule`, default `WAIT_RULE`: "scaled*" make that ceiling grow
with the number of peers that hold the previous version, `wait_ceiling_s`; "*-whole" wait the whole
drawn share and then ask a random holder, the others stop at the first holder seen, `waits_whole`);
then fall back to the trainer.
"""

from __future__ import annotations

import math
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

MAX_PEER_ATTEMPTS = 0
"""Peers asked for one update in one catch-up before the trainer; 0: every announced holder (the
worker config's `max_peer_attempts` default). Each failed peer fetch can cost its 30 s timeout
(`GossipNode.fetch`), so a worker no peer can serve in time asks every holder before the trainer.
Kept unbounded by measurement (issue 13; simulations/README.md "Peer attempts",
`benchmarks/simulate_defaults.py --variants peer-attempts`, 1,000 workers, 1 simulated hour): a
bound of 2 or more changed nothing in calm and high-churn, and in slow-region every bound tried
(1-16) was slower or collapsed on most seeds (reach-95% p50 199-239 s unbounded, 284-505 s at 2):
the failed peer fetches there are many workers failing once or twice with holders whose slow
uplinks can't send a delta in 30 s, not a few workers asking hundreds of holders (at most 17 peer
fetches per worker and version), and a bound sends them to the trainers, the bottleneck."""


def needs_snapshot(have: int, want: int, max_gap: int) -> bool:
    """True when a replica at version `have` (-1: nothing) should take a snapshot to reach `want`."""
    if max_gap < 1:
        raise ValueError(f"max_gap must be >= 1, got {max_gap}")
    return have < 0 or want - have > max_gap


def candidates(holders: Iterable[H], *, me: str, dropped: Container[str], signers: Container[str]) -> list[H]:
    """Holders worth asking: not us, not dropped, holding an update signed by a trainer we accept."""
    return [h for h in holders if h.holder_id != me and h.holder_id not in dropped and h.signer in signers]


def ask_order(found: list[H], rng: random.Random, limit: int | None = None) -> list[H]:
    """The candidates to ask, in order: uniformly random (spreads a fresh version's load over its
    holders), at most `limit` of them (None: all). Shuffles `found` in place and returns its first
    `limit` elements; the first is a uniform draw."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    rng.shuffle(found)
    return found if limit is None else found[:limit]


def attempts_left(max_attempts: int, asked: int) -> int | None:
    """Peer fetches still allowed for an update after `asked` of them, for `ask_order`'s `limit`
    (`max_attempts` 0: no bound, None)."""
    if max_attempts < 0:
        raise ValueError(f"max_peer_attempts must be >= 0, got {max_attempts}")
    return None if max_attempts == 0 else max(0, max_attempts - asked)


def holder_wait_s(peer_wait_s: float, rng: random.Random) -> float:
    """How long to wait for a peer to announce an update before asking the trainer: a random share
    of `peer_wait_s`, so the first fetches of a fresh version spread out."""
    if peer_wait_s < 0:
        raise ValueError(f"peer_wait_s must be >= 0, got {peer_wait_s}")
    return rng.uniform(0, peer_wait_s) if peer_wait_s > 0 else 0.0


WAIT_RULES = ("fixed", "scaled", "fixed-whole", "scaled-whole")
WAIT_RULE = "scaled-whole"
"""How a worker waits for a peer to announce a fresh update (worker config `wait_rule`). The
ceiling of its random wait: "fixed*" up to `peer_wait_s`, "scaled*" up to `wait_ceiling_s`'s
ceiling that grows with the swarm (nothing below SCALED_FROM_HOLDERS holders). When it stops:
"fixed" and "scaled" at the first holder record it sees (so every waiting worker asks that one
holder), "*-whole" at the end of its drawn wait, then it reads the records and asks a random holder
(`waits_whole`). "scaled-whole" by measurement (issue 13; simulations/README.md "Wait rule",
`benchmarks/simulate_defaults.py --variants wait-rule`, int4 deltas, peer_wait_s 1, 2 seeds, 1
simulated hour): at 1,000 workers reach-95% p50 32 -> 24 s (x0.75 calm and high-churn), the
trainers' share of the delta bytes 0.71 -> 0.37, failed fetches per version 97 -> 29, groups
trained and versions per hour unchanged; at 400 workers reach-95% 26 -> 10 s, groups/h x1.01; at
10,000 (scale-10k, seed 0) versions/h 100 -> 265, reach-95% 76 -> 32 s, failed fetches 18k -> 129k; below
128 holders (a local swarm) it waits nothing (simulated local-tiny 23.8 -> 27.0 steps/min,
local-gemma 8.8 both, the peers serving less)."""
SCALED_FROM_HOLDERS = 128
"""The "scaled*" rules wait nothing up to this many holders of the previous version, then
`peer_wait_s` more per doubling."""


def _check_rule(rule: str) -> None:
    if rule not in WAIT_RULES:
        raise ValueError(f"wait_rule must be one of {', '.join(WAIT_RULES)}, got {rule!r}")


def waits_whole(rule: str) -> bool:
    """True when a worker waiting for a holder under `rule` waits its whole drawn share of the
    ceiling and only then reads the holder records (and asks a random holder of them: `ask_order`);
    False when it stops at the first record it sees.

    Raises:
        ValueError: `rule` is not one of WAIT_RULES."""
    _check_rule(rule)
    return rule.endswith("-whole")


def wait_ceiling_s(peer_wait_s: float, rule: str, holders: int) -> float:
    """The ceiling of the random wait for a holder (`holder_wait_s`'s `peer_wait_s`): `peer_wait_s`
    under the "fixed*" rules; under "scaled*", peer_wait_s * log2(holders / SCALED_FROM_HOLDERS) and
    at least 0, where `holders` is how many peers announce the version the worker holds (the
    previous one): a small swarm asks its trainer at once, a large one waits for the peers that
    will hold the update, each doubling of the swarm a little longer.

    Raises:
        ValueError: `peer_wait_s` < 0 or `rule` is not one of WAIT_RULES."""
    if peer_wait_s < 0:
        raise ValueError(f"peer_wait_s must be >= 0, got {peer_wait_s}")
    _check_rule(rule)
    if rule.startswith("fixed"):
        return peer_wait_s
    return peer_wait_s * max(0.0, math.log2(max(holders, 1) / SCALED_FROM_HOLDERS))
