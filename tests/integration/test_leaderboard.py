"""The leaderboard against a real trainer on loopback (hosting.Trainer behind its gRPC server, the
tiny job trained for real from two workers' signed batches): `swarmrl status JOB --peers` sums
each worker's credit from the signed statements to the job's trained groups, checks every
credited batch against its worker's signature (verified share 1.0), prints the same rows as JSON,
CSV and a table, names a ban from the trainer's status; the trainer's own ops page serves the
same board; the CLI's misuse is one line and exit 2."""

from __future__ import annotations

import csv
import io
import json
import urllib.request

import pytest

from swarmrl.node.audit.client import hosting_books
from swarmrl.node.cli.main import main
from swarmrl.node.ops.dashboard import books_credit
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.trainer.hosting import Trainer
from swarmrl.node.trainer.ops import start_trainer_ops
from swarmrl.node.trainer.service import serve
from swarmrl.protocol.identity import Identity
from tests.integration.test_audit import WORKERS, run_tiny_job

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_cache):
    tmp = tmp_path_factory.mktemp("leaderboard")
    cfg = TrainerConfig(state_dir=tmp / "trainer", cache_dir=model_cache, metrics_port=0)
    trainer = Trainer(cfg, Identity.from_seed(b"L" * 32))
    job, stores = run_tiny_job(trainer, tmp / "receipts")
    server, port = serve(trainer, "127.0.0.1", 0, 16)
    ops = start_trainer_ops(trainer, cfg)
    assert ops is not None
    yield trainer, job, f"127.0.0.1:{port}", ops
    ops.close()
    server.stop(0)
    for s in stores:
        s.close()
    trainer.ledger.close()


def _status(capsys, endpoint: str, job_id: str, *extra: str) -> tuple[int, str, str]:
    code = main(["status", job_id, "--trainer", endpoint, "--peers", "--sample", "0", *extra])
    got = capsys.readouterr()
    return code, got.out, got.err


def test_each_workers_credit_adds_up_to_the_trained_groups_and_checks(served, capsys) -> None:
    trainer, job, endpoint, _ = served
    code, out, _ = _status(capsys, endpoint, job.job_id, "--json")
    assert code == 0
    board = json.loads(out)
    trained = sum(int(r["groups_trained"]) for r in trainer.ledger.steps(job.job_id))
    assert board["groups"] == trained == sum(p["groups"] for p in board["peers"]) > 0
    assert board["head_version"] == job.version and board["findings"] == {}
    assert {p["peer_id"] for p in board["peers"]} == {w.peer_id for w in WORKERS}
    for p in board["peers"]:
        assert p["checked"] == p["groups"] and p["verified_share"] == 1.0   # --sample 0: every batch
        assert p["tokens"] > 0 and p["versions"] >= 1 and not p["banned"]
    assert abs(sum(p["share"] for p in board["peers"]) - 1.0) < 1e-5

    code, out, _ = _status(capsys, endpoint, job.job_id, "--csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and [r["peer_id"] for r in rows] == [p["peer_id"] for p in board["peers"]]
    assert [int(r["groups"]) for r in rows] == [p["groups"] for p in board["peers"]]

    code, out, _ = _status(capsys, endpoint, job.job_id)
    assert code == 0 and "credit of job" in out and WORKERS[0].peer_id[:16] in out


def test_a_ban_shows_on_the_board_and_the_ops_page_serves_it(served, capsys) -> None:
    _, job, endpoint, ops = served
    banned = WORKERS[1].peer_id
    job.admission.ban(banned, "caught by a validator")
    code, out, _ = _status(capsys, endpoint, job.job_id, "--json")
    rows = {p["peer_id"]: p for p in json.loads(out)["peers"]}
    assert code == 0 and rows[banned]["banned"] == "caught by a validator (status)"
    assert not rows[WORKERS[0].peer_id]["banned"]

    with urllib.request.urlopen(ops.url(f"/jobs/{job.job_id}/credit.json"), timeout=30) as r:
        page = json.loads(r.read())
    assert page["groups"] == sum(p["groups"] for p in page["peers"]) == json.loads(out)["groups"]
    with urllib.request.urlopen(ops.url(f"/jobs/{job.job_id}/credit"), timeout=30) as r:
        html = r.read().decode()
    assert "class='credit'" in html and banned[:16] in html
    with urllib.request.urlopen(ops.url(f"/jobs/{job.job_id}/credit.csv"), timeout=30) as r:
        assert r.read().decode().splitlines()[0].startswith("peer_id,groups,share")


def test_misuse_and_an_unknown_job_are_one_line(served, capsys) -> None:
    _, job, endpoint, _ = served
    assert main(["status", job.job_id, "--trainer", endpoint, "--csv"]) == 2
    assert "--csv is for the leaderboard" in capsys.readouterr().err
    assert main(["status", job.job_id, "--trainer", endpoint, "--peers", "--csv", "--json"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["status", "--peers", "--initial-peers", "/ip4/127.0.0.1/tcp/1"]) == 2
    assert "give a job id" in capsys.readouterr().err
    code, _, err = _status(capsys, endpoint, "0" * 32)
    assert code != 0 and len(err.strip().splitlines()) == 1 and "does not host" in err


def test_the_dashboards_books_skip_a_trainer_gone_and_one_without_the_job(served) -> None:
    _, job, endpoint, _ = served
    books = hosting_books(["127.0.0.1:1", endpoint])   # nothing listens on port 1
    found = books(job.job_id)
    assert found is not None and len(found.statements(job.job_id)) == job.version
    assert books("0" * 32) is None
    board = books_credit(books, sample=0)(job.job_id)
    assert board is not None and board.groups > 0 and not board.findings
