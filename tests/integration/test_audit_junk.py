"""`swarmrl audit` against a trainer whose statement store serves junk: a statement whose body
does not parse is a finding with its reason (exit 1), not a traceback, and the audit still pages
through the rest of the chain. Reuses test_audit's loopback trainer."""

from __future__ import annotations

import json
import sqlite3

import pytest

from swarmrl.node.cli.main import main
from swarmrl.protocol import credit
from swarmrl.protocol.pb import swarm_pb2 as pb
from tests.integration.test_audit import served  # noqa: F401 - the module's fixture

pytestmark = pytest.mark.integration


def test_a_statement_body_that_does_not_parse_is_a_finding(served, capsys) -> None:  # noqa: F811
    _, job, endpoint, tmp = served
    db = sqlite3.connect(tmp / "trainer" / "ledger.sqlite")
    (original,), = db.execute("SELECT envelope FROM statements WHERE job_id = ? AND version = 3",
                              (job.job_id,)).fetchall()
    env = pb.Signed.FromString(original)
    junk = pb.Signed(body=b"\xff\xff\xff", public_key=env.public_key, signature=env.signature)
    try:
        db.execute("UPDATE statements SET envelope = ? WHERE job_id = ? AND version = 3",
                   (junk.SerializeToString(), job.job_id))
        db.commit()
        code = main(["audit", job.job_id, "--trainer", endpoint, "--sample", "0", "--json"])
        report = json.loads(capsys.readouterr().out)
        assert code == 1
        assert [(f["reason"], int(f["version"])) for f in report["findings"]] == [(credit.BAD_SIGNATURE, 3)]
        assert int(report["statements"]) == 2   # the chain up to the junk one verified
    finally:
        db.execute("UPDATE statements SET envelope = ? WHERE job_id = ? AND version = 3", (original, job.job_id))
        db.commit()
        db.close()
