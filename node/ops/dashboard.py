"""The live job page's routes, over any source of `JobStatus`: the trainer's own jobs (served by
the trainer on its ops port) or a trainer's gRPC `GetJobStatus` (`swarmrl dashboard --trainer`).

    GET /                      the jobs served here, side by side
    GET /jobs/JOB              the page (polls /jobs/JOB/panel every 2 s and swaps it in place)
    GET /jobs/JOB/panel        the live panel (HTML fragment)
    GET /jobs/JOB/status.json  the status the panel was rendered from
    GET /jobs/JOB/credit       the leaderboard (HTML fragment; the page polls it every 10 s)
    GET /jobs/JOB/credit.json  the leaderboard as JSON (protocol.leaderboard.Board.as_dict)
    GET /jobs/JOB/credit.csv   one CSV row per peer
    ?steps=N                   chart the last N steps (1..HISTORY)

The leaderboard comes from the trainer's signed statements (`protocol.leaderboard.read_board`), read
at most once per CREDIT_TTL_S; a source without one (`credit` None) answers 404 there.

A status is fetched at most once per `ttl_s` per job however many requests arrive (one fetch in
flight, the others wait for it and share it), so a burst of page requests costs the trainer a
bounded number of ledger reads and never touches its step. Unknown jobs and paths are 404,
malformed queries 400.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from google.protobuf.json_format import MessageToDict

from swarmrl.node.ops import dashboard_page as render
from swarmrl.node.ops.http_server import Reply, Routes, int_param, not_found, parse_query
from swarmrl.protocol.leaderboard import UnknownJobBooks, read_board
from swarmrl.protocol.pb import swarm_pb2 as pb

if TYPE_CHECKING:
    from swarmrl.protocol.leaderboard import Board, Books
    from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc

HISTORY = 500      # step rows fetched per status
VERDICTS = 20      # recent verdicts fetched per status
JOB_ID = re.compile(r"[0-9a-f]{32}")   # protocol.jobspec.job_id_from_body
HTML = "text/html; charset=utf-8"
log = logging.getLogger(__name__)
CREDIT_TTL_S = 10.0   # a job's leaderboard is read at most this often (s): statements + sampled batches
Fetch = Callable[[str], "pb.JobStatus | None"]   # job id -> status, None for a job the source doesn't know
CreditFetch = Callable[[str], "Board | None"]    # job id -> leaderboard, None for a job the source doesn't know
T = TypeVar("T")


class StatusCache(Generic[T]):
    """`fetch` results per job (a status, or a leaderboard), at most one fetch per `ttl_s`
    (single flight); unknown jobs are remembered too, and at most `max_jobs` entries are kept
    (least recently used out)."""

    def __init__(self, fetch: Callable[[str], T | None], ttl_s: float = 1.0, max_jobs: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fetch, self.ttl_s, self.max_jobs, self.clock = fetch, ttl_s, max_jobs, clock
        self._entries: OrderedDict[str, tuple[float, T | None]] = OrderedDict()
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self.fetches = 0

    def get(self, job_id: str) -> T | None:
        """The status of `job_id` (None if the source doesn't know it), fetched at most once per
        `ttl_s`; concurrent requests for one job share a fetch."""
        hit = self._fresh(job_id)
        if hit is not None:
            return hit[1]
        with self._lock:
            job_lock = self._locks.setdefault(job_id, threading.Lock())
        with job_lock:
            hit = self._fresh(job_id)   # another request fetched it while we waited
            if hit is not None:
                return hit[1]
            st = self.fetch(job_id)
            self.fetches += 1
            with self._lock:
                self._entries[job_id] = (self.clock(), st)
                self._entries.move_to_end(job_id)
                while len(self._entries) > self.max_jobs:
                    old, _ = self._entries.popitem(last=False)
                    self._locks.pop(old, None)
            return st

    def known(self) -> list[str]:
        """Jobs fetched so far that the source knows."""
        with self._lock:
            return sorted(j for j, (_, st) in self._entries.items() if st is not None)

    def _fresh(self, job_id: str) -> tuple[float, T | None] | None:
        with self._lock:
            entry = self._entries.get(job_id)
        if entry is not None and self.clock() - entry[0] < self.ttl_s:
            return entry
        return None


def add_dashboard_routes(routes: Routes, cache: StatusCache[pb.JobStatus], jobs: Callable[[], list[str]], source: str,
                         credit: StatusCache[Board] | None = None) -> None:
    """Serve the job pages of `cache` (`jobs`: the ids the index lists; `source`: where the
    status comes from, shown on the page; `credit`: the jobs' leaderboards, None: none)."""

    def index(path: str, raw: str) -> Reply:
        parse_query(raw, set())
        return Reply(200, render.index([(j, cache.get(j)) for j in jobs()]).encode(), HTML)

    rendered: dict[tuple[str, str, int], tuple[pb.JobStatus, bytes]] = {}   # rendered once per fetched status
    lock = threading.Lock()

    def job(path: str, raw: str) -> Reply:
        parts = path.strip("/").split("/")   # ["jobs", JOB] or ["jobs", JOB, what]
        if len(parts) not in (2, 3) or not JOB_ID.fullmatch(parts[1]):
            return not_found()
        what = parts[2] if len(parts) == 3 else ""
        if what in CREDIT_VIEWS:
            return credit_view(parts[1], what, raw)
        if what not in ("", "panel", "status.json"):
            return not_found()
        steps = int_param(parse_query(raw, {"steps"}), "steps", HISTORY, 1, HISTORY)
        st = cache.get(parts[1])
        if st is None:
            return not_found(f"unknown job {parts[1]}")
        key = (parts[1], what, steps)
        with lock:
            hit = rendered.get(key)
        if hit is None or hit[0] is not st:
            hit = (st, _render(st, what, steps, source))
            with lock:
                rendered[key] = hit
                while len(rendered) > 64:
                    rendered.pop(next(iter(rendered)))
        return Reply(200, hit[1], "application/json" if what == "status.json" else HTML)

    def credit_view(job_id: str, what: str, raw: str) -> Reply:
        parse_query(raw, set())
        b = credit.get(job_id) if credit is not None else None
        if b is None:
            return not_found(f"no leaderboard for job {job_id}")
        if what == "credit.json":
            return Reply(200, json.dumps(b.as_dict()).encode(), "application/json")
        if what == "credit.csv":
            return Reply(200, b.csv_text().encode(), "text/csv; charset=utf-8")
        return Reply(200, render.credit_table(b).encode(), HTML)

    routes.add("/", index)
    routes.add("/jobs/", job)


CREDIT_VIEWS = ("credit", "credit.json", "credit.csv")


def _render(st: pb.JobStatus, what: str, steps: int, source: str) -> bytes:
    shown = pb.JobStatus()
    shown.CopyFrom(st)
    del shown.history[:-steps]
    if what == "status.json":
        return json.dumps(MessageToDict(shown)).encode()
    return (render.panel(shown) if what == "panel" else render.page(shown, source)).encode()


def local_fetch(jobs: Callable[[], dict[str, Any]], status: Callable[..., pb.JobStatus]) -> Fetch:
    """Statuses of a trainer's own jobs (`Trainer.jobs`), read in the HTTP thread with `status`
    (`node.trainer.status.job_status`: job, history, verdicts, holders=)."""
    def fetch(job_id: str) -> pb.JobStatus | None:
        job = jobs().get(job_id)
        return None if job is None else status(job, HISTORY, VERDICTS, holders=True)
    return fetch


def books_credit(books: Callable[[str], Books | None], sample: int = 16) -> CreditFetch:
    """Leaderboards read from the books `books(job_id)` names (None: a job the source doesn't
    know), checking `sample` credited batches per read (`protocol.leaderboard.read_board`). A
    trainer that can't be reached (grpc.RpcError) gives no board until the next read (logged)."""
    import grpc

    def fetch(job_id: str) -> Board | None:
        try:
            b = books(job_id)
            return None if b is None else read_board(b, job_id, sample=sample)
        except UnknownJobBooks:
            return None
        except grpc.RpcError as exc:
            log.warning("job %s: no leaderboard, its trainer can't be reached: %s", job_id, exc.code())
            return None
    return fetch


def grpc_fetch(stub: pb_grpc.TrainerStub, timeout_s: float = 10.0) -> Fetch:
    """Statuses over a trainer's gRPC `GetJobStatus` (`swarmrl dashboard`), each call retried with
    backoff when the trainer refuses it as overloaded or can't be reached (`node.net.grpc_retry`; the
    dashboard has no identity, so it names no peer)."""
    from swarmrl.node.net.grpc_retry import call_with_backoff

    def fetch(job_id: str) -> pb.JobStatus | None:
        req = pb.JobStatusRequest(job_id=job_id, history=HISTORY, verdicts=VERDICTS, holders=True)
        st = call_with_backoff(lambda: stub.GetJobStatus(req, timeout=timeout_s))
        return None if st.state == "unknown" else st
    return fetch


def first_known(fetches: list[Fetch]) -> Fetch:
    """A fetch that asks each of `fetches` in turn (one per trainer) and returns the first status
    found: the jobs of several trainers on one page."""
    def fetch(job_id: str) -> pb.JobStatus | None:
        for one in fetches:
            st = one(job_id)
            if st is not None:
                return st
        return None
    return fetch


def run_dashboard(trainers: list[str], host: str, port: int, job_ids: list[str], max_message_mb: int = 64,
                  books: Callable[[str], Books | None] | None = None) -> None:
    """`swarmrl dashboard`: serve the job pages of the trainers at `trainers` (HOST:PORT each; a
    job is read from the first that hosts it) until interrupted, polling their gRPC `GetJobStatus`;
    the index shows the jobs side by side; each job's leaderboard is read from the books
    `books(job_id)` names (the command line passes the trainers' gRPC books; None: no leaderboard)."""
    import grpc

    from swarmrl.node.net.grpc_options import channel_options
    from swarmrl.node.ops.http_server import start_ops_server
    from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc

    channels = [grpc.insecure_channel(t, options=channel_options(max_message_mb)) for t in trainers]
    cache = StatusCache(first_known([grpc_fetch(pb_grpc.TrainerStub(c)) for c in channels]), ttl_s=1.0)
    credit = StatusCache(books_credit(books), ttl_s=CREDIT_TTL_S) if books is not None else None
    routes = Routes()
    add_dashboard_routes(routes, cache, lambda: sorted(set(job_ids) | set(cache.known())),
                         f"trainer{'s' if len(trainers) > 1 else ''} {', '.join(trainers)} (gRPC)", credit)
    server = start_ops_server(host, port, routes)
    for j in job_ids or [""]:
        print(server.url(f"/jobs/{j}" if j else "/"), flush=True)
    try:
        server.thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        for c in channels:
            c.close()
