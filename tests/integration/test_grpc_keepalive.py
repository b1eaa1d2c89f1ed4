"""Keepalive enforcement on the trainer's server matches what clients may send (issue 11): for ten
minutes, a client with the product's options and standard clients pinging every 30 s and every
10 s (the floor the server permits) each keep an idle channel and an idle `Watch` stream open,
with no GOAWAY ("too_many_pings") from the server.

The ten minutes run beside the rest of the suite: tests/conftest.py starts the soak
(benchmarks/keepalive_soak.py, tests/integration/keepalive_clients.py) in a subprocess when this
test is selected, and runs this test last; it waits for whatever is left of the soak, then
judges what the soak wrote. (SWARMRL_KEEPALIVE_SOAK_S shortens the soak, only to check this
mechanism.)"""

from __future__ import annotations

import subprocess

import pytest

from tests.integration.keepalive_clients import GOAWAY_MARKERS, SoakResult

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.keepalive_soak]


def test_idle_channels_and_streams_survive_ten_minutes_of_keepalive_pings(keepalive_soak):
    try:
        rc = keepalive_soak.wait(timeout=keepalive_soak.seconds + 120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the keepalive soak had not ended {keepalive_soak.seconds + 120:.0f} s after it started")
    stderr = keepalive_soak.stderr.read_text(errors="replace")
    assert rc == 0, f"the soak exited with {rc}:\n{stderr[-4000:]}"
    result = SoakResult.from_json(keepalive_soak.result.read_text())
    goaways = [line for line in stderr.splitlines() if any(m in line for m in GOAWAY_MARKERS)]
    assert not goaways, goaways
    assert result.seconds == keepalive_soak.seconds and result.held_s >= result.seconds
    assert [(r.client, r.kind) for r in result.records] == [
        (c, k) for c in ("product", "standard-10s", "standard-30s") for k in ("idle", "stream")]
    for r in result.records:
        assert r.survived, (r.client, r.kind, r.states, r.stream_end)
