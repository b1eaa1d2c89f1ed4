"""Who is banned from one job, and the strikes that lead there.

A ban refuses a peer's leases and batches for the job (`protocol.verdicts` says which evidence
bans: a failed banning check from a trusted validator at once, or STRIKES_TO_BAN attributable
admission failures). Bans and strikes are durable (the trainer's ledger), so a trainer restart
neither lifts a ban nor hands a cheater fresh strikes; a ban ends when it expires (`until_ms`)
or is lifted, which also clears the peer's strikes. What a ban does to the job (leases revoked,
untrained groups dropped) is the job's business (`admission.Admission.ban`); this book only keeps
the record.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol.verdicts import STRIKES_TO_BAN

log = logging.getLogger(__name__)
MAX_REASON_CHARS = 200


class BanBook:
    """The bans and strikes of one job, mirrored in memory from the ledger. Thread-safe."""

    def __init__(self, job_id: str, ledger: Ledger) -> None:
        self.job_id, self.ledger = job_id, ledger
        self._lock = threading.Lock()
        self.banned: dict[str, str] = {}       # peer -> reason
        self.banned_at: dict[str, int] = {}    # peer -> unix ms of the ban
        self._until: dict[str, int] = {}       # peer -> unix ms the ban ends
        self.strikes: Counter[str] = Counter(ledger.strikes(job_id))  # peer -> attributable failures
        for peer, reason, at_ms, until_ms in ledger.bans(job_id):
            self.banned[peer], self.banned_at[peer], self._until[peer] = reason, at_ms, until_ms

    def strike(self, peer_id: str, count: int) -> bool:
        """Record `count` attributable failures of `peer_id`. Returns True when the peer now has
        STRIKES_TO_BAN or more and is not banned yet (the caller bans it)."""
        with self._lock:
            self.strikes[peer_id] += count
            total = self.strikes[peer_id]
        self.ledger.set_strikes(self.job_id, peer_id, total)
        return total >= STRIKES_TO_BAN and peer_id not in self.banned

    def add(self, peer_id: str, reason: str, at_ms: int, duration_ms: int) -> str:
        """Ban `peer_id` from `at_ms` for `duration_ms` (durable before it returns). Returns the
        reason as stored (cut to MAX_REASON_CHARS)."""
        reason = reason[:MAX_REASON_CHARS]
        with self._lock:
            self.banned[peer_id], self.banned_at[peer_id] = reason, at_ms
            self._until[peer_id] = at_ms + duration_ms
        self.ledger.add_ban(self.job_id, peer_id, reason, at_ms, at_ms + duration_ms)
        return reason

    def lift(self, peer_id: str) -> None:
        """End a ban now and clear the peer's strikes (its history stays in the ledger)."""
        with self._lock:
            self.banned.pop(peer_id, None)
            self.banned_at.pop(peer_id, None)
            self._until.pop(peer_id, None)
            self.strikes.pop(peer_id, None)
        self.ledger.remove_ban(self.job_id, peer_id)
        self.ledger.set_strikes(self.job_id, peer_id, 0)

    def expire(self, now_ms: int) -> list[str]:
        """Lift the bans that ended by `now_ms`. Returns the peers whose ban ended."""
        with self._lock:
            ended = [p for p, until in self._until.items() if until <= now_ms]
        for peer in ended:
            log.info("job %s: ban of %s expired", self.job_id, peer)
            self.lift(peer)
        return ended
