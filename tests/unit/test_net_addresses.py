"""Listen vs announce addresses, and peers that can't be dialled (issue 11 items 1-2), on loopback."""

from __future__ import annotations

import socket
import time

import pytest
from hivemind.utils import get_dht_time

from swarmrl.node.runtime.config import ConfigError, NetConfig, TrainerConfig, load_config
from swarmrl.node.swarm.dht import RECORD_TTL_S, start_dht, visible_maddrs
from swarmrl.node.swarm.gossip import GossipNode
from swarmrl.node.swarm.holders import announce_holdings, find_holders, holders_key
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

JOB = "ee" * 16
HELD = [pb.HeldUpdate(version=1, payload_sha256=b"\1" * 32, payload_size=10)]


def test_announce_addresses_are_checked() -> None:
    net = NetConfig(announce_maddrs=["/ip4/203.0.113.7/tcp/31337"], client_mode=True)
    assert net.client_mode and net.host == "127.0.0.1"   # listening stays loopback unless asked
    for bad in ["/ip4/203.0.113.7/tcp/0", "203.0.113.7:31337", "/ip4/203.0.113.7/udp/1"]:
        with pytest.raises(ConfigError, match="announce multiaddr"):
            load_config(NetConfig, None, [f'announce_maddrs=["{bad}"]'])
    cfg = load_config(TrainerConfig, None, ["grpc_announce=trainer.example.org:50051", "tls=true"])
    assert cfg.grpc_announce == "trainer.example.org:50051" and cfg.tls and cfg.grpc_host is None
    with pytest.raises(ConfigError, match="HOST:PORT"):
        load_config(TrainerConfig, None, ["grpc_announce=trainer.example.org"])


@pytest.fixture(scope="module")
def swarm():
    """A full DHT node announcing an address other than where it listens (as behind a port
    forward), and a client-mode node that joins it at the listen address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    full = start_dht(port=port, announce_maddrs=["/ip4/127.0.0.2/tcp/4242"])
    libp2p_id = visible_maddrs(full)[0].rpartition("/p2p/")[2]
    client = start_dht([f"/ip4/127.0.0.1/tcp/{port}/p2p/{libp2p_id}"], client_mode=True)
    yield full, client
    client.shutdown()
    full.shutdown()


def test_the_announced_address_is_the_visible_one(swarm) -> None:
    full, client = swarm
    assert [m.rpartition("/p2p/")[0] for m in visible_maddrs(full)] == ["/ip4/127.0.0.2/tcp/4242"]
    assert client.client_mode and not full.client_mode


def test_only_dialable_holders_are_delta_sources(swarm) -> None:
    full, client = swarm
    server_side = GossipNode(full, Identity.generate())
    behind_nat = GossipNode(client, Identity.generate(), dialable=False)
    try:
        assert server_side.maddrs and behind_nat.maddrs == []
        with pytest.raises(ValueError, match="no dialable address"):
            announce_holdings(client, behind_nat.identity, JOB, behind_nat.libp2p_peer_id, HELD, 0, [])
        behind_nat.cache.held = lambda job_id: list(HELD)   # type: ignore[method-assign]
        behind_nat.announce(JOB)                   # client mode: never announced
        _store_unaddressed(client, Identity.generate(), behind_nat.libp2p_peer_id)   # a record with no address
        assert find_holders(full, JOB) == {}
        announce_holdings(full, server_side.identity, JOB, server_side.libp2p_peer_id, HELD, 0, server_side.maddrs)
        deadline = time.monotonic() + 5
        while not (found := find_holders(client, JOB)) and time.monotonic() < deadline:
            time.sleep(0.2)
        (holder,) = found[(1, False)]
        assert holder.holder_id == server_side.identity.peer_id and holder.maddrs == tuple(server_side.maddrs)
    finally:
        behind_nat.shutdown()
        server_side.shutdown()


def _store_unaddressed(dht, identity: Identity, libp2p_peer_id: bytes) -> None:
    """A validly signed holder record without addresses (an older or careless peer)."""
    record = pb.DeltaHolder(job_id=JOB, holder_id=identity.peer_id, libp2p_peer_id=libp2p_peer_id, updates=HELD)
    envelope = signing.sign(identity, signing.DELTA_HOLDER, record)
    assert dht.store(holders_key(JOB), envelope.SerializeToString(), expiration_time=get_dht_time() + RECORD_TTL_S,
                     subkey=identity.peer_id)
