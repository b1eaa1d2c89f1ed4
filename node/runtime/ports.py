"""Ports a role listens on: refuse a taken one in one line before anything starts on it.

gRPC refuses a taken port itself (the server sets `grpc.so_reuseport` 0, so its bind fails).
hivemind's p2pd daemon does not: libp2p binds with SO_REUSEPORT, so a second daemon on the same
`net.dht_port` starts silently and the kernel splits connections between the two. A plain bind
(without SO_REUSEPORT) fails on a port another socket listens on, reuse-port or not, so
`check_port_free` tries one before the DHT starts. Both say it with `port_taken`.
"""

from __future__ import annotations

import socket

from swarmrl.node.runtime.lifecycle import StartupError


def port_taken(what: str, address: str, setting: str) -> str:
    """The one line for a port that could not be bound: what could not listen, where, and the
    setting that picks a free port."""
    return (f"could not serve {what} on {address}: the port is taken or the address is not ours "
            f"({setting}=0 picks a free port)")


def check_port_free(host: str, port: int, what: str, setting: str) -> None:
    """Refuse `host:port` (port 0, any free port, always passes) when something listens there.

    SO_REUSEADDR lets a port whose old connections linger in TIME_WAIT pass; on Linux it does
    not let a bind share a port with a listening socket.

    Raises:
        StartupError: the port is taken, or `host` is not an address of this machine.
    """
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise StartupError(f"{port_taken(what, f'{host}:{port}', setting)}: {exc.strerror}") from None
