"""Real processes for DiLoCo tests on loopback: a bootstrap, trainers of one job and workers, each
started as `swarmrl <role>` with its own key, state folder and log (`LocalSwarm`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from swarmrl.node.local.processes import LocalSwarm
from swarmrl.protocol.identity import Identity


def wait_for(cond, timeout_s: float, what: str, log: Path | None = None) -> None:
    """Poll `cond` until it holds (`timeout_s`: a ceiling against a hang, not a speed bound); on
    timeout, fail with the tail of `log`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            tail = f"\n--- {log.name}\n{log.read_text()[-3000:]}" if log is not None and log.exists() else ""
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}{tail}")
        time.sleep(0.3)


class DilocoSwarm:
    """One job's processes under `work` (logs in `work/logs`); `stop_all` ends them."""

    def __init__(self, work: Path, model_cache: Path, names: list[str]) -> None:
        """names: the trainers' and workers' names (a key is made for each, and for "submitter")."""
        self.work, self.model_cache, self.procs = work, model_cache, LocalSwarm(work)
        self.keys = {n: Identity.generate() for n in (*names, "submitter")}
        for n, k in self.keys.items():
            k.save(work / "keys" / f"{n}.key")
        self.peers: list[str] = []

    def log(self, name: str) -> Path:
        """The log file of process `name`."""
        return self.work / "logs" / f"{name}.log"

    def start_bootstrap(self) -> None:
        """Start the DHT bootstrap peer and wait until it serves."""
        self.procs.start("bootstrap", "bootstrap", [f"ready_file={json.dumps(str(self.work / 'bootstrap.ready'))}"])
        self.peers = self.procs.wait_ready("bootstrap", self.work / "bootstrap.ready")["maddrs"]

    def start_trainer(self, name: str, shard: tuple[int, int], cotrainers: list[str], extra: list[str]) -> str:
        """Start trainer `name` (prompt shard (rank, of), its `cotrainers` ids, `extra` config
        lines); returns its gRPC endpoint once it is ready."""
        work, ready = self.work, self.work / f"{name}.ready"
        ready.unlink(missing_ok=True)
        self.procs.start(name, "trainer", [
            f"net.initial_peers={json.dumps(self.peers)}", f"cache_dir={json.dumps(str(self.model_cache))}",
            f"key={json.dumps(str(work / 'keys' / (name + '.key')))}", f"state_dir={json.dumps(str(work / name))}",
            f"ready_file={json.dumps(str(ready))}", f"prompt_shard={json.dumps(list(shard))}",
            f"cotrainers={json.dumps(cotrainers)}", "averaging_matchmaking_s=1.0", "averaging_timeout_s=10", *extra])
        return str(self.procs.wait_ready(name, ready, timeout_s=180)["endpoint"])

    def start_worker(self, name: str, prefer_trainer: str) -> None:
        """Start worker `name` on the tiny model, following trainer `prefer_trainer` (peer id)."""
        work = self.work
        self.procs.start(name, "worker", [
            f"net.initial_peers={json.dumps(self.peers)}", f"cache_dir={json.dumps(str(self.model_cache))}",
            f"key={json.dumps(str(work / 'keys' / (name + '.key')))}", "base_model=\"tiny\"",
            f"ready_file={json.dumps(str(work / (name + '.ready')))}", "sync_poll_s=0.3", "peer_wait_s=0.5",
            f"prefer_trainer={json.dumps(prefer_trainer)}"])

    def stop_all(self) -> None:
        """End every process started here."""
        self.procs.stop_all()
