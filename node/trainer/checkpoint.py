"""Atomic trainer checkpoints: adapter tensors, optimizer state (and a DiLoCo job's outer
state: outer parameters and momentum) and the step they belong to.

A checkpoint is a folder `step-{N}` written under a temporary name, fsynced and renamed; the
`LATEST` file naming it is replaced atomically afterwards. A crash at any point leaves the
previous checkpoint readable. Adapter versions published after the checkpoint are recovered by
replaying their (exact) deltas from the adapter store, so a restart never loses a version (the
store keeps at least the last two deltas: `retention.py`). While a job runs the newest `KEEP`
checkpoints stay; once it is done, only the last (`prune_checkpoints(root, 1)`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from swarmrl.node.models.base_model import fsync_path
from swarmrl.node.trainer.adapter_store import write_atomic
from swarmrl.protocol import adapter as ad

KEEP = 2


@dataclass
class Checkpoint:
    """What a trainer needs to resume one job."""

    step: int
    state: ad.State
    optimizer: dict[str, Any]   # torch.optim.Optimizer.state_dict()
    outer: dict[str, Any] | None = None   # a DiLoCo job's outer state (`outer.OuterOptimizer.state_dict`)


def save_checkpoint(root: Path, ckpt: Checkpoint) -> Path:
    """Write `ckpt` atomically under `root`; keeps the newest `KEEP` checkpoints."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{ckpt.step}"
    tmp = root / f".tmp-step-{ckpt.step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(ckpt.state, str(tmp / "adapter.safetensors"))
    torch.save(ckpt.optimizer, tmp / "optimizer.pt")
    if ckpt.outer is not None:
        torch.save(ckpt.outer, tmp / "outer.pt")
    meta = {"step": ckpt.step, "adapter_hash": ad.adapter_hash(ckpt.state).hex()}
    (tmp / "meta.json").write_text(json.dumps(meta))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_path(root)
    write_atomic(root / "LATEST", final.name.encode())
    prune_checkpoints(root, KEEP)
    return final


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` (>= 1) checkpoints under `root`."""
    assert keep >= 1
    for old in sorted(root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(root: Path) -> Checkpoint | None:
    """The checkpoint `LATEST` names, or None when there is none.

    Raises:
        ValueError: the checkpoint's adapter does not match the hash recorded with it.
    """
    latest = root / "LATEST"
    if not latest.exists():
        return None
    folder = root / latest.read_text().strip()
    meta = json.loads((folder / "meta.json").read_text())
    state = {k: v.float() for k, v in load_file(str(folder / "adapter.safetensors")).items()}
    if ad.adapter_hash(state).hex() != meta["adapter_hash"]:
        raise ValueError(f"checkpoint {folder} is corrupt: adapter hash mismatch")
    optimizer = torch.load(folder / "optimizer.pt", weights_only=False)
    outer = torch.load(folder / "outer.pt", weights_only=False) if (folder / "outer.pt").exists() else None
    return Checkpoint(step=int(meta["step"]), state=state, optimizer=optimizer, outer=outer)
