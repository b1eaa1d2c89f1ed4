"""Role configs: plain pydantic data, loadable from TOML with `key=value` overrides.

Each role (`bootstrap`, `trainer`, `worker`, `validator`) has one config class; its entrypoint
builds the heavy objects (DHT, gRPC server, models) from it. `--dry-run` prints the resolved
config as TOML-like JSON and exits.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

C = TypeVar("C", bound=BaseModel)


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NetConfig(_Config):
    """Where a node listens and whom it joins. Defaults bind to loopback only."""

    host: str = "127.0.0.1"
    dht_port: int = Field(0, ge=0, le=65535)
    initial_peers: list[str] = []


class BootstrapConfig(_Config):
    net: NetConfig = NetConfig()
    ready_file: Path | None = None   # where to write {"maddrs": [...]} once listening


class TrainerConfig(_Config):
    key: Path = Path("keys/trainer.key")
    state_dir: Path = Path("state/trainer")
    cache_dir: Path | None = None        # base models (default: $SWARMRL_CACHE or ~/.cache/swarmrl)
    base_models: list[str] = []          # model folders / hub ids to look in for a job's weights (by sha256)
    net: NetConfig = NetConfig()
    grpc_port: int = Field(0, ge=0, le=65535)
    threads: int = Field(1, ge=1)
    max_message_mb: int = Field(64, ge=1)
    max_batch_mb: int = Field(16, ge=1)
    trusted_validators: list[str] = []   # peer ids whose verdicts the trainer acts on
    # With trusted validators: a peer's groups wait up to this long for its first passing verdict
    # before they may be trained (probation for new peers; 0 = off). See JobRuntime.trainable_cutoff.
    probation_s: float = Field(60.0, ge=0)
    allowed_submitters: list[str] | None = None   # None = anyone may submit jobs
    ready_file: Path | None = None
    # several trainers per job (swarm.job_swarm)
    prompt_shard: tuple[int, int] = (0, 1)   # (rank, count): hand out prompt indices rank + k*count
    cotrainers: list[str] | None = None      # peer ids allowed to co-train our jobs (None = any that announces one)
    averaging_matchmaking_s: float = Field(2.0, gt=0)   # how long a round waits for cotrainers to join
    averaging_timeout_s: float = Field(60.0, gt=0)      # an averaging round (or a state download) gives up after this
    fault: str | None = None                 # fault drill: "nan_gradients" (local tests only)


class WorkerConfig(_Config):
    key: Path = Path("keys/worker.key")
    cache_dir: Path | None = None
    net: NetConfig = NetConfig()
    base_model: str = "tiny"             # the base model this worker serves
    # several base models (names, folders or cached hub ids): leases only for jobs on these exact
    # weights; empty = just base_model
    base_models: list[str] = []
    # installed environments (entry points, `swarmrl env list`) this worker runs; data-set jobs
    # need none (they run only built-in rewards)
    environments: list[str] = ["arithmetic"]
    backend: str = "hf"                  # "hf" (transformers + peft) or "vllm"
    threads: int = Field(1, ge=1)
    max_prompts: int = Field(4, ge=1)    # prompts asked per lease
    max_message_mb: int = Field(64, ge=1)
    grade_timeout_s: float = Field(10.0, gt=0)
    poll_s: float = Field(1.0, gt=0)
    exit_when_done: bool = False         # stop once every job it knows is done
    red_team: str | None = None          # adversarial mode (local drills only)
    ready_file: Path | None = None
    # delta gossip (swarm.catchup / swarm.gossip)
    gossip: bool = True                  # fetch adapter updates from peers and serve them (False: trainer only)
    max_gap: int = Field(8, ge=1)        # versions behind past which one snapshot replaces the delta chain
    peer_wait_s: float = Field(1.0, ge=0)   # wait up to this long for a peer to hold a fresh delta
    sync_poll_s: float = Field(0.5, gt=0)   # how often to look for a newer version to prefetch
    keep_deltas: int = Field(16, ge=1)   # newest deltas kept (and served) per job
    linger_s: float = Field(2.0, ge=0)   # with exit_when_done: keep serving this long after the last job
    prefer_trainer: str | None = None    # peer id of the trainer to follow when it serves the job


class ValidatorConfig(_Config):
    key: Path = Path("keys/validator.key")
    state_dir: Path = Path("state/validator")
    cache_dir: Path | None = None
    net: NetConfig = NetConfig()
    threads: int = Field(1, ge=1)
    max_message_mb: int = Field(64, ge=1)
    base_models: list[str] = []          # model folders / hub ids served (a job's own name is tried first)
    sample_rate: float = Field(0.25, ge=0.0, le=1.0)
    poll_s: float = Field(1.0, gt=0)
    grade_timeout_s: float = Field(10.0, gt=0)
    # group-mean |claimed - recomputed| sampled-token log-prob, nats; None: the measured honest
    # floor of the model's dtype (checks.HONEST_MEAN_FLOOR: fp32 1e-3, bf16 0.15); a value below
    # the floor is raised to it
    logprob_tolerance: float | None = Field(None, gt=0)
    ready_file: Path | None = None


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value); the value is parsed as JSON when it can be."""
    if "=" not in item:
        raise ValueError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip().split("."), value


def load_config(cls: type[C], path: Path | None, overrides: list[str]) -> C:
    """Build `cls` from an optional TOML file, then dotted `key=value` overrides.

    Raises:
        ValueError / pydantic.ValidationError: unknown keys, bad values, unreadable TOML.
    """
    data: dict[str, Any] = tomllib.loads(path.read_text()) if path else {}
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return cls.model_validate(data)


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as indented JSON (what --dry-run prints)."""
    return json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True)
