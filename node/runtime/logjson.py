"""`SWARMRL_LOG_FORMAT=json`: one JSON object per line, for log shippers.

Every record carries `ts` (ISO 8601, UTC), `level`, `logger`, `msg`, the process's `role` and
`peer_id`, and `job_id`: the record's own (`log.info(..., extra={"job_id": j})`), else the job id
(or its 12-character prefix) the message names as "job ID", else null. Exceptions go to `exc`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from datetime import UTC, datetime

CONTEXT: dict[str, str | None] = {"role": None, "peer_id": None}
JOB_IN_MESSAGE = re.compile(r"\bjob ([0-9a-f]{12,64})\b")


def set_log_context(**fields: str | None) -> None:
    """Fields every record carries from now on (role, peer_id)."""
    CONTEXT.update(fields)


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        """`record` as one line of JSON (ts, level, logger, msg, context fields, job_id)."""
        msg = record.getMessage()
        job = getattr(record, "job_id", None)
        if job is None:
            m = JOB_IN_MESSAGE.search(msg)
            job = m.group(1) if m else None
        out = {"ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "msg": msg, **CONTEXT, "job_id": job}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def apply_log_format(role: str) -> None:
    """Switch the root handlers to JSON lines when SWARMRL_LOG_FORMAT=json (text otherwise);
    raises ValueError for an unknown format."""
    fmt = os.environ.get("SWARMRL_LOG_FORMAT", "text").lower()
    if fmt not in ("text", "json"):
        raise ValueError(f"SWARMRL_LOG_FORMAT must be 'text' or 'json', got {fmt!r}")
    set_log_context(role=role)
    if fmt == "json":
        for name in ("", "hivemind"):   # hivemind keeps a handler of its own
            for handler in logging.getLogger(name).handlers:
                handler.setFormatter(JsonFormatter())
