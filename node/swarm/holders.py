"""Who holds which adapter updates: signed, expiring `DeltaHolder` records in the DHT.

A peer that holds signed updates of a job (deltas and snapshots, each named by the sha256 of its
payload) announces them in one record under `swarmrl/v1/deltas/{job_id}`, subkey = its Ed25519
peer id, signed with its key (domain "delta-holder") and carrying the libp2p peer id to open a
stream to and the multiaddrs to dial it at (its announced ones). A peer that can't be dialled
(client mode, behind NAT) announces nothing, and readers skip a record with no address: only
dialable holders are ever delta sources. Records expire after `RECORD_TTL_S`; holders refresh them every `REFRESH_S` and after
every change (TTL > refresh period + clock skew, as for job records). Readers verify every record
and drop the ones that fail; a valid record only says where to ask: what comes back is verified
against the trainer's signature and the content address before it is used.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import hivemind
from hivemind.utils import get_dht_time

from swarmrl.node.swarm.dht import RECORD_TTL_S, signed_entries
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

log = logging.getLogger(__name__)


def holders_key(job_id: str) -> str:
    """The DHT key under which the holders of `job_id`'s updates announce them (one subkey per peer)."""
    return f"swarmrl/v1/deltas/{job_id}"


UpdateKey = tuple[int, bool]
"""(to_version, snapshot): which update of a job."""


@dataclass(frozen=True)
class Holder:
    """A verified holder of one update: who (Ed25519 id), where (libp2p id), which content."""

    holder_id: str
    libp2p_peer_id: bytes
    payload_sha256: bytes
    payload_size: int
    signer: str          # the trainer that signed the update's header (as the holder claims)
    maddrs: tuple[str, ...] = ()   # where to dial the holder (its announced libp2p multiaddrs)


def announce_holdings(dht: hivemind.DHT, identity: Identity, job_id: str, libp2p_peer_id: bytes,
                      held: list[pb.HeldUpdate], now_ms: int, maddrs: list[str]) -> bool:
    """Sign and store (or refresh) this peer's holdings of `job_id`, reachable at `maddrs`;
    returns whether it stored.

    Raises:
        ValueError: no address (a peer nobody can dial must not announce itself as a source).
    """
    if not maddrs:
        raise ValueError("a holder with no dialable address must not announce holdings")
    record = pb.DeltaHolder(job_id=job_id, holder_id=identity.peer_id, libp2p_peer_id=libp2p_peer_id,
                            updates=held, updated_ms=now_ms, maddrs=maddrs)
    envelope = signing.sign(identity, signing.DELTA_HOLDER, record)
    return bool(dht.store(holders_key(job_id), envelope.SerializeToString(),
                          expiration_time=get_dht_time() + RECORD_TTL_S, subkey=identity.peer_id))


def find_holders(dht: hivemind.DHT, job_id: str) -> dict[UpdateKey, list[Holder]]:
    """Every announced update of `job_id` with its verified holders (bad records are dropped)."""
    out: dict[UpdateKey, list[Holder]] = defaultdict(list)
    for subkey, record, signer, _ in signed_entries(dht, holders_key(job_id), signing.DELTA_HOLDER, pb.DeltaHolder,
                                                    "holder record"):
        if record.holder_id != signer or subkey != signer or record.job_id != job_id:
            log.debug("dropping holder record %s: signer %s does not match", subkey, signer)
            continue
        if not record.maddrs:
            log.debug("skipping holder record %s: no address to dial", subkey)
            continue
        for u in record.updates:
            out[(int(u.version), bool(u.snapshot))].append(
                Holder(signer, bytes(record.libp2p_peer_id), bytes(u.payload_sha256), int(u.payload_size), u.signer,
                       tuple(record.maddrs)))
    return dict(out)
