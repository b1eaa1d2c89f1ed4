"""A worker as a service (issue 11 item 9): the Docker image builds and answers (where a Docker
daemon runs; with podman where it is installed and the image was built), and a worker killed
mid-flight restarts as the same peer with nothing to resend."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from swarmrl.protocol.identity import Identity

ROOT = Path(__file__).resolve().parents[2]


def _docker_reason() -> str | None:
    if shutil.which("docker") is None:
        return "docker is not installed"
    probe = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30, check=False)
    return None if probe.returncode == 0 else "no Docker daemon is running here"


@pytest.mark.slow
def test_docker_image_builds_and_resolves_the_worker_config() -> None:
    reason = _docker_reason()
    if reason is not None:
        pytest.skip(reason)
    tag = "swarmrl-worker-test"
    subprocess.run(["docker", "build", "-t", tag, str(ROOT)], check=True, timeout=3600)
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", tag, "--dry-run", "-o", "net.client_mode=true"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    assert '"client_mode": true' in out and '"/data/keys/worker.key"' in out


@pytest.mark.slow
def test_the_podman_image_runs_with_no_network() -> None:
    """Issue 28 item 8, where podman runs (no daemon needed): the image `scripts/container_check.sh`
    built (it needs the package registry, so the build is that script's, outside the tests'
    private network namespace) answers --help and a worker --dry-run, and runs a tiny
    `swarmrl up` inside, all with --network none."""
    if shutil.which("podman") is None or shutil.which("runc") is None:
        pytest.skip("podman and runc are not installed (apt-get install -y podman runc)")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "container_check.sh")], env={**os.environ, "SMOKE_ONLY": "1"},
                          capture_output=True, text=True, timeout=900, check=False)
    if done.returncode == 3:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr[-3000:]
    for line in ("swarmrl --help: ok", "worker --dry-run: ok", "swarmrl up --model tiny --steps 2 (--network none): ok"):
        assert line in done.stderr, done.stderr


_HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from swarmrl.node.runtime.lifecycle import lock_key
    from swarmrl.protocol.identity import Identity
    key = Path(sys.argv[1])
    lock_key(key)
    print(Identity.load_or_create(key).peer_id, flush=True)
    time.sleep(600)
""")


def test_a_killed_worker_restarts_as_the_same_peer(tmp_path: Path) -> None:
    """SIGKILL leaves no lock behind (the kernel drops it with the process), the key file is the
    identity, and while one copy runs a second is refused (one key, one peer)."""
    key = tmp_path / "keys" / "worker.key"
    first = subprocess.Popen([sys.executable, "-c", _HOLDER, str(key)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None
        peer_id = first.stdout.readline().strip()
        second = subprocess.run([sys.executable, "-c", _HOLDER, str(key)], capture_output=True, text=True,
                                timeout=60, check=False)
        assert second.returncode != 0 and "in use by another process" in second.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    t0 = time.monotonic()
    again = subprocess.run([sys.executable, "-c", _HOLDER.replace("time.sleep(600)", ""), str(key)],
                           capture_output=True, text=True, timeout=60, check=True)
    assert again.stdout.strip() == peer_id == Identity.load_or_create(key).peer_id
    assert time.monotonic() - t0 < 30
