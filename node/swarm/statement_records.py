"""Who serves a job's contribution statements: signed, expiring `StatementHolder` records in the
DHT (issue 27 item 2, docs/CREDIT.md section 2).

A peer that serves one trainer's signed statements of a job over libp2p (`statement_gossip`:
the trainer itself, or a mirror such as a validator in audit mode that checked the chain)
announces the head it serves (version and content address) under
`swarmrl/v1/statements/{job_id}`, subkey `{holder_id}:{trainer_id}`, signed with its own key
(domain "statement-holder"), with the libp2p peer id and multiaddrs to dial it at. Records
expire after `RECORD_TTL_S`; holders refresh them every `REFRESH_S` and after every new head.
Readers verify every record and drop the ones that fail; a valid record only says where to ask:
the statements that come back are the trainer's signed bodies, checked as a chain against the
head's content address before they are used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import hivemind
from hivemind.utils import get_dht_time

from swarmrl.node.swarm.dht import RECORD_TTL_S, signed_entries
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

log = logging.getLogger(__name__)


def statements_key(job_id: str) -> str:
    """The DHT key under which the holders of `job_id`'s statements announce them."""
    return f"swarmrl/v1/statements/{job_id}"


@dataclass(frozen=True)
class StatementSource:
    """A verified holder of one trainer's statements of a job: who serves them, which head, where."""

    holder_id: str
    trainer_id: str
    head_version: int
    head_sha256: bytes
    statements: int
    libp2p_peer_id: bytes
    maddrs: tuple[str, ...]
    updated_ms: int

    @property
    def is_trainer(self) -> bool:
        """Whether the trainer serves its own statements (else a mirror does)."""
        return self.holder_id == self.trainer_id


def announce_statements(dht: hivemind.DHT, identity: Identity, *, job_id: str, trainer_id: str, head_version: int,
                        head_sha256: bytes, statements: int, libp2p_peer_id: bytes, maddrs: list[str],
                        now_ms: int) -> bool:
    """Sign and store (or refresh) this peer's holding of `trainer_id`'s statements of `job_id`
    up to `head_version` (content address `head_sha256`); returns whether the DHT stored it.

    Raises:
        ValueError: no address to dial, or no head (version 0): nothing to announce.
    """
    if not maddrs:
        raise ValueError("a holder with no dialable address must not announce statements")
    if head_version < 1 or len(head_sha256) != 32:
        raise ValueError(f"no head statement to announce (version {head_version})")
    record = pb.StatementHolder(job_id=job_id, holder_id=identity.peer_id, trainer_id=trainer_id,
                                head_version=head_version, head_sha256=head_sha256, statements=statements,
                                libp2p_peer_id=libp2p_peer_id, maddrs=maddrs, updated_ms=now_ms)
    envelope = signing.sign(identity, signing.STATEMENT_HOLDER, record)
    return bool(dht.store(statements_key(job_id), envelope.SerializeToString(),
                          expiration_time=get_dht_time() + RECORD_TTL_S, subkey=f"{identity.peer_id}:{trainer_id}"))


def find_statement_sources(dht: hivemind.DHT, job_id: str, trainer_id: str = "") -> list[StatementSource]:
    """The verified holders of `job_id`'s statements (of `trainer_id`'s chain only, if given),
    newest head first, the trainer before its mirrors at the same head. Records whose signer is
    not their holder or subkey, about another job, or without an address are dropped."""
    out = []
    for subkey, rec, signer, _ in signed_entries(dht, statements_key(job_id), signing.STATEMENT_HOLDER,
                                                 pb.StatementHolder, "statement holder record", logging.INFO):
        if rec.holder_id != signer or subkey != f"{signer}:{rec.trainer_id}" or rec.job_id != job_id:
            log.info("dropping statement holder record %s: signer %s does not match", subkey[:40], signer[:16])
            continue
        if not rec.maddrs or rec.head_version < 1:
            log.info("dropping statement holder record %s: no address or no head", subkey[:40])
            continue
        if trainer_id and rec.trainer_id != trainer_id:
            continue
        out.append(StatementSource(signer, rec.trainer_id, int(rec.head_version), bytes(rec.head_sha256),
                                   int(rec.statements), bytes(rec.libp2p_peer_id), tuple(rec.maddrs),
                                   int(rec.updated_ms)))
    return sorted(out, key=lambda s: (-s.head_version, not s.is_trainer, s.holder_id))
