#!/usr/bin/env bash
# Regenerate protocol/pb/ from proto/ with the pinned grpcio-tools (the only way to
# change generated code). tests/unit/test_proto_fresh.py fails when the committed files differ.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/protocol/pb}
py=$root/.venv/bin/python  # the venv's, whatever PYTHON says (make passes PYTHON=python3 to make the venv)
mkdir -p "$out"
PATH="$(dirname "$py"):$PATH" "$py" -m grpc_tools.protoc -I "$root/proto" \
  --python_out="$out" --grpc_python_out="$out" --mypy_out="$out" \
  "$root/proto/swarmrl/v1/swarm.proto"
# protoc mirrors the proto package path; flatten it into pb/ and make imports package-relative.
mv "$out/swarmrl/v1/"* "$out/"
rm -rf "$out/swarmrl"
sed -i 's/^from swarmrl\.v1 import swarm_pb2/from swarmrl.protocol.pb import swarm_pb2/' "$out/swarm_pb2_grpc.py"
touch "$out/__init__.py"
