"""Which environments and base models each worker serves: signed, expiring `WorkerEnvs` records.

A worker announces the installed environments it runs (its config's `environments` that are
installed here: name, version, package hash, exactly as `swarmrl env list` shows them) and the
sha256 of the base-model weights it holds, in one record under `swarmrl/v1/workers/envs`,
subkey = its Ed25519 peer id, signed with its key (domain "worker-envs"). Records expire after
`RECORD_TTL_S`; workers refresh them every `REFRESH_S` (as job and holder records). Readers
verify every record and drop the ones that fail.

`serving` answers, for one job, how many announcing workers can serve it and, when none can,
why: the trainer puts both in `JobStatus` (`swarmrl status`). A worker serves a job when it holds
the job's base model and, for an installed environment, announces the job's name and version and,
when the job pins one, its package hash. Data-set jobs run built-in rewards only: every worker
with the base model serves them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import hivemind
from hivemind.utils import get_dht_time

from swarmrl.node.swarm.dht import RECORD_TTL_S, REFRESH_S, signed_entries
from swarmrl.protocol import signing
from swarmrl.protocol.envs import InstalledEnv, installed_environments
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

log = logging.getLogger(__name__)

WORKER_ENVS_KEY = "swarmrl/v1/workers/envs"


def env_infos(names: Sequence[str], installed: Sequence[InstalledEnv] | None = None) -> list[pb.EnvInfo]:
    """The `EnvInfo` of every environment in `names` that is installed here (newest version of
    each name when several are); names that are not installed are logged and left out."""
    installed = installed_environments() if installed is None else installed
    out = []
    for name in names:
        found = [e for e in installed if e.name == name]
        if not found:
            log.warning("environment %r is in this worker's config but not installed: not announced", name)
            continue
        for e in found:
            out.append(pb.EnvInfo(name=e.name, version=e.version, package=e.package, package_sha256=e.package_sha256))
    return out


def announce_worker_envs(dht: hivemind.DHT, identity: Identity, environments: Sequence[pb.EnvInfo],
                         base_model_sha256: Sequence[str], now_ms: int) -> bool:
    """Sign and store (or refresh) this worker's record; returns whether the store succeeded."""
    record = pb.WorkerEnvs(worker_id=identity.peer_id, environments=list(environments),
                           base_model_sha256=list(base_model_sha256), updated_ms=now_ms)
    envelope = signing.sign(identity, signing.WORKER_ENVS, record)
    return bool(dht.store(WORKER_ENVS_KEY, envelope.SerializeToString(),
                          expiration_time=get_dht_time() + RECORD_TTL_S, subkey=identity.peer_id))


def find_worker_envs(dht: hivemind.DHT) -> list[pb.WorkerEnvs]:
    """Every live worker record whose signature verifies and whose signer is its worker id."""
    out = []
    for subkey, record, signer, _ in signed_entries(dht, WORKER_ENVS_KEY, signing.WORKER_ENVS, pb.WorkerEnvs,
                                                    "worker-envs record"):
        if record.worker_id != signer or subkey != signer:
            log.debug("dropping worker-envs record %s: signer %s does not match", subkey, signer)
            continue
        out.append(record)
    return out


class EnvAnnouncer:
    """Keeps one worker's record in the DHT: `refresh` stores it when it is due (every REFRESH_S).

    The clock is injected (monotonic seconds) so tests never sleep.
    """

    def __init__(self, dht: hivemind.DHT, identity: Identity, environments: Sequence[pb.EnvInfo],
                 base_model_sha256: Sequence[str], clock: Callable[[], float] = time.monotonic) -> None:
        self.dht, self.identity, self.clock = dht, identity, clock
        self.environments, self.base_models = list(environments), list(base_model_sha256)
        self._last = -float("inf")
        self._lock = threading.Lock()

    def refresh(self, force: bool = False) -> bool:
        """Store the record if it is due (or `force`); returns whether a store happened and succeeded.
        A DHT failure is logged; the next call retries."""
        with self._lock:
            if not force and self.clock() - self._last < REFRESH_S:
                return False
            try:
                ok = announce_worker_envs(self.dht, self.identity, self.environments, self.base_models,
                                          int(time.time() * 1000))
            except Exception as exc:  # noqa: BLE001 - the DHT can fail; the next refresh retries
                log.warning("announcing this worker's environments failed: %r", exc)
                return False
            if ok:
                self._last = self.clock()
            return ok


def _env_label(e: pb.EnvInfo) -> str:
    return f"{e.name} {e.version}" + (f" (package sha {e.package_sha256[:8]}…)" if e.package_sha256 else "")


def env_matches(spec: JobSpec, e: pb.EnvInfo | InstalledEnv) -> bool:
    """Whether environment `e` is the job's installed environment: same name and version and, when
    the job pins `env_package_sha256`, the same package hash."""
    return (e.name == spec.environment and e.version == spec.env_version
            and (not spec.env_package_sha256 or e.package_sha256 == spec.env_package_sha256))


def serves(spec: JobSpec, record: pb.WorkerEnvs) -> bool:
    """Whether the announcing worker can serve the job (base model held; environment matches, or a
    job that carries its task: a data set or reasoning-gym tasks)."""
    if spec.base_model_sha256 not in record.base_model_sha256:
        return False
    return spec.carries_task or any(env_matches(spec, e) for e in record.environments)


@dataclass(frozen=True)
class Serving:
    """How many announcing workers can serve a job, and why none can ("" when some can)."""

    workers: int
    reason: str


def serving(spec: JobSpec, records: Sequence[pb.WorkerEnvs]) -> Serving:
    """Count the workers in `records` that serve `spec`; when none does, say what they announce
    instead, e.g. "no worker announces environment foo 2 (package sha ab12cd34…); 3 workers
    announce: arithmetic 1"."""
    n = sum(serves(spec, r) for r in records)
    if n:
        return Serving(n, "")
    if not records:
        return Serving(0, "no worker announces its environments in the DHT")
    want = (f"environment {spec.environment} {spec.env_version}"
            + (f" (package sha {spec.env_package_sha256[:8]}…)" if spec.env_package_sha256 else "")
            if not spec.carries_task else f"task {spec.environment_id}")
    with_env = [r for r in records if spec.carries_task or any(env_matches(spec, e) for e in r.environments)]
    if with_env:
        return Serving(0, f"{len(with_env)} worker(s) announce {want} but none holds base model "
                          f"{spec.base_model} (sha {spec.base_model_sha256[:8]}…)")
    offered = sorted({_env_label(e) for r in records for e in r.environments})
    return Serving(0, f"no worker announces {want}; {len(records)} worker(s) announce: "
                      + (", ".join(offered) or "no environments"))


_CACHE: dict[int, tuple[float, list[pb.WorkerEnvs]]] = {}
_CACHE_LOCK = threading.Lock()


def cached_worker_envs(dht: hivemind.DHT, max_age_s: float = 5.0,
                       clock: Callable[[], float] = time.monotonic) -> list[pb.WorkerEnvs]:
    """`find_worker_envs`, read at most every `max_age_s` per DHT node (status requests are cheap)."""
    with _CACHE_LOCK:
        hit = _CACHE.get(id(dht))
        if hit is not None and clock() - hit[0] < max_age_s:
            return hit[1]
    records = find_worker_envs(dht)
    with _CACHE_LOCK:
        _CACHE[id(dht)] = (clock(), records)
    return records


def package_mismatch(spec: JobSpec, installed: Sequence[InstalledEnv]) -> str:
    """Why the installed copy of the job's environment is not the one the job pins ("" when it is,
    when the job pins no package hash, or for a data-set job)."""
    if spec.carries_task or not spec.env_package_sha256:
        return ""
    same = [e for e in installed if e.name == spec.environment and e.version == spec.env_version]
    if any(env_matches(spec, e) for e in same):
        return ""
    here = ", ".join(e.package_sha256[:12] or "none" for e in same) or "not installed"
    return (f"environment {spec.environment} {spec.env_version}: the job pins package sha "
            f"{spec.env_package_sha256[:12]}…, installed here: {here}")
