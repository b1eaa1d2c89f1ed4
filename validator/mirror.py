"""A validator in audit mode mirrors the statement chains its audits verified and serves them
peer to peer (`swarm.statement_gossip`), so that a job's public credit record outlives its
trainer: anyone reads it with `swarmrl audit JOB --initial-peers MADDR` (docs/CREDIT.md
section 2). A mirror holds only what it checked, and serves the trainer's own signed bodies.
"""

from __future__ import annotations

from collections.abc import Sequence

import hivemind

from swarmrl.node.swarm.statement_gossip import StatementGossip, StatementMirror
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb


class ChainMirror:
    """The verified chains this validator serves (the newest `keep`), announced in the DHT.

    dialable: False in client mode (nobody could fetch them: nothing is served or announced)."""

    def __init__(self, dht: hivemind.DHT, identity: Identity, *, dialable: bool = True, keep: int = 64) -> None:
        self.store = StatementMirror(keep)
        self.gossip = StatementGossip(dht, identity, self.store.page, dialable=dialable)

    def keep(self, job_id: str, trainer_id: str, envelopes: Sequence[pb.Signed]) -> None:
        """Hold a chain an audit verified (`envelopes`, ascending) and announce its head."""
        self.store.keep(job_id, trainer_id, envelopes)
        self._announce(job_id, trainer_id)

    def refresh(self) -> None:
        """Re-announce every held chain whose record is due (call from the main loop)."""
        for job_id, trainer_id in self.store.chains():
            self._announce(job_id, trainer_id)

    def _announce(self, job_id: str, trainer_id: str) -> None:
        version, sha256, count = self.store.head(job_id, trainer_id)
        self.gossip.announce(job_id, trainer_id, version, sha256, count)

    def served(self) -> int:
        """Statements served to other peers, all jobs."""
        return sum(self.gossip.served.values())

    def shutdown(self) -> None:
        """Stop serving (best effort)."""
        self.gossip.shutdown()
