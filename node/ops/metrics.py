"""Prometheus plumbing shared by every role: a registry of scrape-time collectors, the `/metrics`
route, and small builders for metric families.

Roles don't sprinkle increments through their hot paths: each registers a `Collector` that
reads the role's own state when Prometheus scrapes (a trainer's ledger and jobs, a worker's
session counters, a validator's tallies). Names follow Prometheus conventions: `swarmrl_`
prefix, base units (seconds, bytes), `_total` for counters.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swarmrl.node.ops.http_server import OpsServer, Reply, Routes, parse_query, start_ops_server

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SCRAPE_TTL_S = 1.0   # a scrape within this long of the last one gets the same exposition


class FnCollector(Collector):
    """A collector from a function that yields metric families at scrape time."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.fn = fn

    def collect(self) -> Iterable[Metric]:
        """The families `fn` yields now (called by the registry at each scrape)."""
        return list(self.fn())


def with_known(counts: Mapping[str, int], known: Iterable[str]) -> list[tuple[str, int]]:
    """(label, count) for every label seen and every known one, sorted: a labelled counter whose
    labels a role knows at start is exposed at 0 before its first event (a fresh role's
    /metrics is not empty, and a rate() has a first sample)."""
    return sorted({**dict.fromkeys(known, 0), **counts}.items())


def registry_of(*fns: Callable[[], Iterable[Metric]]) -> CollectorRegistry:
    """A fresh registry (not the process-global one) holding one collector per function."""
    reg = CollectorRegistry(auto_describe=False)
    for fn in fns:
        reg.register(FnCollector(fn))
    return reg


def add_metrics_route(routes: Routes, registry: CollectorRegistry, ttl_s: float = SCRAPE_TTL_S) -> None:
    """Serve `registry` at GET /metrics (no query parameters). The exposition is collected at
    most once per `ttl_s` (one collection in flight; concurrent scrapes share it), so a burst of
    scrapes costs the role one read of its state."""
    last: list[Any]  # [monotonic time of the last collection (s), its exposition bytes]
    lock, last = threading.Lock(), [-math.inf, b""]

    def handler(path: str, raw: str) -> Reply:
        parse_query(raw, set())
        with lock:
            if time.monotonic() - last[0] >= ttl_s:
                last[1] = generate_latest(registry)
                last[0] = time.monotonic()
            body = last[1]
        return Reply(200, body, CONTENT_TYPE)
    routes.add("/metrics", handler)


def gauge(name: str, doc: str, labels: Mapping[str, str] | None = None,
          value: float | None = None) -> GaugeMetricFamily:
    """A gauge family with label names from `labels`; one sample of `value` if given."""
    fam = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    if value is not None:
        fam.add_metric(list((labels or {}).values()), value)
    return fam


def counter(name: str, doc: str, labels: Mapping[str, str] | None = None,
            value: float | None = None) -> CounterMetricFamily:
    """A counter family; `name` ends in `_total` (the exposition adds nothing)."""
    assert name.endswith("_total"), name
    fam = CounterMetricFamily(name[: -len("_total")], doc, labels=list(labels or {}))
    if value is not None:
        fam.add_metric(list((labels or {}).values()), value)
    return fam


class Families:
    """Metric families by name, filled sample by sample (one family per name at each scrape)."""

    def __init__(self) -> None:
        self.fams: dict[str, Metric] = {}

    def gauge(self, name: str, doc: str, labels: Mapping[str, str], value: float) -> None:
        """Add a sample of gauge `name` (the family is made on first use)."""
        self._fam(name, lambda: gauge(name, doc, labels), labels, value)

    def counter(self, name: str, doc: str, labels: Mapping[str, str], value: float) -> None:
        """Add a sample of counter `name` (ending in `_total`; the family is made on first use)."""
        self._fam(name, lambda: counter(name, doc, labels), labels, value)

    def _fam(self, name: str, make: Callable[[], Metric], labels: Mapping[str, str], value: float) -> None:
        fam = self.fams.setdefault(name, make())
        fam.add_metric(list(labels.values()), float(value))  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Metric]:
        return iter(self.fams.values())


def start_metrics(host: str, port: int | None, *fns: Callable[[], Iterable[Metric]]) -> OpsServer | None:
    """Serve GET /metrics of the collectors `fns` on host:port (None: off; 0: any free port)."""
    if port is None:
        return None
    routes = Routes()
    add_metrics_route(routes, registry_of(*fns))
    return start_ops_server(host, port, routes)


def metrics_urls(server: OpsServer | None) -> dict[str, str]:
    """{"metrics": URL} for a ready file ({} when off)."""
    return {} if server is None else {"metrics": server.url("/metrics")}
