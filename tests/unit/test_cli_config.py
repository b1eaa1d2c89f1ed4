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


def test_up_help_lists_every_red_team_mode(capsys):
    from swarmrl.node.worker.red_team import MODES

    with pytest.raises(SystemExit):
        main(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(m in text for m in MODES) and "'all'" in text


def test_job_overrides_merge_field_by_field(model_cache):
    spec = builtin_job("tiny", model_cache, sampling={"max_new_tokens": 4}, loss={"variant": "gspo"})
    assert spec.sampling.max_new_tokens == 4 and spec.sampling.stop == ("\n",)
    assert spec.loss.variant == "gspo"
