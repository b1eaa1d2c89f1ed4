"""Data-set files by content address: a local cache, peers first, the trainer as fallback.

A data-set job names its file by sha256 (plus size and per-chunk hashes, `protocol.blobs`). A
worker or validator that needs it looks in its cache (`<cache>/datasets/<sha256>`, re-hashed on
read), then asks the peers that announce it in the DHT (the holders record of
"dataset:<sha256>", `swarm.holders`; served by `GossipNode.hold_dataset` over libp2p), in random
order, then the job's trainer (`FetchDataset`, through its client: gRPC or in process). Every
source's bytes are verified chunk by chunk: a sender of a bad chunk is refused, counted in
`DatasetFetchStats.refused` and not asked again. The verified file is cached and, with gossip on, served and announced in turn.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import random
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from swarmrl.node.net.trainer_client import DatasetFetcher
from swarmrl.node.swarm.gossip import GossipNode
from swarmrl.node.swarm.holders import find_holders
from swarmrl.protocol.blobs import BlobError, assemble_blob
from swarmrl.protocol.envs.dataset import DatasetTask
from swarmrl.protocol.pb import swarm_pb2 as pb

if TYPE_CHECKING:
    import hivemind

log = logging.getLogger(__name__)


class DatasetUnavailable(RuntimeError):
    """No source served the data set's exact bytes."""


@dataclass
class DatasetFetchStats:
    """Where data sets came from, and who sent bytes that did not verify."""

    sources: Counter[str] = field(default_factory=Counter)   # "cache" | "peer" | "trainer"
    refused: Counter[str] = field(default_factory=Counter)   # sender -> bad transfers


class DatasetStore:
    """Verified data-set files under `root`, named by sha256 (atomic writes, re-hashed on read)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, sha256_hex: str) -> Path:
        """Where the file with that content address is (or would be) cached."""
        return self.root / sha256_hex

    def get(self, sha256_hex: str) -> bytes | None:
        """The cached file, or None when absent or corrupt (a corrupt copy is removed)."""
        p = self.path(sha256_hex)
        try:
            data = p.read_bytes()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != sha256_hex:
            log.warning("cached data set %s is corrupt; removing it", sha256_hex[:12])
            p.unlink(missing_ok=True)
            return None
        return data

    def put(self, sha256_hex: str, data: bytes) -> Path:
        """Store verified bytes (raises ValueError if they are not `sha256_hex`)."""
        if hashlib.sha256(data).hexdigest() != sha256_hex:
            raise ValueError(f"refusing to cache bytes that are not {sha256_hex[:12]}")
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{sha256_hex[:12]}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, self.path(sha256_hex))
        return self.path(sha256_hex)


def fetch_dataset(task: DatasetTask, store: DatasetStore, *, trainer: DatasetFetcher | None,
                  gossip: GossipNode | None = None, dht: hivemind.DHT | None = None, stats: DatasetFetchStats | None = None,
                  trainer_name: str = "trainer") -> bytes:
    """The verified bytes of `task`'s file: cache, then announcing peers, then `trainer` (the
    job's trainer's client, `node.net.trainer_client.DatasetFetcher`; None: no trainer to ask).

    Raises:
        DatasetUnavailable: every source failed or sent bytes that did not verify.
    """
    stats = stats if stats is not None else DatasetFetchStats()
    sha = task.dataset_sha256
    data = store.get(sha)
    if data is not None:
        stats.sources["cache"] += 1
        return _serve(task, data, gossip)
    for holder_id, libp2p_id in _peers(sha, gossip, dht):
        assert gossip is not None   # _peers lists none without it
        data = _verified(functools.partial(gossip.fetch_dataset, libp2p_id, sha), task, holder_id, stats)
        if data is not None:
            stats.sources["peer"] += 1
            store.put(sha, data)
            return _serve(task, data, gossip)
    if trainer is not None:
        req = pb.UpdateRequest(job_id="dataset:" + sha, payload_sha256=bytes.fromhex(sha))
        data = _verified(lambda: trainer.fetch_dataset(req), task, trainer_name, stats)
        if data is not None:
            stats.sources["trainer"] += 1
            store.put(sha, data)
            return _serve(task, data, gossip)
    raise DatasetUnavailable(f"data set {task.dataset} ({sha[:12]}): no peer or trainer served its bytes"
                             + (f" (refused: {dict(stats.refused)})" if stats.refused else ""))


def _peers(sha: str, gossip: GossipNode | None, dht: hivemind.DHT | None) -> list[tuple[str, bytes]]:
    if gossip is None or dht is None:
        return []
    try:
        holders = find_holders(dht, "dataset:" + sha).get((0, False), [])
    except Exception as exc:  # noqa: BLE001 - the DHT can fail: fall back to the trainer
        log.warning("looking up holders of data set %s failed: %r", sha[:12], exc)
        return []
    out = [(h.holder_id, h.libp2p_peer_id) for h in holders
           if h.payload_sha256.hex() == sha and h.libp2p_peer_id != gossip.libp2p_peer_id]
    random.shuffle(out)
    return out


def _verified(get: Callable[[], Iterable[pb.AdapterChunk]], task: DatasetTask, sender: str,
              stats: DatasetFetchStats) -> bytes | None:
    try:
        return assemble_blob(get(), task.dataset_sha256, task.dataset_size, task.dataset_chunks)
    except BlobError as exc:
        stats.refused[sender] += 1
        log.warning("refused data set %s from %s: %s", task.dataset_sha256[:12], sender[:16], exc)
    except Exception as exc:  # noqa: BLE001 - a peer or the trainer failed: try the next source
        log.info("data set %s from %s failed: %r", task.dataset_sha256[:12], sender[:16], exc)
    return None


def _serve(task: DatasetTask, data: bytes, gossip: GossipNode | None) -> bytes:
    if gossip is not None and task.dataset_sha256 not in gossip.datasets:
        gossip.hold_dataset(task.dataset_sha256, data)
    return data
