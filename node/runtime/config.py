"""Role configs: plain pydantic data, loadable from TOML with `key=value` overrides.

Each role (`bootstrap`, `trainer`, `worker`, `validator`) has one config class; its entrypoint
builds the heavy objects (DHT, gRPC server, models) from it. `--dry-run` prints the resolved
config as TOML-like JSON and exits.

Loading never imports torch, transformers or hivemind: a typo is refused in a fraction of a second.
Every problem with a file, an override or a value is one `ConfigError` line naming the field.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from swarmrl.node.runtime.limits import GrpcLimits, RateLimits
from swarmrl.protocol.delta_sources import MAX_PEER_ATTEMPTS, WAIT_RULE, waits_whole
from swarmrl.protocol.market import MAX_WEIGHT
from swarmrl.protocol.red_team_modes import MODES
from swarmrl.protocol.snapshot_sources import (
    KEEP_SNAPSHOTS,
    MAX_STREAMS,
    SNAPSHOT_RULE,
    TRAINER_SNAPSHOT_STREAMS,
    check_rule,
)

C = TypeVar("C", bound=BaseModel)

# Mirror of a table that lives beside torch (node.models.recipes.ALIASES), so a
# bad name is refused without importing torch; tests/unit/test_cli_errors.py checks they agree.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")   # node.inference.device.check_device_name, without torch
BASE_MODEL_NAMES = ("tiny", "google/gemma-3-270m", "gemma", "gemma-3-270m", "gemma3-270m",
                    "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2", "smollm2-135m")
RED_TEAM_MODES = MODES   # protocol/red_team_modes.py (no torch)


class ConfigError(ValueError):
    """A config file, an override or a value is wrong; the one-line message says which and why."""


def check_base_model_name(name: str) -> str:
    """`name` if it can name a base model: a built-in name or alias, an existing folder, or a
    hub id (`ORG/NAME`, looked up in the local cache when the model is loaded). Syntax only: the
    folder's files and the cache are checked by `node.models.base_model.find_base_model`.

    Raises:
        ValueError: none of those (the message lists the built-in names).
    """
    text = name.strip()
    if text in BASE_MODEL_NAMES or Path(text).expanduser().is_dir() or _HUB_ID.fullmatch(text):
        return name
    raise ValueError(f"unknown base model {name!r}: not a built-in ({', '.join(BASE_MODEL_NAMES)}), "
                     "not a model folder and not a hub id ORG/NAME")


def check_device(name: str) -> str:
    """`name` if it is a device setting ("auto", "cpu", "cuda", "cuda:N"); whether this machine
    has that GPU is checked when the model loads (`node.inference.device.resolve_device`).
    Raises ValueError otherwise."""
    if not _DEVICE.fullmatch(name.strip()):
        raise ValueError(f"device {name!r} is not 'auto', 'cpu', 'cuda' or 'cuda:N'")
    return name.strip()


def check_red_team_mode(mode: str) -> str:
    """`mode` if it is a known red-team mode. Raises ValueError otherwise."""
    if mode not in RED_TEAM_MODES:
        raise ValueError(f"unknown red-team mode {mode!r}; known: {', '.join(RED_TEAM_MODES)}")
    return mode


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NetConfig(_Config):
    """Where a node listens and whom it joins. Defaults bind to loopback only."""

    host: str = "127.0.0.1"
    dht_port: int = Field(0, ge=0, le=65535)
    initial_peers: list[str] = []
    # the public multiaddrs other peers should dial (e.g. /ip4/203.0.113.7/tcp/31337), when they
    # differ from where the node listens (a port forward, a container); they go into the node's
    # signed DHT records. Empty: the listen address is the announced one.
    announce_maddrs: list[str] = []
    # no inbound connections (behind NAT): the DHT runs in hivemind's client mode, and the node
    # never announces itself as a holder of deltas or data sets (nobody could dial it)
    client_mode: bool = False

    @field_validator("initial_peers")
    @classmethod
    def _multiaddrs(cls, peers: list[str]) -> list[str]:
        for p in peers:
            if not p.startswith("/") or "/p2p/" not in p or p.endswith("/p2p/"):
                raise ValueError(f"{p!r} is not a peer multiaddr like /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID "
                                 "(a bootstrap's ready file lists its own)")
        return peers

    @field_validator("announce_maddrs")
    @classmethod
    def _announce(cls, maddrs: list[str]) -> list[str]:
        for m in maddrs:
            parts = m.split("/")
            if len(parts) < 5 or parts[1] not in ("ip4", "ip6", "dns", "dns4", "dns6") or parts[3] != "tcp" \
                    or not parts[4].isdigit() or not 0 < int(parts[4]) < 65536:
                raise ValueError(f"{m!r} is not an announce multiaddr like /ip4/203.0.113.7/tcp/31337 "
                                 "(an explicit port: port 0 can't be announced)")
        return maddrs


class BootstrapConfig(_Config):
    """`swarmrl bootstrap`: a DHT peer that others join through (it runs no role)."""

    net: NetConfig = NetConfig()
    ready_file: Path | None = None   # where to write {"maddrs": [...]} once listening


class TrainerConfig(_Config):
    """`swarmrl trainer`: hosts jobs (leases, admission, GRPO steps) and serves them over gRPC.

    Sizes `*_mb` are MiB (2**20 bytes): a gRPC message, an admitted rollout batch; times `*_s` in seconds.
    """

    key: Path = Path("keys/trainer.key")
    state_dir: Path = Path("state/trainer")
    cache_dir: Path | None = None        # base models (default: $SWARMRL_CACHE or ~/.cache/swarmrl)
    base_models: list[str] = []          # model folders / hub ids to look in for a job's weights (by sha256)
    net: NetConfig = NetConfig()
    grpc_port: int = Field(0, ge=0, le=65535)
    grpc_host: str | None = None         # where gRPC listens (None: net.host)
    # HOST:PORT that workers should dial, put in the signed job record (None: grpc_host and the
    # bound port); set it behind a port forward or a container's published port
    grpc_announce: str | None = None
    # serve gRPC over TLS with a self-signed certificate kept in state_dir/tls; its sha256 goes
    # into the signed job record and workers pin it (node/net/tls.py). False: plaintext (loopback)
    tls: bool = False
    threads: int = Field(1, ge=1)
    # where the model runs: "auto" (the first CUDA GPU if any, else the CPU), "cpu", "cuda", "cuda:N"
    device: str = "auto"
    max_message_mb: int = Field(64, ge=1)
    max_batch_mb: int = Field(16, ge=1)
    trusted_validators: list[str] = []   # peer ids whose verdicts the trainer acts on
    # With trusted validators: a peer's groups wait up to this long for its first passing verdict
    # before they may be trained, and never past their last fresh step (probation for new peers;
    # 0 = off). See JobRuntime.trainable_cutoff. probation_last_chance = false: the hold is whole
    # (groups go stale on probation rather than be trained unchecked; docs/ARCHITECTURE.md).
    probation_s: float = Field(60.0, ge=0)
    probation_last_chance: bool = True
    allowed_submitters: list[str] | None = None   # None = anyone may submit jobs
    # the highest weight a job may ask (JobSpec.weight: its share when demand exceeds supply,
    # protocol/market.py); per submitter peer id in submitter_weight_caps, else max_job_weight.
    # A job above its cap is refused at submit time
    max_job_weight: float = Field(1.0, gt=0, le=MAX_WEIGHT)
    submitter_weight_caps: dict[str, Annotated[float, Field(gt=0, le=MAX_WEIGHT)]] = {}
    ready_file: Path | None = None
    # several trainers per job (swarm.job_swarm)
    prompt_shard: tuple[int, int] = (0, 1)   # (rank, count): hand out prompt indices rank + k*count
    cotrainers: list[str] | None = None      # peer ids allowed to co-train our jobs (None = any that announces one)
    averaging_matchmaking_s: float = Field(2.0, gt=0)   # how long a round waits for cotrainers to join
    averaging_timeout_s: float = Field(60.0, gt=0)      # an averaging round (or a state download) gives up after this
    fault: Literal["nan_gradients", "die_in_outer_round", "forged_outer_ticket"] | None = None   # fault drill (local tests only)
    # cooked credit books (local drills only; node/trainer/red_team.py, protocol.red_team_modes.TRAINER_MODES)
    red_team: Literal["omit_groups", "sybil_credit", "misstated_adapter"] | None = None
    # disk (node/trainer/retention.py): versions kept servable behind the job's staleness window
    # (floor = head - max_async_level - keep_versions; older deltas and snapshots are deleted), and
    # spare snapshots above that floor (periodic ones and those rebuilt on request)
    keep_versions: int = Field(8, ge=2)
    keep_snapshots: int = Field(3, ge=1)
    # snapshot streams served to workers at once (protocol/snapshot_sources.py); past it a worker's
    # snapshot request is refused RESOURCE_EXHAUSTED "snapshot_busy" and it asks peers again; 0: no bound
    max_snapshot_streams: int = Field(TRAINER_SNAPSHOT_STREAMS, ge=0)
    # ops HTTP (node/ops/http_server.py): /metrics, and on a trainer the job pages; None = off, 0 = any free port
    metrics_port: int | None = Field(None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    # gRPC server bounds (node/runtime/limits.py: streams in total / per peer / per address, stream
    # deadline and idle timeout) and per-peer / per-address rate limits (node/net/rate_limits.py)
    grpc_limits: GrpcLimits = GrpcLimits()
    rate_limits: RateLimits = RateLimits()
    # "full": an admitted group survives power loss; "normal": a process crash only, less CPU (Ledger)
    ledger_sync: Literal["full", "normal"] = "full"
    # a finished (trained or dropped) batch stays whole in the ledger this long, for validators'
    # SampleAdmitted; then its token payloads are cleared and its expired lease deleted (rows stay:
    # replay protection and counts). Ledger.compact
    ledger_keep_s: float = Field(3600.0, ge=0)

    @field_validator("device")
    @classmethod
    def _device(cls, name: str) -> str:
        return check_device(name)

    @field_validator("grpc_announce")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            host, sep, port = value.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{value!r} is not HOST:PORT with an explicit port")
        return value


class WorkerConfig(_Config):
    """`swarmrl worker`: leases prompts, generates, grades, signs and submits rollouts."""

    key: Path = Path("keys/worker.key")
    cache_dir: Path | None = None
    net: NetConfig = NetConfig()
    base_model: str = "tiny"             # the base model this worker serves
    # several base models (names, folders or cached hub ids): leases only for jobs on these exact
    # weights; empty = just base_model
    base_models: list[str] = []
    # installed environments (entry points, `swarmrl env list`) this worker runs; data-set jobs
    # need none (they run only built-in rewards)
    environments: list[str] = ["arithmetic", "calculator", "wordle"]   # swarmrl's built-ins
    backend: Literal["hf", "vllm"] = "hf"   # "hf" (transformers + peft) or "vllm" (node/inference/vllm.py)
    vllm_url: str | None = None          # backend "vllm": an operator's running vLLM server; None = start one
    threads: int = Field(1, ge=1)
    # where the hf backend's model runs (vLLM places its own): "auto" (the first CUDA GPU if any, else the CPU), "cpu", "cuda", "cuda:N"
    device: str = "auto"

    max_prompts: int = Field(4, ge=1)    # prompts asked per lease
    # backend "vllm": leases of up to this many jobs held at once, generated in one engine batch
    # (each job on its own adapter; 1 = one job a round); the hf backend runs one job a round
    jobs_per_round: int = Field(2, ge=1, le=16)
    max_message_mb: int = Field(64, ge=1)
    grade_timeout_s: float = Field(10.0, gt=0)
    poll_s: float = Field(1.0, gt=0)
    exit_when_done: bool = False         # stop once every job it knows is done
    # with exit_when_done: stop only once at least this many jobs are done (a swarm whose jobs
    # start at different times: a worker that saw one job end must not leave before the others)
    exit_after_jobs: int = Field(1, ge=1)
    red_team: str | None = None          # adversarial mode (local drills only)
    ready_file: Path | None = None
    # delta gossip (swarm.catchup / swarm.gossip)
    gossip: bool = True                  # fetch adapter updates from peers and serve them (False: trainer only)
    max_gap: int = Field(8, ge=1)        # versions behind past which one snapshot replaces the delta chain
    peer_wait_s: float = Field(1.0, ge=0)   # wait up to this long for a peer to hold a fresh delta
    max_peer_attempts: int = Field(MAX_PEER_ATTEMPTS, ge=0)   # peers asked per update, then the trainer (0: all)
    wait_rule: str = WAIT_RULE           # how long to wait for a peer to hold a fresh delta (delta_sources.WAIT_RULES)
    sync_poll_s: float = Field(0.5, gt=0)   # how often to look for a newer version to prefetch
    # prefetch a job's versions only while it was chosen within this long (0: every job with a
    # session until it ends); one chosen again catches up then (protocol.market.follows)
    follow_idle_s: float = Field(60.0, ge=0)
    keep_deltas: int = Field(16, ge=1)   # newest deltas kept (and served) per job
    keep_jobs: int = Field(8, ge=1)      # jobs whose updates are kept (those updated last; swarm.gossip.UpdateCache)
    # snapshots served to late joiners (protocol/snapshot_sources.py): "rebuilt" serves the head this
    # worker rebuilt, "received" only trainer-made snapshots it received (the rule before)
    snapshot_rule: str = SNAPSHOT_RULE
    keep_snapshots: int = Field(KEEP_SNAPSHOTS, ge=0)   # newest snapshot versions kept (and served) per job
    max_snapshot_streams: int = Field(MAX_STREAMS, ge=0)   # snapshots served at once; more are refused "busy"
    linger_s: float = Field(2.0, ge=0)   # with exit_when_done: keep serving this long after the last job
    prefer_trainer: str | None = None    # peer id of the trainer to follow when it serves the job
    # job records announcing a weight above this are ignored (protocol/demand.check_demand)
    max_job_weight: float = Field(MAX_WEIGHT, gt=0, le=MAX_WEIGHT)
    metrics_port: int | None = Field(None, ge=0, le=65535)   # /metrics; None = off, 0 = any free port
    metrics_host: str = "127.0.0.1"

    @field_validator("base_model")
    @classmethod
    def _known_model(cls, name: str) -> str:
        return check_base_model_name(name)

    @field_validator("device")
    @classmethod
    def _device(cls, name: str) -> str:
        return check_device(name)

    @field_validator("wait_rule")
    @classmethod
    def _wait_rule(cls, rule: str) -> str:
        waits_whole(rule)   # raises ValueError naming the known rules
        return rule

    @field_validator("snapshot_rule")
    @classmethod
    def _snapshot_rule(cls, rule: str) -> str:
        return check_rule(rule)   # raises ValueError naming the known rules

    @field_validator("red_team")
    @classmethod
    def _known_mode(cls, mode: str | None) -> str | None:
        return mode if mode is None else check_red_team_mode(mode)


class ValidatorConfig(_Config):
    """`swarmrl validator`: re-checks a sample of admitted rollouts and reports verdicts."""

    key: Path = Path("keys/validator.key")
    state_dir: Path = Path("state/validator")
    cache_dir: Path | None = None
    net: NetConfig = NetConfig()
    threads: int = Field(1, ge=1)
    # where the model runs: "auto" (the first CUDA GPU if any, else the CPU), "cpu", "cuda", "cuda:N"
    device: str = "auto"
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
    metrics_port: int | None = Field(None, ge=0, le=65535)   # /metrics; None = off, 0 = any free port
    metrics_host: str = "127.0.0.1"
    # audit mode (validator/audits.py): every audit_every_s seconds audit each job's credit books on
    # the windowed rule (audit_sample credited batches, 0 = all; every signed update of the window) and
    # publish the signed report in the DHT when audit_publish; 0 = off. audit_mirror: serve the
    # statement chains that verified peer to peer (validator/mirror.py)
    audit_every_s: float = Field(0.0, ge=0)
    audit_sample: int = Field(64, ge=0)
    audit_publish: bool = True
    audit_mirror: bool = True

    @field_validator("device")
    @classmethod
    def _device(cls, name: str) -> str:
        return check_device(name)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value); the value is parsed as JSON when it can be.

    Raises:
        ConfigError: not of the form key=value, or an empty key.
    """
    key, sep, raw = item.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(k.strip() for k in keys):
        raise ConfigError(f"override {item!r} is not of the form key=value (dotted keys, JSON values)")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return [k.strip() for k in keys], value


def set_dotted(data: dict[str, Any], keys: list[str], value: Any) -> None:
    """`data[k0][k1]... = value`, creating tables on the way.

    Raises:
        ConfigError: a key on the way already holds a value that is not a table.
    """
    node = data
    for i, k in enumerate(keys[:-1]):
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(keys[:i + 1])} is not a table, so {'.'.join(keys)} cannot be set")
    node[keys[-1]] = value


def read_toml(path: Path, what: str = "config file") -> dict[str, Any]:
    """The table in TOML file `path` (`what` names it in errors).

    Raises:
        ConfigError: the file is missing or unreadable, or a syntax error (with its line).
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(path)!r} not found") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {path}: TOML syntax error: {exc}") from None


def describe_validation_error(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """A pydantic error as one line that names each bad field (no documentation URLs).

    An unknown field gets the closest known names of `model` (when given) as suggestions.
    """
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(x) for x in err["loc"]) or "value"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown field {where!r}{_suggest(model, err['loc'])}")
        elif err["type"] == "missing":
            parts.append(f"missing field {where!r}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{where} = {err['input']!r}: {msg}")
    return "; ".join(" ".join(p.split()) for p in parts)


def _suggest(model: type[BaseModel] | None, loc: tuple[int | str, ...]) -> str:
    for key in loc[:-1]:
        field = model.model_fields.get(str(key)) if model is not None else None
        ann = field.annotation if field is not None else None
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    if model is None:
        return ""
    known = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), known, n=3)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else f" (known: {', '.join(known)})"


def load_config(cls: type[C], path: Path | None, overrides: list[str]) -> C:
    """Build `cls` from an optional TOML file, then dotted `key=value` overrides.

    Raises:
        ConfigError: missing or unreadable file, TOML syntax error, malformed override, unknown
            field or bad value (one line naming the field).
    """
    data: dict[str, Any] = read_toml(path) if path else {}
    for item in overrides:
        set_dotted(data, *parse_override(item))
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, cls)) from None


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as indented JSON (what --dry-run prints)."""
    return json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True)
