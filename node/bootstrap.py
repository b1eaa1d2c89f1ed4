"""The bootstrap peer: a DHT node with a stable address that others join through."""

from __future__ import annotations

import logging

from swarmrl.node.config import BootstrapConfig
from swarmrl.node.runtime import setup_logging, stop_event, write_ready
from swarmrl.node.swarm.dht import start_dht, visible_maddrs

log = logging.getLogger(__name__)


def run(cfg: BootstrapConfig) -> None:
    """Serve the DHT until SIGTERM; prints (and writes to ready_file) the multiaddrs to join."""
    setup_logging("bootstrap")
    stop = stop_event()
    dht = start_dht(cfg.net.initial_peers, host=cfg.net.host, port=cfg.net.dht_port)
    maddrs = visible_maddrs(dht)
    write_ready(cfg.ready_file, {"maddrs": maddrs})
    for m in maddrs:
        print(f"bootstrap peer: --initial-peers {m}", flush=True)
    try:
        stop.wait()
    finally:
        dht.shutdown()
