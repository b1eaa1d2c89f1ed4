"""Which workers serve a job (`node.swarm.env_records`): the matching rule on hand-built records,
the package-hash lease rule, and forged or stale records dropped by an in-memory DHT."""

from __future__ import annotations

from typing import Any

from swarmrl.node.swarm.env_records import (
    WORKER_ENVS_KEY,
    EnvAnnouncer,
    announce_worker_envs,
    env_infos,
    find_worker_envs,
    package_mismatch,
    serving,
)
from swarmrl.protocol import signing
from swarmrl.protocol.envs import InstalledEnv
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

MODEL = "aa" * 32
PKG = "ab12" * 16


def _spec(**kw: Any) -> JobSpec:
    return JobSpec(base_model="tiny", base_model_sha256=MODEL, **kw)


def _worker(*envs: tuple[str, str, str], models: tuple[str, ...] = (MODEL,)) -> pb.WorkerEnvs:
    return pb.WorkerEnvs(worker_id="w", base_model_sha256=list(models),
                         environments=[pb.EnvInfo(name=n, version=v, package_sha256=h) for n, v, h in envs])


ARITH = ("arithmetic", "1", "")


def test_a_job_nobody_announces_says_what_is_announced() -> None:
    spec = _spec(environment="foo", env_version="2", env_package_sha256=PKG)
    found = serving(spec, [_worker(ARITH)] * 3)
    assert found.workers == 0
    assert found.reason == "no worker announces environment foo 2 (package sha ab12ab12…); 3 worker(s) announce: arithmetic 1"


def test_version_and_pinned_hash_must_match() -> None:
    spec = _spec(environment="foo", env_version="2", env_package_sha256=PKG)
    assert serving(spec, [_worker(("foo", "2", PKG)), _worker(ARITH)]).workers == 1
    assert serving(spec, [_worker(("foo", "3", PKG))]).workers == 0
    assert serving(spec, [_worker(("foo", "2", "cd" * 32))]).workers == 0
    unpinned = _spec(environment="foo", env_version="2")
    assert serving(unpinned, [_worker(("foo", "2", "cd" * 32))]).workers == 1


def test_base_model_must_be_held_and_dataset_jobs_need_no_environment() -> None:
    spec = _spec(environment="arithmetic")
    found = serving(spec, [_worker(ARITH, models=("bb" * 32,))])
    assert found.workers == 0 and "1 worker(s) announce environment arithmetic 1 but none holds base model tiny" in found.reason
    assert serving(spec, [_worker(ARITH), _worker(ARITH)]).workers == 2
    assert serving(spec, []).reason == "no worker announces its environments in the DHT"


def test_package_mismatch_is_the_lease_rule() -> None:
    here = [InstalledEnv("foo", "2", "foo-pkg", PKG, "foo:Env")]
    assert package_mismatch(_spec(environment="foo", env_version="2", env_package_sha256=PKG), here) == ""
    assert package_mismatch(_spec(environment="foo", env_version="2"), here) == ""
    other = _spec(environment="foo", env_version="2", env_package_sha256="cd" * 32)
    assert package_mismatch(other, here) == (
        "environment foo 2: the job pins package sha cdcdcdcdcdcd…, installed here: ab12ab12ab12")


def test_env_infos_lists_configured_installed_environments_only() -> None:
    here = [InstalledEnv("foo", "2", "foo-pkg", PKG, "foo:Env"), InstalledEnv("bar", "1", "bar", "", "bar")]
    infos = env_infos(["foo", "missing"], here)
    assert [(e.name, e.version, e.package, e.package_sha256) for e in infos] == [("foo", "2", "foo-pkg", PKG)]


class MemoryDHT:
    """The two DHT calls the records use, in memory (dictionary values, one per subkey)."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, Any]] = {}

    def store(self, key: str, value: bytes, expiration_time: float, subkey: str) -> bool:
        self.values.setdefault(key, {})[subkey] = type("Item", (), {"value": value})()
        return True

    def get(self, key: str, latest: bool = True) -> Any:
        return type("Found", (), {"value": self.values[key]})() if key in self.values else None


def test_records_round_trip_and_forgeries_are_dropped() -> None:
    dht, alice, mallory = MemoryDHT(), Identity.generate(), Identity.generate()
    env = pb.EnvInfo(name="foo", version="2", package_sha256=PKG)
    assert announce_worker_envs(dht, alice, [env], [MODEL], 1)  # type: ignore[arg-type]
    forged = pb.WorkerEnvs(worker_id=alice.peer_id, environments=[env], base_model_sha256=[MODEL])
    dht.store(WORKER_ENVS_KEY, signing.sign(mallory, signing.WORKER_ENVS, forged).SerializeToString(), 0.0,
              subkey=alice.peer_id + "x")
    dht.store(WORKER_ENVS_KEY, b"garbage", 0.0, subkey="junk")
    found = find_worker_envs(dht)  # type: ignore[arg-type]
    assert [r.worker_id for r in found] == [alice.peer_id] and found[0].environments[0].name == "foo"


def test_announcer_refreshes_only_when_due() -> None:
    now = [0.0]
    dht = MemoryDHT()
    ann = EnvAnnouncer(dht, Identity.generate(), [], [MODEL], clock=lambda: now[0])  # type: ignore[arg-type]
    assert ann.refresh() and not ann.refresh()
    now[0] = 11.0
    assert ann.refresh() and ann.refresh(force=True)
