"""The live job page in a real browser: `swarmrl up --model tiny` writes run/endpoints.json, every
role's /metrics answers, headless Chromium (Debian's, driven by Playwright through its executable
path) watches the reward chart grow to two steps without a reload, the peer table's workers are
the peers `swarmrl status --json` lists, a burst of 200 requests at the pages doesn't stop the
next step, `swarmrl dashboard --trainer` serves the same page over gRPC, and a screenshot goes
to runs/dashboard-browser.png.

Skips, with the reason, where Playwright or Chromium is missing (scripts/run_tests.sh installs
Chromium where it can).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
STEPS = 60   # more than the test needs: every role must still be serving at the last assertion (teardown stops it)
CHROMIUM = os.environ.get("SWARMRL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def _wait_file(path: Path, proc: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"swarmrl up exited early ({proc.returncode})"
        assert time.monotonic() < deadline, f"{path} not written after {timeout_s:.0f}s"
        time.sleep(0.5)
    return json.loads(path.read_text())


def _chart_points(page) -> int:
    return int(page.eval_on_selector("svg.chart", "e => e.dataset.points"))


@pytest.fixture()
def swarm(tmp_path, model_cache):
    out = tmp_path / "up"
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115 - closed after the swarm stops
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmrl.node.cli.main", "up", "--model", "tiny", "--steps", str(STEPS), "--workers", "2",
         "--out", str(out), "--cache-dir", str(model_cache), "--timeout", "600", "--no-eval"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield out, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)   # run_up's finally stops the swarm's processes
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def test_dashboard_in_a_browser(swarm) -> None:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        pytest.skip(f"playwright is not installed: {exc}")
    if CHROMIUM is None:
        pytest.skip("no Chromium executable (apt-get install chromium, or set SWARMRL_CHROMIUM)")
    out, proc = swarm
    endpoints = _wait_file(out / "run" / "endpoints.json", proc, 600)
    assert set(endpoints["metrics"]) == {"trainer", "validator", "worker0", "worker1"}
    assert endpoints["dashboard"].startswith("http://127.0.0.1:")
    for name, url in endpoints["metrics"].items():
        assert _get(url)[0] == 200 and url.startswith("http://127.0.0.1:"), name
    trainer = json.loads((out / "run" / "trainer.ready").read_text())["endpoint"]

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(endpoints["dashboard"])
            page.evaluate("window.__loaded_once = true")   # a reload would clear it
            page.wait_for_function("+document.querySelector('svg.chart').dataset.points >= 2", timeout=420_000)
            assert page.evaluate("window.__loaded_once === true"), "the page reloaded instead of updating in place"
            rows = page.eval_on_selector_all(
                "table.peers tr[data-role='worker']",
                "rs => rs.map(r => [r.dataset.peer, +r.querySelector('td.admitted').textContent])")
            status = json.loads(subprocess.run(
                [sys.executable, "-m", "swarmrl.node.cli.main", "status", endpoints["dashboard"].rsplit("/", 1)[1],
                 "--trainer", trainer, "--json"], capture_output=True, text=True, check=True, timeout=60).stdout)
            listed = {p["peerId"]: int(p.get("groupsAdmitted", 0)) for p in status.get("peers", [])}
            # The status was read after the page: a worker whose first group was admitted in between is
            # listed there but not yet on the page, so the page's peers are a subset, and its counts no higher.
            assert {peer for peer, _ in rows} <= set(listed) and len(rows) >= 1
            for peer, admitted in rows:
                assert admitted <= listed[peer]
            # ...and the page catches up in place with every peer the status listed.
            page.wait_for_function(
                "ids => ids.every(id => document.querySelector(`table.peers tr[data-peer='${id}']`))",
                arg=sorted(listed), timeout=120_000)
            for role, name in (("worker0", "swarmrl_worker_rollouts_generated_total"),
                               ("trainer", "swarmrl_trainer_steps_total"), ("validator", "swarmrl_validator_peers")):
                assert name in _get(endpoints["metrics"][role])[1], role
            job_id = endpoints["dashboard"].rsplit("/", 1)[1]
            remote = subprocess.Popen([sys.executable, "-m", "swarmrl.node.cli.main", "dashboard", "--trainer", trainer,
                                       "--job", job_id, "--port", "0"], stdout=subprocess.PIPE, text=True)
            try:   # `swarmrl dashboard` serves the same page through the trainer's gRPC status
                url = remote.stdout.readline().strip()
                assert url.endswith(f"/jobs/{job_id}")
                code, body = _get(url + "/panel")
                assert code == 200 and "class='chart'" in body and "data-role='worker'" in body
                assert _get(url + "?steps=x")[0] == 400 and _get(url[: -len(job_id)] + "0" * 32)[0] == 404
            finally:
                remote.send_signal(signal.SIGINT)
                try:
                    remote.wait(30)
                except subprocess.TimeoutExpired:   # fail, but leave no process behind
                    remote.kill()
                    remote.wait()
                    raise
            (ROOT / "runs").mkdir(exist_ok=True)
            page.screenshot(path=str(ROOT / "runs" / "dashboard-browser.png"), full_page=True)

            before = _chart_points(page)
            base = endpoints["dashboard"]
            urls = [base, base + "/panel", base + "/status.json", endpoints["metrics"]["trainer"]] * 50
            with ThreadPoolExecutor(50) as pool:
                codes = list(pool.map(lambda u: _get(u)[0], urls))
            assert codes == [200] * 200
            if before < STEPS:   # the step under way when the burst hit completes
                page.wait_for_function(f"+document.querySelector('svg.chart').dataset.points > {before}",
                                       timeout=300_000)
        finally:
            browser.close()
    assert proc.poll() in (None, 0), f"swarmrl up failed ({proc.returncode})"
