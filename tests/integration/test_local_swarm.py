"""End to end: `swarmrl up --model tiny` as real processes on loopback (bootstrap, trainer,
two workers, validator), then check versions, admission, rewards, hash agreement, that
the exported adapter loads with peft, that the last status line agrees with summary.json, that
the run ends with the held-out figure, and that anyone can audit its credit (`swarmrl audit`
against its trainer restarted on its state: clean, adds up to metrics.csv, every worker's
receipts covered; a tampered statement is flagged)."""

from __future__ import annotations

import csv
import json
import re
import sqlite3
import subprocess
import sys

import pytest
import torch
from peft import PeftModel

from swarmrl.node.cli.main import main
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.models.causal_lm import load_causal_lm
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.trainer.hosting import Trainer
from swarmrl.node.trainer.service import serve
from swarmrl.protocol import credit
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

pytestmark = pytest.mark.integration
STEPS = 4
EVAL_N = 50


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model_cache):
    out = tmp_path_factory.mktemp("up")
    proc = subprocess.run(
        [sys.executable, "-m", "swarmrl.node.cli.main", "up", "--model", "tiny", "--steps", str(STEPS),
         "--workers", "2", "--out", str(out), "--cache-dir", str(model_cache), "--timeout", "600",
         "--eval-n", str(EVAL_N)],
        capture_output=True, text=True, timeout=900, check=False,
    )
    (out / "up.stderr").write_text(proc.stderr)
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in (out / "run" / "logs").glob("*.log"))
        pytest.fail(f"swarmrl up failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{logs}")
    (out / "up.stdout").write_text(proc.stdout)
    (out / "up.stderr").write_text(proc.stderr)
    return out


def test_the_summary_is_on_stdout_and_the_progress_on_stderr(run_dir):
    """Every line of `up` went to stderr (issue 28 item 5): the result is stdout's."""
    out, err = (run_dir / "up.stdout").read_text(), (run_dir / "up.stderr").read_text()
    assert "swarmrl up: summary" in out and "groups_admitted" in out
    assert "swarmrl up: summary" not in err and "training" in err


def test_no_role_ends_in_a_native_abort(run_dir):
    """The validator ended every run with `terminate called after throwing an instance of
    'std::system_error' what(): Broken pipe` (issue 28 item 5): torch's allocator freeing
    hivemind's shared buffers at exit wrote to the torch_shm_manager the exit had already ended.
    Roles now share through file descriptors (node.cli.native.NATIVE_DEFAULTS): no manager."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["validator"]["checked"] > 0   # the validator did its work (the run that aborted)
    for log in (run_dir / "run" / "logs").glob("*.log"):
        text = log.read_text(errors="replace")
        assert "terminate called" not in text and "std::system_error" not in text, f"{log.name}:\n{text[-2000:]}"


def test_outputs_exist_and_versions_advance(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_version"] >= STEPS and summary["steps"] == STEPS
    assert summary["groups_admitted"] > 0
    assert len(summary["peers"]) >= 2
    assert (run_dir / "reward.png").stat().st_size > 1000
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["policy_version"]) for r in rows] == list(range(1, STEPS + 1))
    for col in ("step", "policy_version", "reward_mean", "groups_trained", "groups_rejected", "staleness_mean",
                "loss", "seconds"):
        assert col in rows[0]


def test_rewards_in_range(run_dir):
    from swarmrl.protocol.envs import get_environment

    lo, hi = get_environment("arithmetic", "1").reward_range
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        assert lo <= float(row["reward_mean"]) <= hi


def test_worker_and_trainer_adapters_agree(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["adapter_hash_agreement"] is True
    audit = summary["audit"]   # the audit at the end: an honest trainer's books add up
    assert audit["findings"] == 0 and audit["statements"] == summary["final_version"], audit
    assert audit["receipts_checked"] > 0 and audit["batches_checked"] > 0
    credit = summary["credit"]   # the leaderboard: both workers credited, every checked batch verified
    assert credit["findings"] == {} and credit["statements"] == summary["final_version"], credit
    with open(run_dir / "metrics.csv") as f:
        trained = sum(int(r["groups_trained"]) for r in csv.DictReader(f))
    assert set(credit["peers"]) == {n for n in summary["roles"] if n.startswith("worker")}, credit
    assert sum(p["groups"] for p in credit["peers"].values()) == credit["groups"] == trained > 0, credit
    # every credited worker verified; in a 4-step job a worker that started late under load can have
    # all its groups admitted after the last step took its batch, and then it is credited nothing
    assert all((p["verified_share"] == 1.0 or p["groups"] == 0) and not p["banned"]
               for p in credit["peers"].values()), credit
    assert any(p["groups"] > 0 for p in credit["peers"].values()), credit
    for worker in summary["worker_adapters"].values():
        assert worker["hash"] == summary["adapter_hash"]


def test_exported_adapter_loads_with_peft(run_dir, model_cache):
    meta = json.loads((run_dir / "adapter" / "swarmrl.json").read_text())
    assert meta["policy_version"] == STEPS
    base, tok = load_causal_lm(prepare_base_model("tiny", model_cache))
    model = PeftModel.from_pretrained(base, str(run_dir / "adapter"))
    ids = torch.tensor([tok("Question: What is 1+2?").input_ids])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_the_last_status_line_shows_the_summarys_figures(run_dir):
    """The last live line and summary.json come from one status snapshot (issue 28 item 5a)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = re.findall(r"^training (\d+)/(\d+) .*groups: (\d+) admitted, (\d+) rejected, (\d+) checked",
                       (run_dir / "up.stderr").read_text(), re.MULTILINE)
    step, total, admitted, rejected, checked = (int(x) for x in lines[-1])
    assert (step, total) == (summary["steps"], STEPS)
    assert (admitted, rejected, checked) == (summary["groups_admitted"], sum(summary["groups_rejected"].values()),
                                            summary["validator"]["checked"])


def test_up_ends_with_the_heldout_accuracy_of_base_and_adapter(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    base, tuned, n = summary["heldout_accuracy_base"], summary["heldout_accuracy_adapter"], summary["heldout_n"]
    assert n == EVAL_N and 0.0 <= base <= 1.0 and 0.0 <= tuned <= 1.0
    last = (run_dir / "up.stdout").read_text().splitlines()[-1]   # a result: on stdout, after the table
    assert last == f"held-out accuracy, greedy: base {base:.3f} -> adapter {tuned:.3f} (n={EVAL_N})"
    card = json.loads((run_dir / "adapter" / "swarmrl.json").read_text())
    assert card["heldout"] == {"base_accuracy": base, "adapter_accuracy": tuned, "n": EVAL_N}


def test_anyone_can_audit_the_runs_credit(run_dir, model_cache, capsys):
    """Issue 27: the finished run's trainer, restarted on its state, serves its statements; the
    audit of every credited batch and both workers' receipts is clean; the statements credit
    exactly the groups metrics.csv says were trained, and both workers; a tampered statement is
    flagged `bad_signature` (exit 1)."""
    keys = run_dir / "run" / "keys"
    identity = Identity.load(keys / "trainer.key")
    trainer = Trainer(TrainerConfig(state_dir=run_dir / "run" / "trainer", cache_dir=model_cache), identity)
    (job_id,) = trainer.jobs
    server, port = serve(trainer, "127.0.0.1", 0, 16)
    audit = ["audit", job_id, "--trainer", f"127.0.0.1:{port}", "--sample", "0", "--json"]
    try:
        code = main([*audit, "--receipts", str(model_cache / "receipts")])
        report = json.loads(capsys.readouterr().out)
        assert code == 0 and not report.get("findings"), report
        assert int(report["statements"]) == STEPS and int(report["receiptsChecked"]) > 0
        assert not int(report.get("receiptsPending", 0))   # a finished job: every receipt is due, and covered

        chain = credit.verify_chain(trainer.ledger.statements(job_id, 0, 100), job_id=job_id,
                                    trainer_id=identity.peer_id)
        with open(run_dir / "metrics.csv") as f:
            trained = sum(int(r["groups_trained"]) for r in csv.DictReader(f))
        assert sum(p.groups for st in chain for p in st.peers) == trained > 0
        workers = {Identity.load(keys / f"worker{i}.key").peer_id for i in range(2)}
        credited = {p.peer_id for st in chain for p in st.peers}
        assert credited and credited <= workers   # a late worker may have had no group trained in 4 steps
        summary = json.loads((run_dir / "summary.json").read_text())
        assert credited == {keys_id for name, keys_id in summary["roles"].items()
                            if summary["credit"]["peers"].get(name, {}).get("groups", 0) > 0}

        db = sqlite3.connect(run_dir / "run" / "trainer" / "ledger.sqlite")   # the store, edited behind its back
        (blob,) = db.execute("SELECT envelope FROM statements WHERE job_id = ? AND version = 2", (job_id,)).fetchone()
        env = pb.Signed.FromString(blob)
        st = pb.ContributionStatement.FromString(env.body)
        st.created_ms += 1
        env.body = st.SerializeToString()
        db.execute("UPDATE statements SET envelope = ? WHERE job_id = ? AND version = 2", (env.SerializeToString(), job_id))
        db.commit()
        db.close()
        code = main(audit)
        report = json.loads(capsys.readouterr().out)
        assert code == 1 and [(f["reason"], int(f["version"])) for f in report["findings"]] == [
            (credit.BAD_SIGNATURE, 2)]
    finally:
        server.stop(0)
        trainer.ledger.close()
