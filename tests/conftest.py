"""Shared fixtures: a tiny base model in a per-run cache, and hivemind socket cleanup."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # 2 shared cores: oversubscribed torch threads crawl

import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_cache() -> Path:
    """The cache folder holding the prepared tiny model (built once per cache)."""
    from swarmrl.node.models import default_cache_dir, prepare_base_model

    cache = default_cache_dir()
    prepare_base_model("tiny", cache)
    return cache


@pytest.fixture(autouse=True, scope="session")
def _clean_hivemind_sockets():
    before = set(glob.glob("/tmp/hivemind-p2pclient-*.sock"))
    yield
    for path in set(glob.glob("/tmp/hivemind-p2pclient-*.sock")) - before:
        try:
            os.unlink(path)
        except OSError:
            pass
