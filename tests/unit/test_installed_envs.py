"""Installed environments: discovered through the `swarmrl.environments` entry-point group (a
small third-party package written here: an `Environment` subclass), and workers that skip a job
whose environment they do not run. verifiers environments found the same way:
tests/unit/test_verifiers_adapter.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from swarmrl.protocol.envs import HELDOUT_START, get_environment, installed_environments

TOY = textwrap.dedent('''
    """A third-party swarmrl environment: add a number to itself."""
    from swarmrl.protocol.envs.base import HELDOUT_START, Environment, PromptSpec, check_seed_index


    def correct(prompts, completions, answer, **kwargs):
        return [1.0 if c.strip().split()[-1:] == [a] else 0.0 for c, a in zip(completions, answer)]


    def short(prompts, completions, **kwargs):
        return [1.0 if len(c) < 10 else 0.0 for c in completions]


    class ToyEnv(Environment):
        name, version = "toy", "0.3"
        reward_funcs = (correct, short)
        reward_weights = (1.0, 0.2)
        reward_range = (0.0, 1.2)
        regrade_tolerance = 1e-6
        stop = ()
        max_new_tokens = 16

        def prompt(self, seed, index):
            check_seed_index(seed, index)
            i = 50 if index >= HELDOUT_START else index % 20
            return PromptSpec(index=index, text=f"What is {i}+{i}?", info={"answer": str(2 * i)})
''')


@pytest.fixture
def toy_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "toy_env.py").write_text(TOY)
    info = tmp_path / "toy_env-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-env\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[swarmrl.environments]\ntoy = toy_env:ToyEnv\n")
    (info / "RECORD").write_text("toy_env.py,sha256=abc,123\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_an_installed_package_is_found_and_graded(toy_installed: Path) -> None:
    listed = {e.name: e for e in installed_environments()}
    assert listed["toy"].version == "0.3" and listed["toy"].package == "toy-env"
    assert len(listed["toy"].package_sha256) == 64 and "arithmetic" in listed
    env = get_environment("toy", "0.3")
    p = env.prompt(0, 3)
    assert p.text == "What is 3+3?" and p.info == {"answer": "6"}
    assert env.prompt(0, HELDOUT_START).info == {"answer": "100"}
    rows = env.rewards([p, p], ["It is 6", "It is 7, a long answer"])
    assert rows == [[1.0, 1.0], [0.0, 0.0]] and env.total(rows[0]) == pytest.approx(1.2)
    with pytest.raises(ValueError, match="is version 0.3 here, not 0.2"):
        get_environment("toy", "0.2")


def test_unknown_environment_names_what_is_installed() -> None:
    with pytest.raises(ValueError, match="'nope' is not installed here; installed: .*arithmetic"):
        get_environment("nope")


def test_worker_skips_jobs_whose_environment_it_does_not_run(model_cache: Path) -> None:
    from swarmrl.node.tasks.builtin_jobs import builtin_job
    from swarmrl.node.worker.main import cannot_run

    spec = builtin_job("tiny", model_cache)
    assert cannot_run(spec, ["arithmetic"]) == ""
    assert "not in this worker's environments" in cannot_run(spec, [])
    other = spec.model_copy(update={"environment": "nope"})
    assert "not installed here" in cannot_run(other, ["nope"])


def test_submit_pins_the_package_hash_and_workers_with_another_refuse(toy_installed: Path, model_cache: Path,
                                                                     tmp_path: Path) -> None:
    from swarmrl.node.tasks.job_file import load_job_file
    from swarmrl.node.worker.main import cannot_run

    job = tmp_path / "toy.toml"
    job.write_text('base_model = "tiny"\nenvironment = "toy"\nenv_version = "0.3"\nsteps = 2\n')
    spec = load_job_file(job, model_cache).spec
    installed = {e.name: e for e in installed_environments()}["toy"]
    assert spec.env_package_sha256 == installed.package_sha256 and len(spec.env_package_sha256) == 64
    assert cannot_run(spec, ["toy"]) == ""
    other = spec.model_copy(update={"env_package_sha256": "cd" * 32})
    assert "the job pins package sha cdcdcdcdcdcd…, installed here: " in cannot_run(other, ["toy"])
    builtin = tmp_path / "arith.toml"
    builtin.write_text('base_model = "tiny"\nenvironment = "arithmetic"\nsteps = 2\n')
    assert load_job_file(builtin, model_cache).spec.env_package_sha256 == ""   # built-ins: pinned by version
