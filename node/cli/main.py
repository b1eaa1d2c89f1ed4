"""`swarmrl`: one entrypoint per role, plus the submitter's commands and the local swarm.

    swarmrl keygen KEYFILE
    swarmrl bootstrap|trainer|worker|validator [--config FILE] [-o key=value ...] [--dry-run]
    swarmrl worker --credit [--config FILE] [-o key=value ...]
    swarmrl submit JOB.toml --trainer HOST:PORT
    swarmrl status JOB --trainer HOST:PORT [--peers [--json | --csv]]
    swarmrl status --initial-peers MADDR
    swarmrl fetch JOB --trainer HOST:PORT --out DIR
    swarmrl up [JOB.toml ...] [--jobs N] [--model tiny|gemma|smollm2|FOLDER] [--steps N] [--workers K] [--out DIR] [-j FIELD=VALUE]
    swarmrl simulate [--scenario FILE] [--workers N] [--trainers K] [--hours H] [--cheaters SHARE] [--churn LEVEL]
    swarmrl dashboard --trainer HOST:PORT [--trainer ...] [--job JOB] [--port N]
    swarmrl eval [JOB.toml] --adapter DIR
    swarmrl env list | swarmrl env check JOB.toml
    swarmrl audit JOB --trainer HOST:PORT [--receipts PATH] [--json] [--report FILE]

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeAlias

from pydantic import BaseModel

from swarmrl.node.cli import audit as audit_command
from swarmrl.node.cli import status as status_command
from swarmrl.node.cli.checks import (
    EXIT_USAGE,
    THREAD_ROLES,
    UsageError,
    check_writable,
    describe_failure,
    endpoint,
    existing_file,
    int_at_least,
    model_name,
    nonempty,
    parse_threads,
    positive_float,
    precheck_job_fields,
    precheck_job_file,
    red_team_modes,
    sha256_hex,
    unknown_option,
    up_job_fields,
)
from swarmrl.node.cli.native import apply_native_defaults
from swarmrl.node.runtime import config as cfgmod
from swarmrl.protocol.red_team_modes import TRAINER_MODES

EPILOG = """\
exit codes:
  0    success
  1    runtime failure: a trainer or DHT peer unreachable, a job refused or unknown, a process of
       the local swarm died
  2    usage or config error: bad option or value, unknown config or job field, missing or
       unreadable file, TOML syntax error, unwritable output folder
  130  interrupted (Ctrl-C)
  143  stopped by SIGTERM (swarmrl up, after keeping what the run did)
Each failure is one line on stderr; SWARMRL_TRACEBACK=1 shows the traceback too.
"""

UP_EPILOG = """\
job fields: --steps, --seed, --loss and --max-async-level set the job fields steps, seed,
loss.variant and max_async_level; -j sets any job field. A field given both ways is refused
(give it once); -j loss.eps_low=... combines with --loss (different fields).

at the end: held-out accuracy, greedy, of the base model and of the adapter on --eval-n prompts
(as `swarmrl eval`), in summary.json and as the last line; --no-eval skips it. Interrupted
(Ctrl-C: 130, SIGTERM: 143), up keeps the newest adapter, metrics.csv and a summary.json marked
"interrupted" in --out.

""" + EPILOG


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" after every option that has a meaningful default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, [], "", b"") or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (no usage block) with exit code 2."""

    def error(self, message: str) -> NoReturn:
        """Exit with code 2 after one line: `swarmrl CMD: message (see swarmrl CMD --help)`."""
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """Refuse an unknown `--option` by name (with the closest known one) before argparse
        parses: otherwise `up --stpes 5` reads 5 as the job file and says "no such file: '5'"."""
        tokens = list(sys.argv[1:] if args is None else args)
        if (unknown := unknown_option(self, tokens)) is not None:
            self.error(unknown)
        return super().parse_known_args(tokens, namespace)


# ---- the parser ----------------------------------------------------------------------------------


SubParsers: TypeAlias = "argparse._SubParsersAction[_Parser]"
"""What `add_subparsers` returns (argparse names no public type for it; generic only for type checkers)."""


def _add(sub: SubParsers, name: str, help_: str, epilog: str = EPILOG) -> _Parser:
    return sub.add_parser(name, help=help_, description=help_, epilog=epilog, formatter_class=_Formatter)


def _role_parser(sub: SubParsers, name: str, help_: str) -> _Parser:
    p = _add(sub, name, help_)
    p.add_argument("--config", type=Path, help="TOML config file (fields as --dry-run prints them)")
    p.add_argument("-o", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (dotted keys, JSON values), repeatable; applied after --config")
    p.add_argument("--initial-peers", nargs="*", default=None, metavar="MADDR",
                   help="DHT peers to join, /ip4/HOST/tcp/PORT/p2p/PEER_ID (default: the config's "
                        "net.initial_peers); replaces net.initial_peers, so it may not be given with -o "
                        "net.initial_peers")
    p.add_argument("--dry-run", action="store_true",
                   help="run the checks a start runs first (ports; a worker's base models) and print the config "
                        "resolved, then exit")
    return p


ROLES: dict[str, tuple[type[BaseModel], str, str]] = {
    "bootstrap": (cfgmod.BootstrapConfig, "swarmrl.node.bootstrap.main", "a DHT peer others join through"),
    "trainer": (cfgmod.TrainerConfig, "swarmrl.node.trainer.main", "host jobs: leases, admission, GRPO steps"),
    "worker": (cfgmod.WorkerConfig, "swarmrl.node.worker.main", "generate, grade, sign and submit rollouts"),
    "validator": (cfgmod.ValidatorConfig, "swarmrl.validator.main", "re-check rollouts, score peers"),
}
"""Role command -> (its config class, the module whose `run(cfg)` runs it, its one-line help)."""


def build_parser() -> argparse.ArgumentParser:
    """The `swarmrl` parser: one subcommand per role and per submitter or local-swarm command."""
    parser = _Parser(prog="swarmrl", description="peer-to-peer LoRA GRPO post-training", epilog=EPILOG,
                     formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of the commands below; `swarmrl COMMAND --help` lists its options")
    k = _add(sub, "keygen", "create an Ed25519 key file (mode 0600) and print its peer id")
    k.add_argument("path", type=Path, help="key file to create (never overwritten)")
    for name, (_, _, help_) in ROLES.items():
        role = _role_parser(sub, name, help_)
        if name == "worker":
            role.add_argument("--credit", action="store_true",
                              help="print this worker's credit per job from its trainer-signed receipts, then exit")
    s = _add(sub, "submit", "sign and submit a job TOML to a trainer; prints the job id")
    s.add_argument("job", type=existing_file,
                   help="job TOML: base_model (default tiny) and any JobSpec field overriding the built-in job")
    s.add_argument("--trainer", required=True, type=endpoint, metavar="HOST:PORT", help="the trainer's gRPC endpoint")
    s.add_argument("--tls-sha256", type=sha256_hex, default=b"", metavar="HEX",
                   help="the trainer serves TLS: pin its certificate (tls_sha256 in its ready file); without it, plaintext")
    s.add_argument("--key", type=Path, default=Path("keys/submitter.key"),
                   help="the submitter's key file (created if missing)")
    s.add_argument("--cache-dir", type=Path, help="base model cache (default: $SWARMRL_CACHE or ~/.cache/swarmrl)")
    status_command.add_parser(sub, _add)
    f = _add(sub, "fetch", "download a job's adapter in PEFT format")
    f.add_argument("job_id", type=nonempty, help="the id `swarmrl submit` printed")
    f.add_argument("--trainer", required=True, type=endpoint, metavar="HOST:PORT",
                   help="the gRPC endpoint of a trainer of the job")
    f.add_argument("--tls-sha256", type=sha256_hex, default=b"", metavar="HEX",
                   help="the trainer serves TLS: pin its certificate (tls_sha256 in its ready file); without it, plaintext")
    f.add_argument("--out", type=Path, required=True, help="folder to write the adapter into (created)")
    f.add_argument("--cache-dir", type=Path, help="base model cache (default: $SWARMRL_CACHE or ~/.cache/swarmrl)")
    _up_parser(sub)
    e = _add(sub, "eval", "held-out greedy score: base model vs adapter")
    e.add_argument("job_file", nargs="?", type=existing_file, help="JOB.toml whose task to score (default: arithmetic)")
    e.add_argument("--adapter", type=Path, required=True, help="a PEFT adapter folder (from fetch or up)")
    e.add_argument("--model", type=model_name, default=None, help="base model (default: from the adapter's config)")
    e.add_argument("--n", type=int_at_least(1), default=200, help="held-out prompts")
    e.add_argument("--seed", type=int_at_least(0), default=None,
                   help="the job's seed, which picks a data set's held-out rows (default: the job file's, else 0)")
    e.add_argument("--cache-dir", type=Path, help="base model cache (default: $SWARMRL_CACHE or ~/.cache/swarmrl)")
    from swarmrl.simulations.cli_args import add_arguments as add_simulate_arguments  # argparse only

    add_simulate_arguments(_add(sub, "simulate", "simulate the swarm at scale on a simulated clock "
                                "(SimPy; simulations/README.md)"))
    d = _add(sub, "dashboard", "serve a trainer's live job pages here, polling its gRPC status")
    d.add_argument("--trainer", required=True, type=endpoint, action="append", metavar="HOST:PORT",
                   help="a trainer's gRPC endpoint; repeat it for the jobs of several trainers on one page")
    d.add_argument("--job", action="append", default=[], metavar="JOB_ID", help="list this job on the index page")
    d.add_argument("--host", default="127.0.0.1", help="where the page listens (loopback unless told)")
    d.add_argument("--port", type=int, default=8080, help="0: any free port")
    _env_parser(sub)
    audit_command.add_parser(sub, _add)
    return parser


def _up_parser(sub: SubParsers) -> None:
    up = _add(sub, "up", "run a whole local swarm on 127.0.0.1 and train a job file (or the built-in job)",
              epilog=UP_EPILOG)
    up.add_argument("job_file", nargs="*", type=existing_file,
                    help="JOB.toml, as `swarmrl submit` takes it; several: one swarm trains them all at once")
    up.add_argument("--jobs", type=int_at_least(1), default=None, metavar="N",
                    help="also run N copies of the built-in job (seeds --seed, --seed+1, ...) on the same swarm")
    up.add_argument("--weights", default="", metavar="W,...",
                    help="with several jobs: each job's weight (its share when demand exceeds supply), "
                         "job files first, then the copies (default: 1 each)")
    up.add_argument("--model", type=model_name, default=None,
                    help="tiny | gemma (google/gemma-3-270m) | smollm2 (HuggingFaceTB/SmolLM2-135M-Instruct) | "
                         "a model folder; default: the job file's base_model, else gemma")
    up.add_argument("--steps", type=int_at_least(1), help="job steps (default: the built-in job's)")
    up.add_argument("--workers", type=int_at_least(1), default=2, help="honest workers")
    up.add_argument("--backend", choices=["hf", "vllm"], default="hf",
                    help="honest workers' inference backend (vllm: its server in .venv-vllm; default: hf)")
    up.add_argument("--trainers", type=int_at_least(1), default=None,
                    help="trainers serving the job (they average gradients; default 1); with several jobs: "
                         "trainers hosting them, job i on trainer i mod N (default: one per job)")
    up.add_argument("--out", type=Path, default=Path("runs/latest"), help="output folder (adapter, metrics, summary)")
    up.add_argument("--loss", choices=["grpo", "dapo", "dr_grpo", "gspo", "cispo"],
                    help="loss variant (default: the built-in job's)")
    up.add_argument("--max-async-level", type=int_at_least(0),
                    help="max policy versions a rollout may lag (default: the built-in job's)")
    up.add_argument("--seed", type=int_at_least(0), help="job seed (default: 0)")
    up.add_argument("--cache-dir", type=Path, help="base model cache (default: $SWARMRL_CACHE or ~/.cache/swarmrl)")
    up.add_argument("--timeout", type=positive_float, default=3600.0, help="seconds before giving up")
    up.add_argument("--threads", default="", metavar="ROLE=N,...",
                    help=f"torch threads per role ({', '.join(THREAD_ROLES)}), e.g. trainer=2,worker=1 (default: 1)")
    up.add_argument("--red-team", default="", metavar="MODES",
                    help=f"adversarial workers, one per mode, comma-separated, or 'all': {', '.join(cfgmod.RED_TEAM_MODES)}"
                         f"; one trainer mode (cooked credit books): {', '.join(TRAINER_MODES)} (default: none)")
    up.add_argument("--netns", action="store_true",
                    help="run the roles on a test bed of Linux network namespaces (root): a slow lossy link, "
                         "a worker behind NAT (node/local/netns.py)")
    up.add_argument("--tls", action="store_true", help="trainers serve gRPC over TLS, pinned by the signed job record")
    up.add_argument("--eval-n", type=int_at_least(1), default=200,
                    help="held-out prompts scored at the end, base vs adapter (greedy)")
    up.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation at the end")
    up.add_argument("-j", "--job", dest="job_overrides", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a built-in job field (dotted fields, JSON values), repeatable")


def _env_parser(sub: SubParsers) -> None:
    env = _add(sub, "env", "installed environments and reward functions; check a job's task")
    env_sub = env.add_subparsers(dest="env_command", required=True, metavar="ENV_COMMAND",
                                 help="list | check (`swarmrl env ENV_COMMAND --help` lists its options)")
    _add(env_sub, "list", "installed environments and built-in reward functions")
    check = _add(env_sub, "check", "load a job's task, render prompts as workers will, grade the reference answers")
    check.add_argument("job", type=existing_file, help="JOB.toml, as `swarmrl submit` takes it")
    check.add_argument("--model", type=model_name, default=None, help="base model override (default: the job file's)")
    check.add_argument("--cache-dir", type=Path, help="base model cache (default: $SWARMRL_CACHE or ~/.cache/swarmrl)")
    check.add_argument("-n", type=int_at_least(1), default=3, help="prompts to show")


def cmd_env(args: argparse.Namespace) -> int:
    """`swarmrl env list` or `swarmrl env check JOB.toml`; returns the exit code."""
    from swarmrl.node.cli import env as env_cli
    return env_cli.env_list() if args.env_command == "list" else env_cli.env_check(args.job, args.model,
                                                                                     args.cache_dir, args.n)


# ---- commands ------------------------------------------------------------------------------------


def cmd_keygen(args: argparse.Namespace) -> int:
    """Create a new Ed25519 key file and print its peer id.

    Raises:
        UsageError: the file exists (keys are never overwritten) or its folder is not writable.
    """
    if args.path.exists():
        raise UsageError(f"{str(args.path)!r} exists; keys are never overwritten: choose a new path")
    check_writable(args.path.parent, "key folder")
    from swarmrl.protocol.identity import Identity

    ident = Identity.generate()
    ident.save(args.path)
    print(ident.peer_id)
    return 0


def cmd_role(args: argparse.Namespace) -> int:
    """Resolve the role's config (--config, then -o overrides, then --initial-peers), then run the
    role until it exits, or (--dry-run) run the checks its start runs first
    (`runtime.preflight`) and print the config."""
    import importlib

    cls, module, _ = ROLES[args.command]
    cfg = _resolve(cls, args)
    if isinstance(cfg, cfgmod.WorkerConfig) and args.credit:
        from swarmrl.node.cli.credit import print_credit
        return print_credit(cfg)
    if args.dry_run:
        from swarmrl.node.runtime.preflight import ROLE_CONFIGS, preflight

        assert isinstance(cfg, ROLE_CONFIGS)
        preflight(cfg)
        print(cfgmod.dump_config(cfg))
        return 0
    importlib.import_module(module).run(cfg)   # its first call is preflight(cfg)
    return 0


def _resolve(cls: type[cfgmod.C], args: argparse.Namespace) -> cfgmod.C:
    """The role's config from its file and overrides; --initial-peers travels as one more override."""
    overrides = list(args.overrides)
    if args.initial_peers is not None:
        if any(cfgmod.parse_override(o)[0] == ["net", "initial_peers"] for o in overrides):
            raise UsageError("--initial-peers and -o net.initial_peers set the same field: give one")
        overrides.append(f"net.initial_peers={json.dumps(args.initial_peers)}")
    return cfgmod.load_config(cls, args.config, overrides)


def cmd_submit(args: argparse.Namespace) -> int:
    """Check a job file as a worker would, sign it with --key and submit it; prints the job id."""
    precheck_job_file(args.job, args.key)
    from swarmrl.node.submitter.client import submit_job
    from swarmrl.node.tasks.job_file import load_job_file
    from swarmrl.protocol.identity import Identity

    loaded = load_job_file(args.job, args.cache_dir)   # every check a worker would trip over, here
    for warning in loaded.report.warnings:
        print(f"swarmrl submit: warning: {warning}", file=sys.stderr)
    job_id = submit_job(args.trainer, Identity.load_or_create(args.key), loaded.spec, dataset=loaded.dataset,
                        tls_sha256=args.tls_sha256)
    print(job_id)
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    """Download a job's current adapter into --out in PEFT format; prints its version and hash."""
    check_writable(args.out, "--out")
    from swarmrl.node.submitter.client import fetch_job_adapter

    version, h = fetch_job_adapter(args.trainer, args.job_id, args.out, args.cache_dir, tls_sha256=args.tls_sha256)
    print(f"adapter version {version} (sha256 {h.hex()}) written to {args.out}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """Check every `up` argument (before torch is imported), then run the local swarm to the end
    of its job (node/local/up.py), or of its jobs when several are given (node/local/many.py)."""
    red_team, trainer_red_team = red_team_modes(args.red_team)
    threads = parse_threads(args.threads)
    job, flags = up_job_fields(args)
    check_writable(args.out, "--out")
    if args.netns and (reason := _netns_missing()) is not None:
        raise UsageError(f"--netns: {reason}")
    precheck_job_fields({**job, **flags}, "job")
    from swarmrl.node.local.jobs_plan import plan_jobs

    sources = plan_jobs(args.job_file, args.jobs, args.weights, args.trainers, red_team + [m for m in [trainer_red_team] if m])
    from swarmrl.node.local.up import UpOptions, run_up

    opts = UpOptions(out=args.out, model=args.model, workers=args.workers, trainers=args.trainers or 1,
                     cache_dir=args.cache_dir, threads=threads, timeout_s=args.timeout, red_team=red_team,
                     trainer_red_team=trainer_red_team, job_overrides=job,
                     job_file=args.job_file[0] if args.job_file else None,
                     worker_overrides=[f"backend={json.dumps(args.backend)}"], netns=args.netns, tls=args.tls,
                     eval_n=0 if args.no_eval else args.eval_n, **flags)
    if not args.job_file and opts.model is None:
        opts.model = "gemma"
    if len(sources) == 1:
        disagree = [] if run_up(opts)["adapter_hash_agreement"] else ["the job"]
    else:
        from swarmrl.node.local.many import run_up_many

        opts.trainers = args.trainers or len(sources)
        disagree = [name for name, j in run_up_many(opts, sources)["jobs"].items() if not j["adapter_hash_agreement"]]
    if disagree:   # a run whose replicas end on different adapters failed its check, whatever it learned
        from swarmrl.node.local.processes import SwarmFailed

        raise SwarmFailed(f"{', '.join(disagree)}: the trainers and workers ended on different adapters "
                          f"(summary.json: trainer_adapters, worker hashes); the summary and the adapter are in {args.out}")
    return 0


def _netns_missing() -> str | None:
    from swarmrl.node.local.netns import missing  # no torch: a missing tool is said at once

    return missing()


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Serve a trainer's job pages here until interrupted (each job's leaderboard from the
    books of the first trainer that hosts it)."""
    from swarmrl.node.audit.client import hosting_books
    from swarmrl.node.ops.dashboard import run_dashboard

    run_dashboard(args.trainer, args.host, args.port, args.job, books=hosting_books(args.trainer))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Score the base model and --adapter on held-out prompts of the job's task (greedy).

    Raises:
        UsageError: --adapter is not a PEFT adapter folder.
    """
    if not (args.adapter / "adapter_config.json").is_file():
        raise UsageError(f"--adapter {str(args.adapter)!r} is not a PEFT adapter folder (no adapter_config.json); "
                         "pass the --out of `swarmrl fetch` or the adapter/ folder of `swarmrl up`")
    from swarmrl.node.evaluation.heldout import run_eval

    run_eval(args.adapter, model=args.model, n=args.n, cache_dir=args.cache_dir, job_file=args.job_file,
             seed=args.seed)
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run the swarm simulator (simulations/); returns its exit code."""
    from swarmrl.simulations.run import main as simulate_main  # lazily: no torch, no hivemind

    return simulate_main(args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"keygen": cmd_keygen, "submit": cmd_submit, "status": status_command.cmd_status, "fetch": cmd_fetch, "up": cmd_up,
            "eval": cmd_eval, "dashboard": cmd_dashboard, "env": cmd_env, **{r: cmd_role for r in ROLES},
            "simulate": cmd_simulate, "audit": audit_command.run_audit}


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the command; returns the exit code (EPILOG).

    An expected failure (`cli_checks.describe_failure`) is printed as one line on stderr; anything
    else, or any failure with SWARMRL_TRACEBACK=1, propagates with its traceback.
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")  # models are prepared locally; never reach for a hub
    apply_native_defaults()
    args = build_parser().parse_args(argv)
    try:
        code = COMMANDS[args.command](args)
    except (Exception, KeyboardInterrupt) as exc:
        failure = describe_failure(exc, args)
        if failure is None or os.environ.get("SWARMRL_TRACEBACK") == "1":
            raise
        code, line = failure
        print(f"swarmrl {args.command}: {' '.join(line.split())}", file=sys.stderr)
    from swarmrl.node.runtime.lifecycle import exit_process

    exit_process(code)   # a role process ends here, without the interpreter's slow teardown (lifecycle)
    return code


if __name__ == "__main__":
    sys.exit(main())
