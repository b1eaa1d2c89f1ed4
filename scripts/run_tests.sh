#!/usr/bin/env bash
# Run the static checks (scripts/check.sh: ruff, mypy, import contracts), then the test suite.
# Where we may (root + unshare), tests run in a private network namespace with only loopback up,
# so no test can send a packet anywhere else.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
bash scripts/check.sh
export SWARMRL_CACHE=${SWARMRL_CACHE:-$PWD/.cache/swarmrl}
# Everything by default, the red-team drill included (~2 min); for a quick loop skip it with
# make test ARGS='-m "not slow"'.
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null \
   && unshare -n true 2>/dev/null; then
  exec unshare -n sh -c 'ip link set lo up && exec "$@"' sh "$py" -m pytest -q "$@"
fi
exec "$py" -m pytest -q "$@"
