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
# Every run ends with the 25 slowest tests (--durations), to see where the suite's time goes.
# The dashboard's browser test drives Debian's Chromium through Playwright: install it quietly
# where we may (root + apt); never fail the suite if we can't (the test then skips, saying why).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }; } \
    >/dev/null 2>&1 || echo "run_tests.sh: could not install chromium; the browser test will skip" >&2
fi
# The network-namespace test bed (node/local/netns.py, tests/integration/test_netns_bed.py) needs nft
# (NAT) and ethtool (offloads off for its user-space slow link): install them the same way.
for pkg in nftables:nft ethtool:ethtool; do
  if ! command -v "${pkg#*:}" >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkg%%:*}" \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkg%%:*}"; }; } \
      >/dev/null 2>&1 || echo "run_tests.sh: could not install ${pkg%%:*}; the netns test bed will skip" >&2
  fi
done
# Two test processes side by side (pytest-xdist; a test file stays on one process): most tests wait
# on processes they started, so two at a time share 2 cores better than one does. The keepalive
# soak is started once per run whichever process collects it (tests/conftest.py).
# SWARMRL_TEST_PROCS=0 runs everything in one process.
par=(-q --durations=25)
if [ "${SWARMRL_TEST_PROCS:-2}" != 0 ]; then par+=(-n "${SWARMRL_TEST_PROCS:-2}" --dist loadfile); fi
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null \
   && unshare -n true 2>/dev/null; then
  # vLLM's environment (.venv-vllm, 3.4 GB) is made only when a selected test needs it (marker
  # needs_vllm): a collection pass counts them, and the install runs here, where the registry is
  # reachable; inside the namespace those tests skip, saying why, if it could not be made.
  if [ "${SWARMRL_VLLM_ENV:-}" != skip ] && ! compgen -G '.venv-vllm/lib/python*/site-packages/vllm/__init__.py' >/dev/null; then
    need=$(mktemp)
    SWARMRL_VLLM_NEED_FILE=$need "$py" -m pytest -q --collect-only -p no:cacheprovider "$@" >/dev/null 2>&1 || true
    if [ "$(cat "$need" 2>/dev/null || echo 0)" -gt 0 ]; then
      echo "run_tests.sh: $(cat "$need") selected tests need vLLM: making .venv-vllm (~2 min, once)" >&2
      PYTHON=${PYTHON:-python3} bash scripts/vllm_env.sh \
        || echo "run_tests.sh: vLLM's environment could not be made; its tests will skip" >&2
    fi
    rm -f "$need"
  fi
  export SWARMRL_TEST_NETNS=private
  exec unshare -n sh -c 'ip link set lo up && exec "$@"' sh "$py" -m pytest "${par[@]}" "$@"
fi
exec "$py" -m pytest "${par[@]}" "$@"
