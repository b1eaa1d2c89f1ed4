"""gRPC channel and server options: message limits set explicitly on both ends."""

from __future__ import annotations

MiB = 1 << 20


def channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    """Options for both servers and clients: send/receive limits and keepalive."""
    limit = max_message_mb * MiB
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def server_options(max_message_mb: int) -> list[tuple[str, int]]:
    """Options for our servers: the channel limits, and no SO_REUSEPORT (gRPC's default), so a
    port another process listens on is refused instead of shared (answers would alternate)."""
    return [*channel_options(max_message_mb), ("grpc.so_reuseport", 0)]
