"""Where an operator looks at a local swarm: the job page and every role's /metrics, read from
the roles' ready files and written to `DIR/run/endpoints.json` by `swarmrl up`:

    {"dashboard": "http://127.0.0.1:PORT/jobs/JOB", "metrics": {"trainer": URL, "worker0": URL, ...}}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from swarmrl.node.runtime.lifecycle import write_ready


def collect_endpoints(work: Path, names: list[str], job_id: str, trainer: str = "trainer") -> dict[str, Any]:
    """The endpoints of the roles `names` (ready files `work/NAME.ready`); the dashboard is
    `trainer`'s page of `job_id` (null when its ops server is off)."""
    metrics: dict[str, str] = {}
    dashboard: str | None = None
    for name in names:
        path = work / f"{name}.ready"
        info = json.loads(path.read_text()) if path.exists() else {}
        if "metrics" in info:
            metrics[name] = info["metrics"]
        if name == trainer and "dashboard" in info:
            dashboard = info["dashboard"].rstrip("/") + f"/jobs/{job_id}"
    return {"dashboard": dashboard, "metrics": metrics}


def write_endpoints(work: Path, endpoints: dict[str, Any]) -> Path:
    """Write `endpoints` (from `collect_endpoints`) to `work/endpoints.json`; returns that path."""
    path = work / "endpoints.json"
    write_ready(path, endpoints)
    return path


def describe(endpoints: dict[str, Any]) -> str:
    """Lines for the console."""
    lines = [f"dashboard: {endpoints['dashboard'] or 'off'}"]
    lines += [f"metrics {name}: {url}" for name, url in sorted(endpoints["metrics"].items())]
    return "\n".join(lines)
