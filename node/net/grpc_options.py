"""gRPC channel and server options: message limits set explicitly on both ends (and the same
limit for the in-process path, `check_message_size`), and keepalive settings that agree between them.

Keepalive: our clients ping every `KEEPALIVE_S` (30 s), with or without calls, so a NAT or
firewall on the way keeps an idle connection open. A server that does not permit that closes the
connection with GOAWAY "too_many_pings" (grpc's default: one ping per 5 minutes without data, 2
strikes). So our servers accept pings as often as every `MIN_PING_S` (10 s, the floor grpc's
own clients enforce on themselves) with or without calls: our own clients and a standard client
pinging every 30 s both fit with room to spare. (Clients built on grpc's C core, Python's
included, stop after 2 pings without data unless `grpc.http2.max_pings_without_data` is 0, as
ours set; Go and Java clients keep pinging.)
"""

from __future__ import annotations

import grpc

from swarmrl.node.net.call_status import CallRefused

MiB = 1 << 20
KEEPALIVE_S = 30          # how often our clients and servers ping an idle connection
KEEPALIVE_TIMEOUT_S = 20  # an unanswered ping closes the connection after this long
MIN_PING_S = 10           # the most often a server lets a client ping (with or without calls)


def message_limit_bytes(max_message_mb: int) -> int:
    """The largest message (serialized bytes) a channel of `max_message_mb` sends or receives:
    gRPC's limit on both ends (`channel_options`), and the in-process path's (`check_message_size`)."""
    return max_message_mb * MiB


def check_message_size(n_bytes: int, limit_bytes: int) -> None:
    """Refuse a message over the limit as gRPC does: RESOURCE_EXHAUSTED, "larger than max".

    Raises:
        CallRefused: `n_bytes` > `limit_bytes`.
    """
    if n_bytes > limit_bytes:
        raise CallRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"Received message larger than max ({n_bytes} vs. {limit_bytes})")


def channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    """Options for both servers and clients: send/receive limits and keepalive."""
    limit = message_limit_bytes(max_message_mb)
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
        ("grpc.keepalive_permit_without_calls", 1),
        # grpc's C core sends at most 2 pings without data by default, then stops: keepalive
        # would stop keeping an idle connection (and the NAT mapping under it) alive
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(max_message_mb: int) -> list[tuple[str, int]]:
    """Options for our servers: the channel limits; keepalive enforcement that permits what
    clients may send (pings every `MIN_PING_S` or more, with no call open, no strikes for those);
    and no SO_REUSEPORT (gRPC's default), so a port another process listens on is refused
    instead of shared (answers would alternate)."""
    return [
        *channel_options(max_message_mb),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_S * 1000),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_S * 1000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.so_reuseport", 0),
    ]
