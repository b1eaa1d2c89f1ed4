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
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 SWARMRL_CACHE=/data/cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

RUN useradd --create-home --uid 10001 swarmrl && mkdir -p /data /app && chown swarmrl /data
WORKDIR /app
COPY pyproject.toml README.md ./
COPY swarmrl ./swarmrl
COPY node ./node
COPY protocol ./protocol
COPY validator ./validator
COPY simulations ./simulations
RUN pip install --extra-index-url "$TORCH_INDEX" .

USER swarmrl
VOLUME /data
# the worker runs no server: it dials out (DHT client mode works behind NAT); a worker that
# serves deltas to peers listens on the DHT port given with -o net.dht_port=... (publish it)
ENTRYPOINT ["swarmrl", "worker", "-o", "key=/data/keys/worker.key", "-o", "cache_dir=/data/cache", \
            "-o", "net.host=0.0.0.0"]
CMD []
