#!/usr/bin/env bash
# Build the Dockerfile's image without a Docker daemon (podman, vfs storage) and smoke-test it with
# no network: `swarmrl --help`, a worker `--dry-run`, a tiny `swarmrl up` inside (issue 28 item 8).
# The build alone uses the host's network, for its package installs; the runs use --network none.
#
#   bash scripts/container_check.sh            # BASE=python:3.11-slim unless BASE is set
#   SMOKE_ONLY=1 bash scripts/container_check.sh   # only the runs, on the image built before (no network
#                                                  # needed: tests/integration/test_container.py)
#
# Where the base image's registry is out of reach (this workplace reaches PyPI and Debian only),
# BASE=debootstrap makes a Debian bookworm base (python3, python3-venv) with debootstrap first.
# Where the machine's TLS is re-signed by a local authority, its CA bundle is mounted into the
# build (CA_CERT); a local wheel folder (WHEELS, e.g. the machine's torch wheel) likewise.
# Prints one line and exits 3 when podman can't build or run here.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${TAG:-localhost/swarmrl:check}
BASE=${BASE:-python:3.11-slim}
CA=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
WHEELS=${WHEELS:-/opt/wheels}
say() { echo "container_check: $*" >&2; }
command -v podman >/dev/null || { say "podman is not installed (apt-get install -y podman runc): not checked"; exit 3; }
# a sandbox without cgroup v2 delegation or raised rlimits: runc on cgroupfs, limits below the host's
pod=(podman --runtime "$(command -v runc || echo crun)" --storage-driver vfs --cgroup-manager cgroupfs)
lim=(--ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
if [ "$BASE" = debootstrap ]; then
  BASE=localhost/swarmrl-base:bookworm
  if ! "${pod[@]}" image exists "$BASE"; then
    root=$(mktemp -d); trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" \
      http://deb.debian.org/debian >/dev/null || { say "debootstrap failed: no base image"; exit 3; }
    chmod 755 "$root"   # mktemp -d makes it 0700, and the tarball's "." becomes the image's /: no user could enter it
    tar -C "$root" -c . | "${pod[@]}" import - "$BASE" >/dev/null
  fi
fi
if [ "${SMOKE_ONLY:-}" = 1 ]; then
  "${pod[@]}" image exists "$TAG" || { say "no image $TAG yet: build it with bash scripts/container_check.sh (needs the package registry)"; exit 3; }
else
args=(--build-arg "BASE=$BASE")
[ -d "$WHEELS" ] && args+=(--volume "$WHEELS:/wheels:ro" --build-arg WHEELS=/wheels --build-arg TORCH_INDEX=https://pypi.org/simple)
[ -f "$CA" ] && args+=(--volume "$CA:/host-ca.crt:ro" --build-arg CA_CERT=/host-ca.crt)
t0=$(date +%s)
"${pod[@]}" build -q --network host "${lim[@]}" "${args[@]}" -t "$TAG" . >/dev/null \
  || { say "the image did not build (podman build failed; rerun without -q to see why)"; exit 1; }
say "built $TAG in $(( $(date +%s) - t0 )) s"
fi
run=("${pod[@]}" run --rm --network none "${lim[@]}" --entrypoint swarmrl "$TAG")
"${run[@]}" --help >/dev/null || { say "swarmrl --help failed in the image"; exit 1; }
say "swarmrl --help: ok"
"${run[@]}" worker --dry-run -o base_model='"tiny"' >/dev/null || { say "worker --dry-run failed in the image"; exit 1; }
say "worker --dry-run: ok"
t0=$(date +%s)
"${run[@]}" up --model tiny --steps 2 --no-eval --out /tmp/up >/dev/null \
  || { say "swarmrl up --model tiny --steps 2 failed in the image (--network none)"; exit 1; }
say "swarmrl up --model tiny --steps 2 (--network none): ok in $(( $(date +%s) - t0 )) s"
