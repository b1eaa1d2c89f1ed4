"""The bootstrap peer: a DHT node with a stable address that others join through."""

from __future__ import annotations

import logging

from swarmrl.node.runtime.config import BootstrapConfig
from swarmrl.node.runtime.lifecycle import setup_logging, stop_event, write_ready
from swarmrl.node.runtime.preflight import preflight
from swarmrl.node.swarm.dht import join_swarm, visible_maddrs

log = logging.getLogger(__name__)


def run(cfg: BootstrapConfig) -> None:
    """Serve the DHT until SIGTERM; prints (and writes to ready_file) the multiaddrs to join."""
    preflight(cfg)   # what --dry-run checks: its DHT port
    stop = stop_event()
    setup_logging("bootstrap")
    dht = join_swarm(cfg.net)
    maddrs = visible_maddrs(dht)
    write_ready(cfg.ready_file, {"maddrs": maddrs})
    for m in maddrs:
        print(f"bootstrap peer: --initial-peers {m}", flush=True)
    try:
        stop.wait()
    finally:
        dht.shutdown()
