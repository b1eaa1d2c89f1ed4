"""Every bad invocation of `swarmrl` is one informative line on stderr and an exit code (2: usage
or config error, 1: runtime failure), found before torch is imported when no model is needed."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from swarmrl.node.cli import checks as cli_checks
from swarmrl.node.cli import main as cli
from swarmrl.node.cli import status as cli_status
from swarmrl.node.runtime import config as cfgmod

HEAVY = ("torch", "transformers", "hivemind", "peft")


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEAD = f"127.0.0.1:{_dead_port()}"
PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"

# (id, argv with {t} = a folder of fixture files, exit code, text stderr must hold, fast = no torch)
CASES = [
    ("no-command", [], 2, "required: COMMAND", True),
    ("unknown-command", ["bogus"], 2, "invalid choice: 'bogus'", True),
    ("keygen-exists", ["keygen", "{t}/afile"], 2, "never overwritten", True),
    ("keygen-under-a-file", ["keygen", "{t}/afile/k.key"], 2, "is a file, not a folder", True),
    ("config-missing", ["trainer", "--config", "nosuch.toml"], 2, "config file 'nosuch.toml' not found", True),
    ("config-is-a-folder", ["trainer", "--config", "{t}"], 2, "cannot read config file", True),
    ("config-toml-syntax", ["worker", "--config", "{t}/syntax.toml"], 2, "syntax.toml: TOML syntax error", True),
    ("config-toml-line", ["worker", "--config", "{t}/syntax.toml"], 2, "line 2", True),
    ("config-unknown-field", ["validator", "--config", "{t}/unknown.toml"], 2, "unknown field 'sample_rat'", True),
    ("override-bad-type", ["worker", "-o", "threads=zero"], 2, "threads = 'zero'", True),
    ("override-typo", ["worker", "-o", "thread=2"], 2, "did you mean 'threads'", True),
    ("override-no-value", ["worker", "-o", "threads"], 2, "not of the form key=value", True),
    ("override-range", ["trainer", "-o", "net.dht_port=70000"], 2, "net.dht_port = 70000", True),
    ("override-nested-unknown", ["trainer", "-o", "net.hots=x"], 2, "unknown field 'net.hots'", True),
    ("override-into-a-value", ["trainer", "-o", "threads=2", "-o", "threads.x=1"], 2, "threads is not a table", True),
    ("override-literal", ["trainer", "-o", "fault=oops"], 2, "fault = 'oops'", True),
    ("backend", ["worker", "-o", "backend=tpu"], 2, "backend = 'tpu'", True),
    ("worker-model", ["worker", "--dry-run", "-o", "base_model=nosuch"], 2, "unknown base model 'nosuch'", True),
    ("worker-red-team", ["worker", "-o", "red_team=bogus"], 2, "unknown red-team mode 'bogus'", True),
    ("peers-malformed", ["bootstrap", "--initial-peers", "bogus"], 2, "not a peer multiaddr", True),
    ("peers-twice", ["trainer", "--initial-peers", PEER, "-o", "net.initial_peers=[]"], 2, "give one", True),
    ("role-unknown-flag", ["worker", "--bogus"], 2, "unknown option --bogus", True),
    ("role-flag-typo", ["trainer", "--dry-rn"], 2, "unknown option --dry-rn; did you mean --dry-run?", True),
    ("up-flag-typo", ["up", "--model", "tiny", "--stpes", "5"], 2, "unknown option --stpes; did you mean --steps?", True),
    ("up-flag-typo-value", ["up", "--stpes=5", "--model", "tiny"], 2, "unknown option --stpes; did you mean", True),
    ("status-flag-typo", ["status", "j", "--trainer", DEAD, "--histroy", "3"], 2, "did you mean --history?", True),
    ("env-check-flag-typo", ["env", "check", "{t}/ok.toml", "--modle", "tiny"], 2, "did you mean --model?", True),
    ("simulate-flag-typo", ["simulate", "--wokers", "3"], 2, "unknown option --wokers; did you mean --workers?", True),
    ("top-level-flag", ["--verbose", "up"], 2, "swarmrl: unknown option --verbose", True),
    ("worker-credit-no-key", ["worker", "--credit", "-o", 'key="{t}/nokey.key"'], 2, "no worker key at", True),
    ("submit-missing-file", ["submit", "nosuch.toml", "--trainer", DEAD], 2, "no such file: 'nosuch.toml'", True),
    ("submit-toml-syntax", ["submit", "{t}/syntax.toml", "--trainer", DEAD], 2, "job file", True),
    ("submit-model", ["submit", "{t}/nomodel.toml", "--trainer", DEAD], 2, "unknown base model 'nosuch'", True),
    ("submit-hash", ["submit", "{t}/hash.toml", "--trainer", DEAD], 2, "base_model_sha256 is computed", True),
    ("submit-endpoint", ["submit", "{t}/ok.toml", "--trainer", "nohost"], 2, "expected HOST:PORT", True),
    ("submit-no-trainer", ["submit", "{t}/ok.toml"], 2, "required: --trainer", True),
    ("submit-key-folder", ["submit", "{t}/ok.toml", "--trainer", DEAD, "--key", "{t}/afile/k"], 2, "is a file", True),
    ("submit-unknown-field", ["submit", "{t}/unknown_job.toml", "--trainer", DEAD], 2, "unknown field 'stepz'", False),
    ("submit-bad-value", ["submit", "{t}/bad_job.toml", "--trainer", DEAD], 2, "group_size = 1", False),
    ("status-unreachable", ["status", "j", "--trainer", DEAD], 1, f"cannot reach the trainer at {DEAD}", True),
    ("status-port", ["status", "j", "--trainer", "127.0.0.1:0"], 2, "expected HOST:PORT", True),
    ("status-history", ["status", "j", "--trainer", DEAD, "--history", "-1"], 2, "must be at least 0", True),
    ("status-empty-id", ["status", "", "--trainer", DEAD], 2, "must not be empty", True),
    ("fetch-unreachable", ["fetch", "j", "--trainer", DEAD, "--out", "{t}/o"], 1, "cannot reach the trainer", True),
    ("fetch-out-file", ["fetch", "j", "--trainer", DEAD, "--out", "{t}/afile/o"], 2, "is a file, not a folder", True),
    ("fetch-no-out", ["fetch", "j", "--trainer", DEAD], 2, "required: --out", True),
    ("up-flag-and-j", ["up", "--max-async-level", "1", "-j", "max_async_level=0"], 2,
     "--max-async-level and -j max_async_level both set", True),
    ("up-loss-and-j", ["up", "--loss", "gspo", "-j", "loss.variant=dapo"], 2, "--loss and -j loss.variant", True),
    ("up-j-base-model", ["up", "-j", "base_model=gemma"], 2, "set --model instead", True),
    ("up-j-syntax", ["up", "-j", "steps"], 2, "not of the form key=value", True),
    ("up-red-team", ["up", "--red-team", "replay,bogus"], 2, "unknown red-team mode 'bogus'", True),
    ("up-model", ["up", "--model", "nosuch"], 2, "unknown base model 'nosuch'", True),
    ("up-threads", ["up", "--threads", "trainer=x"], 2, "is not ROLE=N", True),
    ("up-workers", ["up", "--workers", "0"], 2, "must be at least 1", True),
    ("up-timeout", ["up", "--timeout", "-1"], 2, "must be > 0", True),
    ("up-loss", ["up", "--loss", "bogus"], 2, "invalid choice: 'bogus'", True),
    ("up-out-file", ["up", "--model", "tiny", "--out", "{t}/afile"], 2, "is a file, not a folder", True),
    ("up-j-typo", ["up", "--model", "tiny", "--out", "{t}/o", "-j", "max_async_levl=0"], 2,
     "did you mean 'max_async_level'", False),
    ("up-j-value", ["up", "--model", "tiny", "--out", "{t}/o", "-j", "steps=abc"], 2, "steps = 'abc'", False),
    ("eval-adapter", ["eval", "--adapter", "{t}/o"], 2, "no adapter_config.json", True),
    ("eval-model", ["eval", "--adapter", "{t}", "--model", "nosuch"], 2, "unknown base model", True),
    ("eval-n", ["eval", "--adapter", "{t}", "--n", "0"], 2, "must be at least 1", True),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    t = tmp_path_factory.mktemp("cli")
    (t / "afile").write_text("x")
    (t / "syntax.toml").write_text("threads = 1\nthreads =\n")
    (t / "unknown.toml").write_text("sample_rat = 0.5\n")
    (t / "ok.toml").write_text('base_model = "tiny"\nsteps = 2\n')
    (t / "nomodel.toml").write_text('base_model = "nosuch"\n')
    (t / "hash.toml").write_text('base_model_sha256 = "00"\n')
    (t / "unknown_job.toml").write_text("stepz = 2\n")
    (t / "bad_job.toml").write_text("group_size = 1\n")
    return t


def _run(argv: list[str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-m", "swarmrl.node.cli.main", *argv], check=False, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "SWARMRL_TRACEBACK": ""})


@pytest.mark.parametrize(("argv", "code", "names"), [c[1:4] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_invocation_is_one_line(files, argv, code, names):
    proc = _run([a.format(t=files) for a in argv])
    lines = proc.stderr.splitlines()
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("swarmrl") and names in lines[0], lines[0]
    assert "errors.pydantic.dev" not in lines[0]


@pytest.mark.parametrize("argv", [c[1] for c in CASES if c[4] and c[2] == 2][::4],
                         ids=[c[0] for c in CASES if c[4] and c[2] == 2][::4])
def test_typos_are_refused_before_heavy_imports(files, argv):
    proc = _run([a.format(t=files) for a in argv], "-X", "importtime")
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert proc.returncode == 2 and not imported & set(HEAVY), sorted(imported & set(HEAVY))


def _walk(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _walk(sub)


def test_every_option_has_help_and_shows_its_default():
    for parser in _walk(cli.build_parser()):
        text = parser.format_help()
        assert "exit codes:" in text, parser.prog
        for action in parser._actions:
            assert action.help, f"{parser.prog} {action.option_strings or action.dest} has no help"
            if action.option_strings and action.default not in (None, False, [], "", b"", argparse.SUPPRESS):
                assert "default" in cli._Formatter(parser.prog)._get_help_string(action), (parser.prog, action.dest)


def test_no_help_shows_a_python_literal_as_a_default():
    """`swarmrl submit --help` showed `--tls-sha256 ... (default: b'')` (issue 28)."""
    for parser in _walk(cli.build_parser()):
        text = parser.format_help()
        assert "b''" not in text and "(default: None)" not in text, parser.prog


def test_up_flag_and_job_override_combine_by_the_documented_rule():
    def fields(*argv):
        return cli_checks.up_job_fields(cli.build_parser().parse_args(["up", *argv]))

    assert fields("-j", "max_async_level=0") == ({}, {"max_async_level": 0})
    assert fields("--seed", "3", "-j", "steps=4") == ({}, {"seed": 3, "steps": 4})
    assert fields("--loss", "gspo", "-j", "loss.eps_low=0.1") == ({"loss": {"eps_low": 0.1, "variant": "gspo"}}, {})
    assert fields("-j", "lora.rank=4") == ({"lora": {"rank": 4}}, {})


def test_up_with_a_job_override_of_a_flag_field_builds_the_job(tmp_path, model_cache, monkeypatch):
    from swarmrl.node.local import up
    built = {}
    monkeypatch.setattr(up, "_drive", lambda swarm, spec, opts, work, dataset, run:   # its summary: agreed
                        {"adapter_hash_agreement": built.setdefault("spec", spec) is spec})
    argv = ["up", "--model", "tiny", "--out", str(tmp_path), "--cache-dir", str(model_cache), "--no-eval", "-j", "max_async_level=0",
            "--loss", "gspo", "-j", "loss.eps_low=0.1"]
    assert cli.main(argv) == 0
    spec = built["spec"]
    assert spec.max_async_level == 0 and spec.loss.variant == "gspo" and spec.loss.eps_low == 0.1


def test_a_bug_keeps_its_traceback_and_ctrl_c_exits_130(monkeypatch, capsys):
    def bug(args):
        raise TypeError("a programming error")

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "keygen", bug)
    with pytest.raises(TypeError):
        cli.main(["keygen", "k"])
    monkeypatch.setitem(cli.COMMANDS, "keygen", interrupted)
    assert cli.main(["keygen", "k"]) == 130 and capsys.readouterr().err == "swarmrl keygen: interrupted\n"


def test_status_json_prints_hashes_in_hex():
    from swarmrl.protocol.pb import swarm_pb2 as pb

    st = pb.JobStatus(job_id="j", adapter_hash=bytes(range(32)), peers=[pb.PeerInfo(peer_id="p")])
    d = cli_status.message_dict(st)
    assert d["adapterHash"] == bytes(range(32)).hex() and d["peers"] == [{"peerId": "p"}]
    json.dumps(d)


def test_light_name_tables_match_the_heavy_ones():
    from swarmrl.node.models import recipes as model_recipes
    from swarmrl.node.worker import red_team

    assert set(cfgmod.BASE_MODEL_NAMES) == set(model_recipes.ALIASES)
    assert cfgmod.RED_TEAM_MODES == red_team.MODES


GRPC_ON_A_TAKEN_PORT = """
import socket, sys
from swarmrl.node.cli.native import apply_native_defaults
if sys.argv[1] == "quiet":
    apply_native_defaults()   # as main() does first
import grpc
with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        grpc.server(None, options=[("grpc.so_reuseport", 0)]).add_insecure_port(f"127.0.0.1:{taken.getsockname()[1]}")
    except RuntimeError:
        pass
"""


def test_grpc_core_logs_nothing_on_a_taken_port_unless_asked():
    """A taken port printed gRPC core's `E... add_port.cc:83] Failed to add port` before our line
    (issue 28 item 4): GRPC_VERBOSITY defaults to NONE before grpc is imported. Without the
    default, the same bind prints the line (so this test can fail)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}

    def stderr(mode: str) -> str:
        return subprocess.run([sys.executable, "-c", GRPC_ON_A_TAKEN_PORT, mode], capture_output=True, text=True,
                              timeout=120, env=env, check=True).stderr

    assert "add_port.cc" in stderr("default")
    assert stderr("quiet") == ""


def test_grpc_logging_default_gives_way_to_the_users_environment(tmp_path, monkeypatch, capsys):
    for var in ("GRPC_VERBOSITY", "GRPC_TRACE", "HIVEMIND_MEMORY_SHARING_STRATEGY"):
        monkeypatch.setenv(var, "")   # recorded, so the test's end restores this process's environment
        monkeypatch.delenv(var)
    assert cli.main(["keygen", str(tmp_path / "a.key")]) == 0
    assert os.environ["GRPC_VERBOSITY"] == "NONE" and "GRPC_TRACE" not in os.environ
    assert os.environ["HIVEMIND_MEMORY_SHARING_STRATEGY"] == "file_descriptor"   # no torch_shm_manager
    monkeypatch.setenv("GRPC_VERBOSITY", "DEBUG")
    assert cli.main(["keygen", str(tmp_path / "b.key")]) == 0
    assert os.environ["GRPC_VERBOSITY"] == "DEBUG"


@pytest.mark.skipif(os.geteuid() != 0, reason="without root --netns says it needs root before looking for tools")
def test_up_netns_without_nftables_names_the_debian_package(tmp_path):
    """`up --netns` said `apt-get install -y nft`; Debian's package is nftables (issue 28 item 4)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ip", "ethtool"):   # everything but nft
        (bin_dir / tool).symlink_to("/bin/true")
    env = {**os.environ, "PATH": str(bin_dir), "SWARMRL_TRACEBACK": ""}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "swarmrl.node.cli.main", "up", "--netns",
                           "--model", "tiny", "--out", str(tmp_path / "o")], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
    assert proc.returncode == 2 and lines == ["swarmrl up: --netns: `nft` is not installed (apt-get install -y nftables)"]
    imported = {ln.split("|")[-1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}
    assert not imported & set(HEAVY)


def test_a_taken_dht_port_is_one_line_before_the_dht_starts(tmp_path):
    """A second `swarmrl bootstrap -o net.dht_port=P` started silently beside the first (p2pd
    binds with SO_REUSEPORT); now it is refused as a taken gRPC port is."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "swarmrl.node.cli.main", "bootstrap", "-o", f"net.dht_port={port}"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [(f"swarmrl bootstrap: could not serve the DHT on 127.0.0.1:{port}: the port is "
                                        "taken or the address is not ours (net.dht_port=0 picks a free port): "
                                        "Address already in use")]


@pytest.mark.parametrize("override", ["base_model=\"nosuch/model\"", "base_models=[\"tiny\", \"/nonexistent/model\"]"])
def test_a_dry_run_refuses_what_a_start_refuses_with_the_same_line(tmp_path, override):
    """`worker --dry-run -o base_model=nosuch/model` exited 0 while a start failed (issue 28 item
    4): both now run `runtime.preflight` first; the start refuses before it writes a key."""
    def worker(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "swarmrl.node.cli.main", "worker", *flags, "-o", override],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
                              env={**os.environ, "SWARMRL_TRACEBACK": ""})

    dry, start = worker("--dry-run"), worker()
    assert dry.returncode == start.returncode == 2, (dry.stderr, start.stderr)
    assert len(dry.stderr.splitlines()) == 1 and dry.stderr == start.stderr and "base model" in dry.stderr
    assert dry.stdout == "" and not (tmp_path / "keys").exists()


def test_a_dry_run_refuses_a_taken_port(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["validator", "--dry-run", "-o", f"metrics_port={port}"]) == 2
        assert f"swarmrl validator: could not serve /metrics on 127.0.0.1:{port}" in capsys.readouterr().err
        assert cli.main(["bootstrap", "--dry-run", "-o", f"net.dht_port={port}"]) == 2
        assert f"swarmrl bootstrap: could not serve the DHT on 127.0.0.1:{port}" in capsys.readouterr().err
        assert cli.main(["trainer", "--dry-run", "-o", f"grpc_port={port}"]) == 2
        assert capsys.readouterr().err == (f"swarmrl trainer: could not serve gRPC on 127.0.0.1:{port}: the port is "
                                           "taken or the address is not ours (grpc_port=0 picks a free port): "
                                           "Address already in use\n")
    assert cli.main(["bootstrap", "--dry-run", "-o", f"net.dht_port={port}"]) == 0   # free again
