"""Role configs from TOML + overrides, --dry-run, and built-in job overrides."""

import json

import pytest

from swarmrl.node.cli.main import main
from swarmrl.node.runtime import config as cfgmod
from swarmrl.node.tasks.builtin_jobs import builtin_job


def test_toml_then_dotted_overrides(tmp_path):
    path = tmp_path / "worker.toml"
    path.write_text('base_model = "tiny"\n[net]\ninitial_peers = ["/ip4/127.0.0.1/tcp/1/p2p/x"]\n')
    cfg = cfgmod.load_config(cfgmod.WorkerConfig, path, ["threads=2", "net.dht_port=4000"])
    assert cfg.threads == 2 and cfg.net.dht_port == 4000 and cfg.net.initial_peers == ["/ip4/127.0.0.1/tcp/1/p2p/x"]
    with pytest.raises(cfgmod.ConfigError, match="unknown field 'no_such_field'"):
        cfgmod.load_config(cfgmod.WorkerConfig, None, ["no_such_field=1"])
    with pytest.raises(ValueError, match="key=value"):
        cfgmod.load_config(cfgmod.WorkerConfig, None, ["threads"])


def test_dry_run_prints_the_resolved_config(capsys):
    assert main(["trainer", "--dry-run", "-o", "grpc_port=5000", "--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/y"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["grpc_port"] == 5000 and printed["net"]["host"] == "127.0.0.1"
    assert printed["net"]["initial_peers"] == ["/ip4/127.0.0.1/tcp/9/p2p/y"]


def test_bad_override_is_a_clear_error(capsys):
    assert main(["worker", "--dry-run", "-o", "threads=zero"]) == 2
    assert "threads" in capsys.readouterr().err


def test_unknown_red_team_mode_is_refused_before_anything_starts(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["up", "--model", "tiny", "--red-team", "replay,bogus", "--out", str(out)]) == 2
    assert "unknown red-team mode 'bogus'" in capsys.readouterr().err and not out.exists()


def test_trainer_red_team_modes_parse_beside_the_workers_one_at_a_time(tmp_path, capsys):
    from swarmrl.node.cli.checks import UsageError, red_team_modes

    assert red_team_modes("replay, omit_groups") == (["replay"], "omit_groups")
    assert red_team_modes("sybil_credit") == ([], "sybil_credit") and red_team_modes("") == ([], None)
    assert red_team_modes("all")[1] is None   # 'all': every worker mode; trainer modes are one at a time
    with pytest.raises(UsageError, match="one trainer mode at a time"):
        red_team_modes("omit_groups,misstated_adapter")
    out = tmp_path / "run"
    assert main(["up", "--model", "tiny", "--red-team", "omit_groups,sybil_credit", "--out", str(out)]) == 2
    assert "one trainer mode at a time" in capsys.readouterr().err and not out.exists()


def test_up_help_lists_every_red_team_mode(capsys):
    from swarmrl.node.worker.red_team import MODES
    from swarmrl.protocol.red_team_modes import TRAINER_MODES

    with pytest.raises(SystemExit):
        main(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(m in text for m in MODES) and "'all'" in text
    assert all(m in text for m in TRAINER_MODES)


def test_job_overrides_merge_field_by_field(model_cache):
    spec = builtin_job("tiny", model_cache, sampling={"max_new_tokens": 4}, loss={"variant": "gspo"})
    assert spec.sampling.max_new_tokens == 4 and spec.sampling.stop == ("\n",)
    assert spec.loss.variant == "gspo"


@pytest.mark.parametrize("agree", [True, False])
def test_up_fails_in_one_line_when_the_replicas_end_on_different_adapters(tmp_path, capsys, monkeypatch, agree):
    """A run that ends with its trainers (or workers) on different adapters exits 1, its summary
    and adapter kept (`run_up` wrote them); one that agrees exits 0."""
    from swarmrl.node.local import up

    monkeypatch.setattr(up, "run_up", lambda opts: {"adapter_hash_agreement": agree})
    out = tmp_path / "run"
    assert main(["up", "--model", "tiny", "--out", str(out)]) == (0 if agree else 1)
    err = capsys.readouterr().err
    assert ("different adapters" in err and str(out) in err and "Traceback" not in err) != agree
