"""Data-set distribution: a JSONL file reaching N workers, seconds and the trainer's upload share.

Real transport, one process per worker: a trainer's gRPC server (`node.trainer.service.serve`,
the real `TrainerService.FetchDataset`, over a stand-in trainer that hosts only the file and
counts the bytes it serves, as `Trainer.count_upload` does) and a hivemind DHT node on
127.0.0.1 in this process; N spawned worker processes, each with its own DHT node (loopback, no
NAT/relay), `GossipNode`, trainer channel and an empty `DatasetStore` per run. Every worker calls
`node.swarm.datasets.fetch_dataset` as `JobSession` does: peers announcing the file first
(holders record of "dataset:<sha256>"), then the trainer. Each run uses a fresh file (new
content, new sha256), so no cache or earlier holder record helps.

Modes:
- `no-gossip`: workers have no gossip node: every copy comes from the trainer (the star);
- `gossip-together`: gossip on, all workers start at once (they find the job in the same poll);
- `gossip-jitter`: gossip on, worker i starts after a uniform(0, --jitter) delay (a worker sees a
  new job at its next poll; `poll_s` defaults to 1 s);
- `gossip-chain`: gossip on, each worker starts when the previous one holds the file (the best case).
Printed per mode: seconds from the first start until all N hold verified copies (median and
range of --runs runs), the trainer's upload share = bytes the trainer served / (N x file size),
where the copies came from (per run) and peer transfers refused (a peer stream that did not verify).

The default 50 MB is over `MAX_DATASET_BYTES` (32 MiB: a job carries its file inside the signed
`Job` to the trainer), so the task is built unvalidated (`DatasetTask.model_construct`); the
transfer path itself has no size cap below `gossip.MAX_UPDATE_BYTES`.

    .venv/bin/python benchmarks/dataset_distribution.py [--mb 50] [--workers 4] [--runs 3] [--jitter 1.0]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import random
import socket
import statistics
import tempfile
import threading
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from swarmrl.node.net.grpc_wire import GrpcWire
from swarmrl.node.net.trainer_client import TrainerClient
from swarmrl.node.swarm.datasets import DatasetFetchStats, DatasetStore, fetch_dataset
from swarmrl.node.swarm.dht import start_dht, visible_maddrs
from swarmrl.node.swarm.gossip import GossipNode
from swarmrl.node.trainer.service import serve
from swarmrl.protocol.envs.dataset import DatasetTask, RewardSpec, chunk_hashes, sha256_hex
from swarmrl.protocol.identity import Identity

MAX_MESSAGE_MB = 16
MODES = ("no-gossip", "gossip-together", "gossip-jitter", "gossip-chain")


class FileTrainer:
    """The part of `node.trainer.hosting.Trainer` that `FetchDataset` uses: one hosted file, and
    the bytes served (`count_upload`)."""

    def __init__(self) -> None:
        self.jobs: dict[str, Any] = {}
        self.files: dict[str, bytes] = {}
        self.upload_bytes = 0
        self._lock = threading.Lock()

    def dataset_bytes(self, sha256_hex: str) -> bytes | None:
        """The hosted file with that sha256, or None."""
        return self.files.get(sha256_hex)

    def count_upload(self, n: int) -> None:
        """Count `n` bytes served."""
        with self._lock:
            self.upload_bytes += n


def make_file(size: int, seed: int) -> bytes:
    """About `size` bytes of JSONL rows {"question", "answer"} (random, so every run's sha256 differs)."""
    rng = random.Random(seed)
    rows, total = [], 0
    while total < size:
        a, b = rng.randrange(100), rng.randrange(100)
        row = json.dumps({"question": f"What is {a}+{b}? {rng.randbytes(48).hex()}", "answer": str(a + b)}) + "\n"
        rows.append(row)
        total += len(row)
    return "".join(rows).encode()


def task_for(data: bytes) -> DatasetTask:
    """The file's content address as a job carries it (unvalidated: over the job's size cap)."""
    return DatasetTask.model_construct(
        dataset="bench.jsonl", dataset_sha256=sha256_hex(data), dataset_size=len(data), dataset_format="jsonl",
        dataset_chunks=chunk_hashes(data), prompt_field="question", answer_field="answer",
        rewards=(RewardSpec(name="numeric"),))


def worker_main(conn: Connection, peers: list[str], endpoint: str) -> None:
    """One worker process: a DHT node, a gossip node and a trainer channel; answers commands:
    ("fetch", task fields, store dir, use gossip, start at monotonic time) -> (done at, sources,
    refused), ("drop", sha256) -> None (stop serving that file), ("stop",)."""
    logging.basicConfig(level=logging.WARNING)
    dht = start_dht(peers)
    gossip = GossipNode(dht, Identity.generate())
    trainer = TrainerClient(GrpcWire(endpoint, b"", max_message_mb=MAX_MESSAGE_MB))   # a worker's client
    conn.send("ready")
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] == "drop":
                gossip.datasets.pop(cmd[1], None)
                conn.send(None)
                continue
            _, fields, store, use_gossip, start_at = cmd
            time.sleep(max(0.0, start_at - time.monotonic()))
            task, stats = DatasetTask.model_construct(**fields), DatasetFetchStats()
            got = fetch_dataset(task, DatasetStore(Path(store)), stats=stats, gossip=gossip if use_gossip else None,
                                dht=dht, trainer=trainer)
            ok = sha256_hex(got) == task.dataset_sha256
            conn.send((time.monotonic(), dict(stats.sources), dict(stats.refused), ok))
    finally:
        trainer.close()
        gossip.shutdown()
        dht.shutdown()


def one_run(mode: str, workers: list[Connection], trainer: FileTrainer, data: bytes, root: Path,
            jitter_s: float, seed: int) -> dict[str, Any]:
    """All workers fetch `data` under `mode`; returns seconds, trainer bytes, sources and refusals."""
    task = task_for(data)
    fields = {k: getattr(task, k) for k in ("dataset", "dataset_sha256", "dataset_size", "dataset_format",
                                            "dataset_chunks", "prompt_field", "answer_field", "rewards")}
    trainer.files = {task.dataset_sha256: data}
    trainer.upload_bytes = 0
    rng = random.Random(seed)
    delays = [rng.uniform(0.0, jitter_s) if mode == "gossip-jitter" else 0.0 for _ in workers]
    use_gossip = mode != "no-gossip"
    t0 = time.monotonic() + 0.2
    replies = []
    if mode == "gossip-chain":
        t0 = time.monotonic()
        for i, w in enumerate(workers):
            w.send(("fetch", fields, str(root / f"{seed}-{i}"), use_gossip, time.monotonic()))
            replies.append(w.recv())
    else:
        for i, w in enumerate(workers):
            w.send(("fetch", fields, str(root / f"{seed}-{i}"), use_gossip, t0 + delays[i]))
        replies = [w.recv() for w in workers]
    for w in workers:   # the next run's file is another one; free the memory
        w.send(("drop", task.dataset_sha256))
        w.recv()
    if not all(r[3] for r in replies):
        raise RuntimeError("a worker got bytes that do not verify")
    sources: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    for r in replies:
        sources.update(r[1])
        refused.update(r[2])
    return {"seconds": max(r[0] for r in replies) - t0, "trainer_bytes": trainer.upload_bytes,
            "share": trainer.upload_bytes / (len(workers) * len(data)), "sources": dict(sources),
            "refused": sum(refused.values())}


def start_workers(n: int, peers: list[str], endpoint: str) -> tuple[list[Connection], list[Any]]:
    """N worker processes (spawned) on loopback; returns their command pipes and processes."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(n):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker_main, args=(child, peers, endpoint))   # not daemonic: it forks its DHT
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    for p in pipes:
        if p.recv() != "ready":
            raise RuntimeError("a worker did not start")
    return pipes, procs


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    """Parse the command line, start the trainer and workers, run every mode, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=50.0, help="file size in MB (10^6 bytes)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--jitter", type=float, default=1.0, help="gossip-jitter: max start delay, seconds")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", type=Path, help="also write the raw runs here")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if os.environ.get("DSBENCH_DEBUG"):
        logging.getLogger("hivemind").setLevel(logging.DEBUG)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    trainer = FileTrainer()
    trainer_dht = start_dht()
    port = free_port()
    server, _ = serve(trainer, "127.0.0.1", port, MAX_MESSAGE_MB)
    workers, procs = start_workers(args.workers, visible_maddrs(trainer_dht), f"127.0.0.1:{port}")
    size = int(args.mb * 1e6)
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        with tempfile.TemporaryDirectory(prefix="swarmrl-dsbench-") as tmp:
            for run in range(args.runs):
                for k, mode in enumerate(modes):
                    seed = run * len(MODES) + k
                    data = make_file(size, seed)
                    r = one_run(mode, workers, trainer, data, Path(tmp), args.jitter, seed)
                    results[mode].append(r)
                    print(f"run {run} {mode}: {r['seconds']:.2f} s, trainer share {r['share']:.2f}, "
                          f"sources {r['sources']}, refused {r['refused']}", flush=True)
    finally:
        for w in workers:
            w.send(("stop",))
        for proc in procs:
            proc.join(timeout=15)
            if proc.is_alive():
                proc.terminate()
        trainer_dht.shutdown()
        server.stop(0)
    print(f"\n{len(data) / 1e6:.1f} MB JSONL to {args.workers} workers, {args.runs} runs each "
          f"(cpu count {os.cpu_count()}):")
    print(f"{'mode':>16} {'all hold, s (median [min-max])':>32} {'trainer share':>13} {'trainer/peer copies':>19} "
          f"{'refused':>7}")
    for mode, rs in results.items():
        secs = [r["seconds"] for r in rs]
        share = statistics.median(r["share"] for r in rs)
        src: Counter[str] = Counter()
        for r in rs:
            src.update(r["sources"])
        copies = f"{src['trainer'] / len(rs):.1f}/{src['peer'] / len(rs):.1f}"
        span = f"{statistics.median(secs):.2f} [{min(secs):.2f}-{max(secs):.2f}]"
        print(f"{mode:>16} {span:>32} {share:>13.2f} {copies:>19} {sum(r['refused'] for r in rs):>7}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
