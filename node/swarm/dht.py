"""The swarm's DHT: hivemind nodes on safe defaults, and signed job records.

Trainers announce each job as a `JobRecord` signed with their Ed25519 key (domain
"job-record") under the key `swarmrl/v1/jobs`, one subkey per (job, trainer). hivemind's own
record validators protect only owner-marked subkeys, so every reader verifies the Ed25519
signature itself and drops records that fail. Records expire after `RECORD_TTL_S`; owners
refresh them every `REFRESH_S` (TTL > refresh period + clock skew).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import hivemind
from google.protobuf.message import Message
from hivemind.utils import get_dht_time

from swarmrl.node.runtime import procs
from swarmrl.node.runtime.ports import check_port_free
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

if TYPE_CHECKING:
    from swarmrl.node.runtime.config import NetConfig

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

JOBS_KEY = "swarmrl/v1/jobs"
REFRESH_S = 10.0
MAX_CLOCK_SKEW_S = 30.0
RECORD_TTL_S = REFRESH_S * 3 + MAX_CLOCK_SKEW_S


class SwarmError(RuntimeError):
    """The DHT could not be joined or used."""


def safe_p2p_options(host: str = "127.0.0.1", port: int = 0,
                     announce_maddrs: Sequence[str] = ()) -> dict[str, Any]:
    """libp2p options with NAT port mapping, AutoNAT and relays off (see stack notes); the node
    listens on host:port and, when `announce_maddrs` are given, tells peers to dial those instead."""
    return {
        "host_maddrs": [f"/ip4/{host}/tcp/{port}"],
        **({"announce_maddrs": list(announce_maddrs)} if announce_maddrs else {}),
        "nat_port_map": False,
        "auto_nat": False,
        "use_relay": False,
        "use_auto_relay": False,
    }


class BoundedDHT(hivemind.DHT):
    """hivemind's DHT process, made to end: it ends with its parent, SIGTERM ends it and its p2pd
    daemon (it inherited its parent's signal handlers, which swallowed SIGTERM, so
    `terminate()` and multiprocessing's exit-time join waited forever), and `shutdown` is bounded
    and leaves no p2pd behind."""

    SHUTDOWN_S = 2.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, shutdown_timeout=self.SHUTDOWN_S, **kwargs)
        self._forked_from_main_thread = False

    def start(self) -> None:
        """Fork the DHT process, remembering whether the main thread forked it."""
        self._forked_from_main_thread = threading.current_thread() is threading.main_thread()
        super().start()

    def run(self) -> None:  # in the child process
        """The DHT process: SIGTERM ends it (and its p2pd); SIGINT is the parent's to decide."""
        signal.signal(signal.SIGTERM, _end_dht_process)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when its DHT stops
        if self._forked_from_main_thread:  # PDEATHSIG fires when the forking thread exits
            procs.die_with_parent(signal.SIGTERM)
            if os.getppid() != self._parent_pid:  # the parent died before we asked
                _end_dht_process()
        super().run()

    def shutdown(self) -> None:
        """Ask the node to stop, wait `SHUTDOWN_S`, then end it and its p2pd the hard way."""
        if self._parent_pid != os.getpid() or not self.is_alive():
            return
        children = procs.descendants(self.pid)
        try:
            super().shutdown()   # joins for SHUTDOWN_S, then SIGTERM
            self.join(1.0)
        finally:
            procs.end_processes([self.pid, *children], grace_s=0.5)
            self.join(1.0)


def _end_dht_process(*_: object) -> None:
    """SIGTERM in the DHT process: end its p2pd daemon, then exit at once."""
    procs.end_descendants(grace_s=0.5)
    os._exit(0)


def start_dht(initial_peers: Sequence[str] = (), *, host: str = "127.0.0.1", port: int = 0,
              announce_maddrs: Sequence[str] = (), client_mode: bool = False) -> hivemind.DHT:
    """Start a hivemind DHT node (in its own process) and check it joined the swarm.

    announce_maddrs: the addresses peers should dial (default: where it listens).
    client_mode: a node that accepts no inbound connections (behind NAT): it queries and stores
    but is never put in other nodes' routing tables.

    Raises:
        StartupError: `port` is taken (p2pd would share it silently: `ports.check_port_free`).
        SwarmError: initial peers were given and none of them could be reached.
    """
    check_port_free(host, port, "the DHT", "net.dht_port")
    dht = BoundedDHT(initial_peers=list(initial_peers), start=False, client_mode=client_mode,
                     **safe_p2p_options(host, port, announce_maddrs))
    try:
        dht.run_in_background(await_ready=True)
    except Exception as exc:
        if dht.is_alive():
            dht.shutdown()
        if initial_peers:
            raise SwarmError(f"could not reach any initial peer: {', '.join(initial_peers)} ({exc})") from exc
        raise SwarmError(f"could not start the DHT node: {exc}") from exc
    if initial_peers and not _has_peers(dht):
        dht.shutdown()
        raise SwarmError(f"could not reach any initial peer: {', '.join(initial_peers)}")
    return dht


def _has_peers(dht: hivemind.DHT, wait_s: float = 5.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        n = dht.run_coroutine(_routing_table_size)
        if n > 0:
            return True
        time.sleep(0.2)
    return False


async def _routing_table_size(_dht: hivemind.DHT, node: hivemind.dht.DHTNode) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """The multiaddrs other peers can join through (…/p2p/<libp2p peer id>)."""
    return [str(m) for m in dht.get_visible_maddrs()]


@dataclass(frozen=True)
class VerifiedRecord:
    """A job record whose Ed25519 signature verified."""

    record: pb.JobRecord
    trainer_id: str
    trainer_public_key: bytes


def announce_job(dht: hivemind.DHT, identity: Identity, record: pb.JobRecord) -> bool:
    """Sign and store (or refresh) a job record; returns whether the store succeeded."""
    envelope = signing.sign(identity, signing.JOB_RECORD, record)
    subkey = f"{record.job_id}:{identity.peer_id}"
    return bool(
        dht.store(JOBS_KEY, envelope.SerializeToString(), expiration_time=get_dht_time() + RECORD_TTL_S, subkey=subkey)
    )


def signed_entries(dht: hivemind.DHT, key: str, domain: str, message_type: type[M],
                   what: str, level: int = logging.DEBUG) -> list[tuple[str, M, str, pb.Signed]]:
    """(subkey, record, signer peer id, envelope) for every live entry under DHT `key` whose
    `domain` signature verifies; an entry that does not parse or verify is logged at `level` as
    a dropped `what` and skipped (a peer can store anything). Which subkey a signer may use is
    the caller's check."""
    found = dht.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    out = []
    for subkey, item in found.value.items():
        try:
            envelope = pb.Signed.FromString(item.value)
            record, signer = signing.open_signed(envelope, domain, message_type)
        except Exception as exc:  # noqa: BLE001 - a peer can store anything: drop it
            log.log(level, "dropping %s %s: %s", what, subkey, exc)
            continue
        out.append((str(subkey), record, signer, envelope))
    return out


def find_jobs(dht: hivemind.DHT) -> list[VerifiedRecord]:
    """All live job records in the DHT whose signature verifies (others are logged and dropped)."""
    records = []
    for subkey, record, signer, envelope in signed_entries(dht, JOBS_KEY, signing.JOB_RECORD, pb.JobRecord,
                                                           "DHT job record", logging.WARNING):
        if record.trainer_id != signer or subkey != f"{record.job_id}:{signer}":
            log.warning("dropping DHT job record %s: signer %s does not match", subkey, signer)
            continue
        records.append(VerifiedRecord(record, signer, bytes(envelope.public_key)))
    return records


def join_swarm(net: NetConfig) -> hivemind.DHT:
    """This process's DHT node, shut down at exit.

    Raises:
        SwarmError: it could not start or join its initial peers (a runtime failure: exit 1).
    """
    dht = start_dht(net.initial_peers, host=net.host, port=net.dht_port, announce_maddrs=net.announce_maddrs,
                    client_mode=net.client_mode)
    atexit.register(dht.shutdown)  # runs before _end_children (LIFO): a clean shutdown first
    return dht
