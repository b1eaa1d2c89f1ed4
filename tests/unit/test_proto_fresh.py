"""The committed generated wire modules equal a fresh generation from proto/ (pinned grpcio-tools)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True,
                   env={"PYTHON": sys.executable, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
                   capture_output=True)
    committed = ROOT / "protocol" / "pb"
    for name in ("swarm_pb2.py", "swarm_pb2_grpc.py", "swarm_pb2.pyi"):
        assert (tmp_path / name).read_text() == (committed / name).read_text(), (
            f"{name} is stale: run scripts/gen_proto.sh")
