"""A taken port is refused in one line before a role starts on it (node/runtime/ports.py): also
one held by a SO_REUSEPORT listener, as hivemind's p2pd holds its DHT port, which a second p2pd
would silently share (issue 28 item 4)."""

from __future__ import annotations

import socket

import pytest

from swarmrl.node.runtime.lifecycle import StartupError
from swarmrl.node.runtime.ports import check_port_free


def _listener(reuseport: bool) -> socket.socket:
    s = socket.socket()
    if reuseport:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("reuseport", [False, True], ids=["plain", "reuseport-like-p2pd"])
def test_a_port_someone_listens_on_is_refused(reuseport: bool) -> None:
    with _listener(reuseport) as taken:
        port = taken.getsockname()[1]
        if reuseport:   # the kernel would let a second reuse-port listener in: what p2pd does
            with socket.socket() as twin:
                twin.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                twin.bind(("127.0.0.1", port))
        with pytest.raises(StartupError) as err:
            check_port_free("127.0.0.1", port, "the DHT", "net.dht_port")
    assert str(err.value) == (f"could not serve the DHT on 127.0.0.1:{port}: the port is taken or the address is "
                              "not ours (net.dht_port=0 picks a free port): Address already in use")


def test_a_free_port_and_port_zero_pass_and_a_foreign_address_is_refused() -> None:
    with _listener(False) as s:
        port = s.getsockname()[1]
    check_port_free("127.0.0.1", port, "the DHT", "net.dht_port")   # closed again: free
    check_port_free("127.0.0.1", 0, "the DHT", "net.dht_port")
    with pytest.raises(StartupError, match="address is not ours"):
        check_port_free("192.0.2.1", port, "the DHT", "net.dht_port")   # TEST-NET-1: never this machine's
