"""`swarmrl`: one entrypoint per role, plus the submitter's commands and the local swarm.

    swarmrl keygen KEYFILE
    swarmrl bootstrap|trainer|worker|validator [--config FILE] [-o key=value ...] [--dry-run]
    swarmrl submit JOB.toml --trainer HOST:PORT
    swarmrl status JOB --trainer HOST:PORT
    swarmrl fetch JOB --trainer HOST:PORT --out DIR
    swarmrl up [JOB.toml] [--model tiny|gemma|FOLDER] [--steps N] [--workers K] [--out DIR] [-j FIELD=VALUE]
    swarmrl eval [JOB.toml] --adapter DIR
    swarmrl env list | swarmrl env check JOB.toml
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pydantic import BaseModel, ValidationError

from swarmrl.node import config as cfgmod


def _role_parser(sub: argparse._SubParsersAction, name: str, help_: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_)
    p.add_argument("--config", type=Path, help="TOML config file")
    p.add_argument("-o", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (dotted keys, JSON values), repeatable")
    p.add_argument("--initial-peers", nargs="*", default=None, metavar="MADDR", help="DHT peers to join")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    return p


def _resolve(cls: type[BaseModel], args: argparse.Namespace) -> BaseModel:
    overrides = list(args.overrides)
    if args.initial_peers is not None:
        overrides.append(f"net.initial_peers={json.dumps(args.initial_peers)}")
    return cfgmod.load_config(cls, args.config, overrides)


ROLES = {
    "bootstrap": (cfgmod.BootstrapConfig, "swarmrl.node.bootstrap", "a DHT peer others join through"),
    "trainer": (cfgmod.TrainerConfig, "swarmrl.node.trainer.main", "host jobs: leases, admission, GRPO steps"),
    "worker": (cfgmod.WorkerConfig, "swarmrl.node.worker.main", "generate, grade, sign and submit rollouts"),
    "validator": (cfgmod.ValidatorConfig, "swarmrl.validator.main", "re-check rollouts, score peers"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarmrl", description="peer-to-peer LoRA GRPO post-training")
    sub = parser.add_subparsers(dest="command", required=True)
    k = sub.add_parser("keygen", help="create an Ed25519 key file (mode 0600) and print its peer id")
    k.add_argument("path", type=Path)
    for name, (_, _, help_) in ROLES.items():
        _role_parser(sub, name, help_)
    s = sub.add_parser("submit", help="sign and submit a job TOML to a trainer")
    s.add_argument("job", type=Path)
    s.add_argument("--trainer", required=True, metavar="HOST:PORT")
    s.add_argument("--key", type=Path, default=Path("keys/submitter.key"))
    s.add_argument("--cache-dir", type=Path)
    st = sub.add_parser("status", help="show a job's progress and peers")
    st.add_argument("job_id")
    st.add_argument("--trainer", required=True, metavar="HOST:PORT")
    st.add_argument("--history", type=int, default=10)
    st.add_argument("--json", action="store_true")
    f = sub.add_parser("fetch", help="download a job's adapter in PEFT format")
    f.add_argument("job_id")
    f.add_argument("--trainer", required=True, metavar="HOST:PORT")
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--cache-dir", type=Path)
    up = sub.add_parser("up", help="run a whole local swarm on 127.0.0.1 and train a job file (or the built-in job)")
    up.add_argument("job_file", nargs="?", type=Path, help="JOB.toml, as `swarmrl submit` takes it")
    up.add_argument("--model", default=None, help="tiny | gemma (google/gemma-3-270m) | a model folder; "
                    "default: the job file's base_model, else gemma")
    up.add_argument("--steps", type=int)
    up.add_argument("--workers", type=int, default=2)
    up.add_argument("--trainers", type=int, default=1, help="trainers serving the job (they average gradients)")
    up.add_argument("--out", type=Path, default=Path("runs/latest"))
    up.add_argument("--loss", choices=["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
    up.add_argument("--max-async-level", type=int)
    up.add_argument("--seed", type=int, default=0)
    up.add_argument("--cache-dir", type=Path)
    up.add_argument("--timeout", type=float, default=3600.0, help="seconds before giving up")
    up.add_argument("--threads", default="", help="per role, e.g. trainer=2,worker=1")
    up.add_argument("--red-team", default="", help="adversarial workers, one per mode, comma-separated, or 'all': "
                    "forged_signature, replay, inflated_reward, fabricated_logprobs, random_tokens, "
                    "base_model_only, stale_version, prompt_swap, copycat, nan_logprobs")
    up.add_argument("-j", "--job", dest="job_overrides", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a built-in job field (JSON values), repeatable")
    e = sub.add_parser("eval", help="held-out greedy score: base model vs adapter")
    e.add_argument("job_file", nargs="?", type=Path, help="JOB.toml whose task to score (default: arithmetic)")
    e.add_argument("--adapter", type=Path, required=True)
    e.add_argument("--model", default=None, help="base model (default: from the adapter's config)")
    e.add_argument("--n", type=int, default=200)
    e.add_argument("--cache-dir", type=Path)
    _env_parser(sub)
    return parser


def _env_parser(sub: argparse._SubParsersAction) -> None:
    env = sub.add_parser("env", help="installed environments and reward functions; check a job's task")
    env_sub = env.add_subparsers(dest="env_command", required=True)
    env_sub.add_parser("list", help="installed environments and built-in reward functions")
    check = env_sub.add_parser("check", help="load a job's task, render 3 prompts as workers will, grade the answers")
    check.add_argument("job", type=Path)
    check.add_argument("--model", default=None, help="base model override (default: the job file's)")
    check.add_argument("--cache-dir", type=Path)
    check.add_argument("-n", type=int, default=3, help="prompts to show")


def cmd_env(args: argparse.Namespace) -> int:
    from swarmrl.node import env_cli

    return env_cli.env_list() if args.env_command == "list" else env_cli.env_check(args.job, args.model,
                                                                                     args.cache_dir, args.n)


def cmd_keygen(args: argparse.Namespace) -> int:
    from swarmrl.protocol.identity import Identity

    ident = Identity.generate()
    ident.save(args.path)
    print(ident.peer_id)
    return 0


def cmd_role(args: argparse.Namespace) -> int:
    import importlib

    cls, module, _ = ROLES[args.command]
    cfg = _resolve(cls, args)
    if args.dry_run:
        print(cfgmod.dump_config(cfg))
        return 0
    importlib.import_module(module).run(cfg)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
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
    from google.protobuf.json_format import MessageToDict
    from rich.console import Console
    from rich.table import Table

    from swarmrl.node.submitter import job_status

    st = job_status(args.trainer, args.job_id, history=args.history)
    if args.json:
        print(json.dumps(MessageToDict(st), indent=2))
        return 0
    console = Console()
    console.print(f"job {st.job_id}: {st.state}, step {st.step}/{st.total_steps}, version {st.policy_version}, "
                  f"admitted {st.groups_admitted}, dropped {st.groups_dropped}, rejected {dict(st.groups_rejected)}, "
                  f"validator checked {st.validator_checked} failed {st.validator_failed}, "
                  f"on probation {st.groups_on_probation}")
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
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from swarmrl.node.submitter import fetch_job_adapter

    version, h = fetch_job_adapter(args.trainer, args.job_id, args.out, args.cache_dir)
    print(f"adapter version {version} (sha256 {h.hex()}) written to {args.out}")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from swarmrl.node.local import UpOptions, run_up
    from swarmrl.node.worker.red_team import MODES, check_mode

    try:
        red_team = list(MODES) if args.red_team == "all" else [check_mode(m) for m in args.red_team.split(",") if m]
    except ValueError as exc:
        print(f"swarmrl up: {exc}", file=sys.stderr)
        return 2

    threads = {k: int(v) for k, v in (p.split("=") for p in args.threads.split(",") if p)}
    job: dict = {}
    for item in args.job_overrides:
        keys, value = cfgmod.parse_override(item)
        node = job
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    opts = UpOptions(out=args.out, model=args.model, steps=args.steps, workers=args.workers,
                     trainers=args.trainers, loss=args.loss,
                     max_async_level=args.max_async_level, seed=args.seed, cache_dir=args.cache_dir,
                     threads=threads, timeout_s=args.timeout,
                     red_team=red_team,
                     job_overrides=job, job_file=args.job_file)
    if args.job_file is None and opts.model is None:
        opts.model = "gemma"
    run_up(opts)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from swarmrl.node.evaluate import run_eval

    run_eval(args.adapter, model=args.model, n=args.n, cache_dir=args.cache_dir, job_file=args.job_file)
    return 0


COMMANDS = {"keygen": cmd_keygen, "submit": cmd_submit, "status": cmd_status, "fetch": cmd_fetch, "up": cmd_up,
            "eval": cmd_eval, "env": cmd_env, **{r: cmd_role for r in ROLES}}


def main(argv: list[str] | None = None) -> int:
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")  # models are prepared locally; never reach for a hub
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValidationError, ValueError, FileExistsError) as exc:
        print(f"swarmrl {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
