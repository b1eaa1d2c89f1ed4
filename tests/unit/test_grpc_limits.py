"""The trainer's gRPC server under load: stream bounds, refusals with a retry hint, idle reaping,
a bounded stop, rate limits. The real service and server over loopback, an in-memory trainer
(tests/unit/grpc_fakes.py) behind them."""

from __future__ import annotations

import statistics
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from swarmrl.node.net.grpc_guard import retry_after_ms, source_address
from swarmrl.node.net.rate_limits import RATE_LIMITED_PEER, TokenBuckets
from swarmrl.node.runtime.limits import GrpcLimits, Rate, RateLimits
from swarmrl.node.trainer.service import serve
from swarmrl.protocol.identity import Identity
from tests.unit.grpc_fakes import JOB, FakeTrainer, SlowDownloader, lease_request, rollout_batch, stub


@pytest.fixture()
def served():
    started = []

    def start(limits: GrpcLimits | None = None, rate_limits: RateLimits | None = None, download_bytes: int = 64 << 20):
        trainer = FakeTrainer(download_bytes)
        server, port = serve(trainer, "127.0.0.1", 0, 64, limits=limits or GrpcLimits(), rate_limits=rate_limits)
        started.append(server)
        return trainer, server, f"127.0.0.1:{port}"
    yield start
    for server in started:
        server.stop(None).wait()


def _downloaders(endpoint: str, n: int, name=lambda i: f"peer-{i}") -> list[SlowDownloader]:
    out = [SlowDownloader(endpoint, name(i)) for i in range(n)]
    for d in out:
        assert d.first.wait(10)
    return out


def test_leases_and_submits_are_served_while_20_slow_downloaders_hold_streams(served):
    _, server, endpoint = served()
    slow = _downloaders(endpoint, 20)
    try:
        assert all(d.error is None for d in slow)
        time.sleep(0.3)
        assert server.guard.active() == 20        # all 20 hold their streams (and their threads)
        channel, s = stub(endpoint)
        who = Identity.generate()
        waits = []
        for _ in range(16):
            t0 = time.perf_counter()
            reply = s.RequestLease(lease_request(who), timeout=5)
            waits.append(time.perf_counter() - t0)
            assert reply.HasField("lease"), reply.reason
        receipt = s.SubmitRollouts(iter([rollout_batch(who)]), timeout=5)
        assert receipt.batches[0].accepted
        assert statistics.median(waits) < 0.5, waits
        channel.close()
    finally:
        for d in slow:
            d.close()


def test_streams_over_a_bound_are_refused_at_once_with_a_retry_hint(served):
    _, server, endpoint = served(GrpcLimits(max_streams=4, max_streams_per_peer=2, retry_after_s=1.5))
    held = _downloaders(endpoint, 2, name=lambda i: "greedy")
    try:
        third = SlowDownloader(endpoint, "greedy")        # same peer: over its bound
        assert third.first.wait(5)
        assert third.error is not None and third.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert retry_after_ms(third.error) == 1500
        held += _downloaders(endpoint, 2, name=lambda i: f"other-{i}")   # 4 streams: the total bound
        t0 = time.perf_counter()
        fifth = SlowDownloader(endpoint, "newcomer")
        assert fifth.first.wait(5)
        assert time.perf_counter() - t0 < 1.0            # refused at once, not queued
        assert fifth.error is not None and fifth.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.guard.refused == {"per_peer": 1, "total": 1}
    finally:
        for d in held:
            d.close()


def test_a_stream_that_stops_reading_is_ended_after_the_idle_timeout(served):
    _, server, endpoint = served(GrpcLimits(stream_idle_s=0.5, reap_every_s=0.1))
    (slow,) = _downloaders(endpoint, 1)
    deadline = time.monotonic() + 10
    while server.guard.active() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.guard.active() == 0 and server.guard.reaped["idle"] == 1
    slow.close()


def test_a_stream_past_its_deadline_is_ended(served):
    _, server, endpoint = served(GrpcLimits(stream_deadline_s=0.5, reap_every_s=0.1))
    (slow,) = _downloaders(endpoint, 1)
    deadline = time.monotonic() + 10
    while server.guard.active() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.guard.reaped["deadline"] == 1
    slow.close()


def test_stop_with_a_blocked_handler_exits_within_its_bound(tmp_path):
    """A handler blocked for good (here: on an event nobody sets) must not keep the process alive
    past stop(grace): the old server's pool threads were joined at exit, forever."""
    script = textwrap.dedent("""
        import threading, time, grpc
        from swarmrl.node.runtime.limits import GrpcLimits
        from swarmrl.node.net.grpc_server import build_server
        from swarmrl.node.net.grpc_options import channel_options
        block = threading.Event()
        entered = threading.Event()
        def stuck(request, context):
            entered.set()
            block.wait()
            return b""
        handler = grpc.method_handlers_generic_handler("swarmrl.v1.Trainer", {
            "RequestLease": grpc.unary_unary_rpc_method_handler(stuck)})
        server, port = build_server("127.0.0.1", 0, max_message_mb=4, limits=GrpcLimits(),
                                    services=["swarmrl.v1.Trainer"],
                                    add_servicers=lambda s: s.add_generic_rpc_handlers((handler,)))
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options(4))
        call = channel.unary_unary("/swarmrl.v1.Trainer/RequestLease").future(b"", timeout=60)
        assert entered.wait(10)
        t0 = time.monotonic()
        server.stop(1.0).wait()
        print(f"stopped {time.monotonic() - t0:.2f}", flush=True)
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    stopped = float(proc.stdout.split("stopped")[1])
    assert stopped < 2.5, proc.stdout              # grace 1 s + the 1 s bound
    assert elapsed < 30, elapsed                  # and the process exited (start-up included)


def test_lease_requests_over_a_peers_rate_are_refused_with_a_hint_and_counted(served):
    trainer, _, endpoint = served(rate_limits=RateLimits(lease_per_peer=Rate(per_s=0.5, burst=3)))
    channel, s = stub(endpoint)
    who, other = Identity.generate(), Identity.generate()
    replies = [s.RequestLease(lease_request(who), timeout=5) for _ in range(5)]
    assert [r.HasField("lease") for r in replies] == [True, True, True, False, False]
    assert replies[3].reason == RATE_LIMITED_PEER and 1000 <= replies[3].retry_after_ms <= 2000
    assert s.RequestLease(lease_request(other), timeout=5).HasField("lease")   # others are not starved
    assert trainer.jobs[JOB].admission.refused == {RATE_LIMITED_PEER: 2}
    channel.close()


def test_submissions_over_an_addresss_rate_end_resource_exhausted_with_a_hint(served):
    trainer, _, endpoint = served(rate_limits=RateLimits(submit_per_address=Rate(per_s=1, burst=2)))
    channel, s = stub(endpoint)
    keys = [Identity.generate() for _ in range(3)]    # many keys, one address: one budget
    assert s.SubmitRollouts(iter([rollout_batch(keys[0])]), timeout=5).batches[0].accepted
    assert s.SubmitRollouts(iter([rollout_batch(keys[1])]), timeout=5).batches[0].accepted
    with pytest.raises(grpc.RpcError) as refused:
        s.SubmitRollouts(iter([rollout_batch(keys[2])]), timeout=5)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (retry_after_ms(refused.value) or 0) > 0
    assert trainer.admitted == 2
    channel.close()


def test_token_buckets_refill_and_stay_bounded():
    now = [0.0]
    buckets = TokenBuckets(Rate(per_s=2, burst=2), max_keys=3, clock=lambda: now[0])
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.5]
    now[0] += 0.5
    assert buckets.take("a") == 0.0 and buckets.take("a") == 0.5
    for k in "bcde":
        buckets.take(k)
    assert len(buckets._buckets) == 3


def test_source_addresses():
    assert source_address("ipv4:10.1.2.3:5555") == "10.1.2.3"
    assert source_address("ipv6:[2001:db8:1:2:3:4:5:6]:443") == "2001:db8:1:2::/64"


class _Refused(grpc.RpcError, grpc.Call):
    def __init__(self, code, hint_ms=None):
        self._code, self._hint = code, hint_ms

    def code(self):
        return self._code

    def trailing_metadata(self):
        return (("retry-after-ms", str(self._hint)),) if self._hint is not None else ()


def test_workers_back_off_with_jitter_on_overload_and_honour_the_hint():
    from swarmrl.node.net.grpc_retry import Backoff, call_with_backoff

    outcomes = [_Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, 1500), _Refused(grpc.StatusCode.UNAVAILABLE), "ok"]
    slept = []

    def call():
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out
    assert call_with_backoff(call, Backoff(attempts=4, base_s=0.25), sleep=slept.append) == "ok"
    assert 1.5 <= slept[0] <= 1.75 and 0 <= slept[1] <= 0.5
    assert Backoff(max_hint_s=30).delay(0, 3600.0) <= 30.25   # a server can't park its clients for good
    with pytest.raises(grpc.RpcError):   # not an overload: no retry
        call_with_backoff(lambda: (_ for _ in ()).throw(_Refused(grpc.StatusCode.PERMISSION_DENIED)),
                          sleep=slept.append)
    assert len(slept) == 2


def test_callers_naming_no_peer_are_bounded_per_address(served):
    _, server, endpoint = served(GrpcLimits(max_streams=8, max_streams_per_peer=1, max_streams_per_address=3))
    held = _downloaders(endpoint, 3, name=lambda i: "")   # no peer id: only the address bound applies
    try:
        fourth = SlowDownloader(endpoint, "")
        assert fourth.first.wait(5) and fourth.error is not None
        assert fourth.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.guard.refused == {"per_address": 1}
    finally:
        for d in held:
            d.close()
