"""Keepalive enforcement on the trainer's server matches what clients may send: a client with the
product's options and a standard client pinging (here every 10 s, the floor the server permits,
so a GOAWAY for too many pings would come within the test; 30 s in the 10-minute soak,
benchmarks/keepalive_soak.py) keep idle channels and idle streams for about 70 s."""

from __future__ import annotations

from typing import ClassVar

import pytest

from benchmarks.keepalive_soak import keepalive_survival
from swarmrl.node.trainer.service import serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class _NoJobs:
    jobs: ClassVar[dict[str, object]] = {}


def test_idle_channels_and_streams_survive_keepalive_pings():
    server, port = serve(_NoJobs(), "127.0.0.1", 0, 64)
    try:
        records = keepalive_survival(f"127.0.0.1:{port}", seconds=70, standard_ping_s=10)
    finally:
        server.stop(1).wait()
    assert [r.name for r in records] == ["product", "standard-10s"]
    for r in records:
        assert r.survived, (r.name, r.states, r.stream_end)
