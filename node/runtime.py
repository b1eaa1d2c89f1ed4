"""Process-level helpers shared by every role: threads, logging, signals, ready files."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

from swarmrl.node.logjson import apply_log_format, set_log_context


def set_threads(n: int) -> None:
    """Pin torch and BLAS thread pools to `n` (several torch processes share 2 cores)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass


def setup_logging(role: str) -> None:
    level = os.environ.get("SWARMRL_LOG", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    apply_log_format(role)   # SWARMRL_LOG_FORMAT=json: one JSON object per line (node/logjson.py)
    for noisy in ("hivemind", "grpc", "urllib3", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))


def stop_event() -> threading.Event:
    """An event set on SIGTERM / SIGINT, for a clean shutdown of the main loop."""
    ev = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: ev.set())
    return ev


def start_role(role: str, key: Path, net, threads: int):
    """The common start of a role process: logging, thread pools, signal handling, the peer's
    identity and its DHT node. Returns (stop event, identity, DHT)."""
    from swarmrl.node.swarm.dht import start_dht
    from swarmrl.protocol.identity import Identity

    setup_logging(role)
    set_threads(threads)
    stop = stop_event()
    identity = Identity.load_or_create(key)
    set_log_context(peer_id=identity.peer_id)
    dht = start_dht(net.initial_peers, host=net.host, port=net.dht_port)
    return stop, identity, dht


def write_ready(path: Path | None, info: dict) -> None:
    """Atomically write a JSON ready file (orchestrators wait for it)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)
