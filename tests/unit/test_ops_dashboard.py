"""The ops HTTP server and the job page: routes, 404 / 400 / 405, the status cache's single
flight, escaping, and the panel's content, over a fake status source (no trainer)."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import pytest

from swarmrl.node.ops import dashboard_page as render
from swarmrl.node.ops.dashboard import StatusCache, add_dashboard_routes
from swarmrl.node.ops.http_server import Routes, start_ops_server
from swarmrl.node.ops.metrics import add_metrics_route, gauge, registry_of
from swarmrl.protocol.pb import swarm_pb2 as pb

JOB = "ab" * 16


def _status(steps: int = 3) -> pb.JobStatus:
    st = pb.JobStatus(job_id=JOB, state="running", policy_version=steps, step=steps, total_steps=10,
                      groups_admitted=12, trainer_id="trainer-1")
    st.groups_rejected["stale"] = 2
    for s in range(1, steps + 1):
        m = st.history.add(step=s, policy_version=s, reward_mean=0.1 * s, staleness_mean=0.5, loss=0.01, seconds=1.0)
        m.extra["ess"] = 0.9
    p = st.peers.add(peer_id="worker-<script>alert(1)</script>", groups_admitted=7, groups_rejected=2,
                     reputation=0.75, adapter_version=steps - 1)
    p.rejected_by_reason["stale"] = 2
    st.peers.add(peer_id="worker-b", groups_admitted=5, banned=True, ban_reason="logprob: off")
    st.recent_verdicts.add(verdict=pb.Verdict(peer_id="worker-b", check="logprob", passed=False), validator_id="val-1")
    st.holder_versions["worker-b"] = steps
    return st


def _get(url: str, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture()
def server():
    statuses = {JOB: _status()}
    routes = Routes()
    cache = StatusCache(lambda j: statuses.get(j), ttl_s=0.0)
    add_dashboard_routes(routes, cache, lambda: sorted(statuses), "test")
    add_metrics_route(routes, registry_of(lambda: [gauge("swarmrl_test_value", "a test gauge", {}, 1.0)]))
    srv = start_ops_server("127.0.0.1", 0, routes)
    yield srv, statuses
    srv.close()


def test_pages_and_metrics_answer(server) -> None:
    srv, _ = server
    assert srv.server_address[0] == "127.0.0.1"
    code, body = _get(srv.url(f"/jobs/{JOB}"))
    assert code == 200 and "<main id='panel'>" in body and "setInterval(refresh" in body
    code, body = _get(srv.url(f"/jobs/{JOB}/panel?steps=2"))
    assert code == 200 and "data-points='2'" in body
    code, body = _get(srv.url("/"))
    assert code == 200 and f"/jobs/{JOB}" in body
    code, body = _get(srv.url("/metrics"))
    assert code == 200 and "swarmrl_test_value 1.0" in body
    code, body = _get(srv.url(f"/jobs/{JOB}/status.json"))
    assert code == 200 and '"jobId"' in body


@pytest.mark.parametrize("path", ["/nope", f"/jobs/{'cd' * 16}", "/jobs/not-a-job", f"/jobs/{JOB}/other",
                                  f"/jobs/{JOB}/panel/x", "/metrics/x", "/jobs"])
def test_unknown_paths_and_jobs_are_404(server, path) -> None:
    assert _get(server[0].url(path))[0] == 404


@pytest.mark.parametrize("query", ["steps=abc", "steps=0", "steps=99999", "steps=1&steps=2", "bogus=1", "%zz&&=",
                                   "steps=" + "9" * 2000])
def test_malformed_queries_are_400(server, query) -> None:
    assert _get(server[0].url(f"/jobs/{JOB}?{query}"))[0] == 400


def test_metrics_refuses_queries_and_writes(server) -> None:
    srv, _ = server
    assert _get(srv.url("/metrics?x=1"))[0] == 400
    for method in ("POST", "PUT", "DELETE"):
        assert _get(srv.url("/metrics"), method)[0] == 405
        assert _get(srv.url(f"/jobs/{JOB}"), method)[0] == 405


def test_status_strings_are_escaped() -> None:
    html = render.panel(_status())
    assert "<script>alert" not in html and "&lt;script&gt;" in html


def test_panel_shows_peers_verdicts_and_gossip() -> None:
    html = render.panel(_status(steps=3))
    assert "data-points='3'" in html
    assert html.count("data-role='worker'") == 2 and "data-role='validator'" in html
    assert "logprob: off" in html and "delta gossip" in html
    assert "<td>1</td>" in html   # adapter lag of the first worker (3 - 2)


def test_empty_history_renders() -> None:
    html = render.panel(pb.JobStatus(job_id=JOB, state="running"))
    assert "no steps yet" in html and "data-points='0'" in html


def test_cache_fetches_once_per_ttl_under_concurrency() -> None:
    calls = []

    def slow_fetch(job_id: str) -> pb.JobStatus:
        calls.append(job_id)
        time.sleep(0.2)
        return _status()

    now = [0.0]
    cache = StatusCache(slow_fetch, ttl_s=1.0, clock=lambda: now[0])
    threads = [threading.Thread(target=cache.get, args=(JOB,)) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    now[0] = 2.0
    cache.get(JOB)
    assert len(calls) == 2


def test_cache_keeps_a_bounded_number_of_jobs() -> None:
    cache = StatusCache(lambda j: None, ttl_s=10.0, max_jobs=4)
    for i in range(20):
        cache.get(f"{i:032x}")
    assert len(cache._entries) == 4 and cache.known() == []
