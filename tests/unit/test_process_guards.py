"""One key, one port, one process: the key lock and our gRPC servers refuse what is taken; a
process's descendants are found and ended, orphans included."""

from __future__ import annotations

import subprocess
import sys

import pytest

from swarmrl.node.runtime.lifecycle import StartupError, lock_key
from swarmrl.node.trainer.service import serve


def test_a_taken_grpc_port_is_refused_not_shared():
    first, port = serve(None, "127.0.0.1", 0, max_message_mb=4)
    try:
        with pytest.raises(StartupError, match=f"127.0.0.1:{port}"):
            serve(None, "127.0.0.1", port, max_message_mb=4)
    finally:
        first.stop(grace=None).wait()
    again, same = serve(None, "127.0.0.1", port, max_message_mb=4)   # free again once the first stops
    again.stop(grace=None).wait()
    assert same == port


HOLD_KEY = """
import sys, time
from pathlib import Path
from swarmrl.node.runtime.lifecycle import lock_key
lock_key(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(60)
"""


def test_a_key_held_by_another_process_is_refused(tmp_path):
    key = tmp_path / "worker.key"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_KEY, str(key)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StartupError, match=f"in use by another process \\(pid {holder.pid}\\)"):
            lock_key(key)
    finally:
        holder.kill()
        holder.wait()
    lock_key(key)   # the lock dies with its process


ADOPT_AND_END = """
import subprocess, sys, time
from swarmrl.node.runtime import procs
assert procs.become_subreaper()
subprocess.Popen(["sh", "-c", "sleep 60 & exec sleep 61"])   # sleep 60's parent is replaced: an orphan
subprocess.run(["sh", "-c", "sleep 62 &"])                     # sh exits at once: sleep 62 is adopted
deadline = time.monotonic() + 5
while len(procs.descendants()) < 3 and time.monotonic() < deadline:
    time.sleep(0.02)
tree = procs.descendants()
procs.end_descendants(grace_s=1.0)
print(len(tree), sum(procs.alive(p) for p in tree))
"""


def test_end_descendants_ends_children_and_adopted_orphans():
    out = subprocess.run([sys.executable, "-c", ADOPT_AND_END], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 0, out.stderr
    found, alive = map(int, out.stdout.split())
    assert (found, alive) == (3, 0)
