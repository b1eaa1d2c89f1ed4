"""`swarmrl audit --replay` against a real trainer on loopback (hosting.Trainer behind its gRPC
server, the tiny job trained for real on two workers' signed batches): an honest trainer's every
version is one step on the groups its statements credit; a trainer whose statements leave out
a worker's trained groups (the `omit_groups` drill) publishes versions that are not the
credited step (`step_mismatch`, on top of the receipts' `omitted_group`); a DiLoCo job, or
--replay without --trainer, is one line and exit 2."""

from __future__ import annotations

import json

import pytest

from swarmrl.node.cli.main import main
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.trainer.hosting import Trainer
from swarmrl.node.trainer.service import serve
from swarmrl.protocol import audit
from swarmrl.protocol.identity import Identity
from tests.integration.test_audit import run_tiny_job

pytestmark = pytest.mark.integration


def _trained(tmp, model_cache, red_team: str | None = None):
    trainer = Trainer(TrainerConfig(state_dir=tmp / "trainer", cache_dir=model_cache, red_team=red_team),
                      Identity.generate())
    job, stores = run_tiny_job(trainer, tmp / "receipts", steps=4)
    server, port = serve(trainer, "127.0.0.1", 0, 4)
    return trainer, job, stores, server, f"127.0.0.1:{port}"


def _replay(capsys, endpoint: str, job_id: str, model_cache, *extra: str) -> tuple[int, dict, str]:
    code = main(["audit", job_id, "--trainer", endpoint, "--replay", "all", "--cache-dir", str(model_cache),
                 "--sample", "0", "--json", *extra])
    got = capsys.readouterr()
    return code, json.loads(got.out) if got.out.strip() else {}, got.err


@pytest.mark.parametrize("red_team", [None, "omit_groups"])
def test_each_version_is_the_credited_step(tmp_path, model_cache, capsys, red_team) -> None:
    trainer, job, stores, server, endpoint = _trained(tmp_path, model_cache, red_team)
    try:
        code, report, err = _replay(capsys, endpoint, job.job_id, model_cache, "--receipts", str(tmp_path / "receipts"))
        print(err)
        reasons = [f["reason"] for f in report.get("findings", [])]
        assert f"replayed {job.version} version(s) from version 0" in err and "stopped" not in err
        if red_team is None:
            assert code == 0 and reasons == [], report
        else:   # every version trained both workers' groups and credits one worker's
            assert code == 1 and reasons.count(audit.STEP_MISMATCH) == job.version, report
            assert audit.OMITTED_GROUP in reasons
    finally:
        server.stop(0)
        for s in stores:
            s.close()
        trainer.ledger.close()


def test_misuse_is_one_line_and_exit_2(capsys) -> None:
    assert main(["audit", "j", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmNone", "--replay", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--replay needs --trainer" in err[0]
