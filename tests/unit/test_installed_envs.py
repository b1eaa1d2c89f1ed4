"""Installed environments: discovered through the `swarmrl.environments` entry-point group, a
verifiers-style package adapted (a small package written here following verifiers' documented
interface: `load_environment()` -> dataset, rubric of weighted reward functions, parser), and
workers that skip a job whose environment they do not run."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from swarmrl.protocol.envs import HELDOUT_START, get_environment, installed_environments

TOY = textwrap.dedent('''
    """A verifiers-style single-turn environment (no verifiers import needed)."""
    __version__ = "0.3"


    class Parser:
        def parse_answer(self, completion):
            return completion.strip().split()[-1] if completion.strip() else None


    def correct(completion, answer, parser, **kwargs):
        return 1.0 if parser.parse_answer(completion) == answer else 0.0


    def short(completion, **kwargs):
        return 1.0 if len(completion) < 10 else 0.0


    class Rubric:
        def __init__(self, funcs, weights, parser):
            self.funcs, self.weights, self.parser = funcs, weights, parser


    class Env:
        def __init__(self):
            self.dataset = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(20)]
            self.eval_dataset = [{"question": "What is 50+50?", "answer": "100"}]
            self.system_prompt = "Answer with a number."
            self.parser = Parser()
            self.rubric = Rubric([correct, short], [1.0, 0.2], self.parser)


    def load_environment(**kwargs):
        return Env()
''')


@pytest.fixture
def toy_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "vf_toy.py").write_text(TOY)
    info = tmp_path / "vf_toy-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vf-toy\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[swarmrl.environments]\nvf_toy = vf_toy\n")
    (info / "RECORD").write_text("vf_toy.py,sha256=abc,123\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_verifiers_style_package_is_found_adapted_and_graded(toy_installed: Path) -> None:
    listed = {e.name: e for e in installed_environments()}
    assert listed["vf_toy"].version == "0.3" and listed["vf_toy"].package == "vf-toy"
    assert len(listed["vf_toy"].package_sha256) == 64 and "arithmetic" in listed
    env = get_environment("vf_toy", "0.3")
    p = env.prompt(0, 3)
    assert p.text == "Answer with a number.\n\nWhat is 3+3?" and p.info == {"answer": "6"}
    assert p.messages[0] == ("system", "Answer with a number.")
    assert env.prompt(0, HELDOUT_START).info == {"answer": "100"}
    rows = env.rewards([p, p], ["It is 6", "It is 7, a long answer"])
    assert rows == [[1.0, 1.0], [0.0, 0.0]] and env.total(rows[0]) == pytest.approx(1.2)
    with pytest.raises(ValueError, match="is version 0.3 here, not 0.2"):
        get_environment("vf_toy", "0.2")


def test_unknown_environment_names_what_is_installed() -> None:
    with pytest.raises(ValueError, match="'nope' is not installed here; installed: .*arithmetic"):
        get_environment("nope")


def test_worker_skips_jobs_whose_environment_it_does_not_run(model_cache: Path) -> None:
    from swarmrl.node.jobs import builtin_job
    from swarmrl.node.worker.main import cannot_run

    spec = builtin_job("tiny", model_cache)
    assert cannot_run(spec, ["arithmetic"]) == ""
    assert "not in this worker's environments" in cannot_run(spec, [])
    other = spec.model_copy(update={"environment": "nope"})
    assert "not installed here" in cannot_run(other, ["nope"])
