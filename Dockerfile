# A swarmrl worker (or any role) as a container. The worker's identity (its Ed25519 key), base
# model cache and data sets live on the /data volume, so a restarted or replaced container is the
# same peer. docs/ACROSS_MACHINES.md says how to run it (docker run, systemd).
#
#   docker build -t swarmrl .
#   docker run -d --restart unless-stopped --name swarmrl-worker -v swarmrl-data:/data swarmrl \
#       --initial-peers /ip4/BOOTSTRAP_IP/tcp/PORT/p2p/PEER_ID -o net.client_mode=true
#
# TORCH_INDEX: where pip finds torch 2.13.0. The default, PyTorch's CPU index, keeps the image
# small; pass --build-arg TORCH_INDEX=https://pypi.org/simple for the CUDA build on a GPU host.
# BASE: any image with Python 3.11 and its venv module (python:3.11-slim by default; Debian
# bookworm's python3 + python3-venv too: scripts/container_check.sh builds on one made by debootstrap).
# WHEELS: a folder of wheels mounted into the build (e.g. a local torch wheel), if any; CA_CERT: a CA
# bundle mounted into the build, for a network whose TLS is re-signed by a local authority.
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WHEELS=
ARG CA_CERT=
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 SWARMRL_CACHE=/data/cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    PATH=/opt/venv/bin:$PATH

# gcc (and Python's headers where the base lacks them): reasoning-gym's pycosat builds from its sdist
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && { [ -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] \
         || apt-get install -y --no-install-recommends python3-dev; } \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 swarmrl && mkdir -p /data /app && chown swarmrl /data
WORKDIR /app
COPY pyproject.toml README.md ./
COPY swarmrl ./swarmrl
COPY node ./node
COPY protocol ./protocol
COPY validator ./validator
COPY simulations ./simulations
RUN python3 -m venv /opt/venv \
    && { [ -z "$CA_CERT" ] || export PIP_CERT="$CA_CERT"; } && { [ -z "$WHEELS" ] || export PIP_FIND_LINKS="$WHEELS"; } \
    && pip install --extra-index-url "$TORCH_INDEX" . \
    && cd / && rm -rf /app
# the sources are gone once installed: a `swarmrl` folder in the working directory would shadow
# the installed package for `python -m swarmrl...` (how `swarmrl up` starts its roles)
WORKDIR /data

USER swarmrl
VOLUME /data
# the worker runs no server: it dials out (DHT client mode works behind NAT); a worker that
# serves deltas to peers listens on the DHT port given with -o net.dht_port=... (publish it)
ENTRYPOINT ["swarmrl", "worker", "-o", "key=/data/keys/worker.key", "-o", "cache_dir=/data/cache", \
            "-o", "net.host=0.0.0.0"]
CMD []
