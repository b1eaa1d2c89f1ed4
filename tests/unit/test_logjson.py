"""SWARMRL_LOG_FORMAT=json: one JSON object per line with role, peer id and job id."""

from __future__ import annotations

import io
import json
import logging

import pytest

from swarmrl.node.runtime import logjson


@pytest.fixture()
def json_logger(monkeypatch):
    monkeypatch.setenv("SWARMRL_LOG_FORMAT", "json")
    stream = io.StringIO()
    root = logging.getLogger()
    handler = logging.StreamHandler(stream)
    root.addHandler(handler)
    saved = dict(logjson.CONTEXT)
    formatters = {h: h.formatter for h in root.handlers}
    try:
        logjson.apply_log_format("trainer")
        logjson.set_log_context(peer_id="peer-1")
        yield logging.getLogger("swarmrl.test"), stream
    finally:
        root.removeHandler(handler)
        for h, f in formatters.items():
            h.setFormatter(f)
        logjson.CONTEXT.clear()
        logjson.CONTEXT.update(saved)


def test_every_record_carries_role_peer_and_job(json_logger) -> None:
    log, stream = json_logger
    log.warning("job %s step %d", "a" * 64, 3)
    log.warning("no job here")
    log.warning("explicit", extra={"job_id": "j-7"})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("job %s failed", "b" * 12)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 4
    assert all(r["role"] == "trainer" and r["peer_id"] == "peer-1" and r["level"] for r in lines)
    assert [r["job_id"] for r in lines] == ["a" * 64, None, "j-7", "b" * 12]
    assert "RuntimeError: boom" in lines[3]["exc"] and lines[0]["msg"] == f"job {'a' * 64} step 3"


def test_unknown_format_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("SWARMRL_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="SWARMRL_LOG_FORMAT"):
        logjson.apply_log_format("worker")
