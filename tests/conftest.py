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


VF_GUESS = Path(__file__).resolve().parent / "fixtures" / "vf_guess"


@pytest.fixture(scope="session")
def vf_guess_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/fixtures/vf_guess (a verifiers MultiTurnEnv package) pip-installed into a folder that
    is put first on sys.path and PYTHONPATH (so child processes find its entry point too);
    skips when the `verifiers` package is not installed (the `swarmrl[verifiers]` extra)."""
    import importlib.util
    import shutil
    import subprocess
    import sys

    if importlib.util.find_spec("verifiers") is None:
        pytest.skip("the verifiers package is not installed (pip install 'swarmrl[verifiers]')")
    src, site = tmp_path_factory.mktemp("vf_guess_src") / "vf_guess", tmp_path_factory.mktemp("vf_guess_site")
    shutil.copytree(VF_GUESS, src)   # the build leaves build/ and egg-info beside the sources
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(src)], check=True, capture_output=True, timeout=300)
    sys.path.insert(0, str(site))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), old) if p)
    yield site
    sys.path.remove(str(site))
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old
