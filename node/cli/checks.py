"""The command line's checks and failures: arguments, job fields and files refused before any
work starts (`UsageError`), and every expected failure mapped to one line and an exit code.

Nothing here imports torch, transformers, hivemind or peft at module level, so a typo is
reported in a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from swarmrl.node.runtime import config as cfgmod
from swarmrl.protocol.red_team_modes import TRAINER_MODES

EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130   # node.cli.main's EPILOG says when each is returned

# `up` flags that set a job field (flag dest -> dotted job field)
UP_JOB_FLAGS = {"steps": "steps", "seed": "seed", "loss": "loss.variant", "max_async_level": "max_async_level"}
# job fields a submitter may not set: they follow from the base model (--model, `base_model = ...`)
DERIVED_JOB_FIELDS = ("base_model", "base_model_sha256")
THREAD_ROLES = ("trainer", "worker", "validator")   # the roles `up --threads` sets torch threads for


class UsageError(ValueError):
    """A bad argument, found before any work started; the message says what to change."""


# ---- argument types: each refuses a bad value with a message naming what is expected ----------


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `lo` (its name, "integer >= lo", is what argparse shows)."""

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


def positive_float(text: str) -> float:
    """An argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def endpoint(text: str) -> str:
    """An argparse type: a gRPC endpoint HOST:PORT with 0 < PORT < 65536 (returned unchanged)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 127.0.0.1:50051, from the trainer's ready "
                                         f"file or log), got {text!r}")
    return text


def sha256_hex(text: str) -> bytes:
    """An argparse type: a sha256 as 64 hex digits (e.g. a trainer's `tls_sha256`), as bytes."""
    try:
        digest = bytes.fromhex(text.strip())
    except ValueError:
        digest = b""
    if len(digest) != 32:
        raise argparse.ArgumentTypeError(f"expected a sha256 as 64 hex digits (the trainer's tls_sha256), got {text!r}")
    return digest


def existing_file(text: str) -> Path:
    """An argparse type: the path of a file that exists (not a folder)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{'is a folder' if path.is_dir() else 'no such file'}: {text!r}")
    return path


def nonempty(text: str) -> str:
    """An argparse type: any text but blank."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def model_name(text: str) -> str:
    """An argparse type: a base model name, as node.runtime.config checks it (built-in, folder or hub id)."""
    try:
        return cfgmod.check_base_model_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def unknown_option(parser: argparse.ArgumentParser, tokens: list[str]) -> str | None:
    """"unknown option --X; did you mean --Y?" for the first of `tokens` that argparse would take
    for an option `parser` lacks, else None. A parser with subcommands looks only before its
    command (the rest is its subcommand's); "--" ends the options."""
    import difflib

    has_commands = any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
    for token in tokens:
        if token == "--":
            return None
        parsed: Any = parser._parse_optional(token)   # None: a positional; else (action, ...) tuple(s)
        if parsed is None:
            if has_commands:
                return None
            continue
        if (parsed[0][0] if isinstance(parsed, list) else parsed[0]) is None:
            name = token.split("=", 1)[0]
            known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            return f"unknown option {name}" + (f"; did you mean {close[0]}?" if close else "")
    return None


# ---- checks before any work: each raises UsageError naming what to change ------------------------


def red_team_modes(text: str) -> tuple[list[str], str | None]:
    """`up --red-team`: "all" (every worker mode), or comma-separated mode names (blank: none):
    worker modes (an adversarial worker each) and at most one trainer mode (the first trainer
    cooks its credit books: `TRAINER_MODES`). Returns (worker modes, the trainer mode or None).

    Raises:
        UsageError: an unknown mode (the message lists the known ones), or two trainer modes.
    """
    if text == "all":
        return list(cfgmod.RED_TEAM_MODES), None
    names = [m.strip() for m in text.split(",") if m.strip()]
    trainer = [m for m in names if m in TRAINER_MODES]
    if len(trainer) > 1:
        raise UsageError(f"--red-team: one trainer mode at a time, got {', '.join(trainer)}")
    try:
        workers = [cfgmod.check_red_team_mode(m) for m in names if m not in TRAINER_MODES]
    except ValueError as exc:
        raise UsageError(f"--red-team: {exc}; trainer modes: {', '.join(TRAINER_MODES)}") from None
    return workers, trainer[0] if trainer else None


def parse_threads(text: str) -> dict[str, int]:
    """`up --threads`: "ROLE=N,..." as {role: torch threads}, roles from THREAD_ROLES (blank: {}).

    Raises:
        UsageError: a part that is not ROLE=N with a known ROLE and N >= 1.
    """
    threads: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        role, _, n = part.partition("=")
        if role not in THREAD_ROLES or not n.isdigit() or int(n) < 1:
            raise UsageError(f"--threads: {part!r} is not ROLE=N with ROLE one of {', '.join(THREAD_ROLES)} "
                             "and N >= 1 (e.g. trainer=2,worker=1)")
        threads[role] = int(n)
    return threads


def up_job_fields(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The -j overrides as a nested dict, and the UpOptions fields of the job flags.

    A flag and a -j override of the same job field are refused (the rule in node.cli.main's UP_EPILOG). A -j
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


def precheck_job_fields(fields: dict[str, Any], where: str) -> None:
    """Refuse unknown job fields and bad values before the base model is prepared (the full
    check, with the built-in job's defaults and cross-field rules, runs when the job is built)."""
    from swarmrl.protocol.jobspec import JobSpec

    try:
        JobSpec.model_validate({**fields, "base_model": "tiny", "base_model_sha256": "0" * 64})
    except ValidationError as exc:
        field_errors = [e for e in exc.errors() if e["loc"]]
        if field_errors:
            raise UsageError(f"{where}: {cfgmod.describe_validation_error(exc, JobSpec)}") from None


def precheck_job_file(path: Path, key: Path) -> None:
    """The job file's syntax, base model name and plain fields, before torch is imported (the
    data set and the rendered prompts are checked by `tasks.load_job_file` after)."""
    data = cfgmod.read_toml(path, "job file")
    try:
        cfgmod.check_base_model_name(str(data.pop("base_model", "tiny")))
    except ValueError as exc:
        raise UsageError(f"job file {path}: {exc}") from None
    _refuse_derived_fields(data, f"{path}")
    check_key_path(key)
    if not isinstance(data.get("environment"), dict):   # a data-set table is pinned and checked later
        precheck_job_fields(data, f"job file {path}")


def check_key_path(path: Path) -> None:
    """Refuse --key `path` unless it is a file, or it is missing and its folder is writable (the
    key is then created there)."""
    if path.exists() and not path.is_file():
        raise UsageError(f"--key {str(path)!r} is not a file")
    if not path.exists():
        check_writable(path.parent, "--key's folder")


def check_writable(path: Path, what: str) -> None:
    """Refuse `path` as an output folder when it (or the nearest folder above it that exists) is
    not a writable folder; nothing is created."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"{what} {str(path)!r}: {str(probe)!r} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {str(path)!r}: folder {str(probe)!r} is not writable")


# ---- failures as one line ------------------------------------------------------------------------


def _lazy_class(module: str, name: str) -> type | None:
    """The class `module.name` if that module was imported (if it was not, nothing raised it)."""
    return getattr(sys.modules.get(module), name, None)


def _failed_call(exc: BaseException, *codes: str) -> tuple[str, str] | None:
    """(status code name in lower case, details) when `exc` is a gRPC call that failed with one of
    `codes` (grpc.StatusCode names); None for anything else."""
    grpc = sys.modules.get("grpc")
    if grpc is None or not (isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call)):
        return None
    call: Any = exc   # a grpc.Call (grpc ships no type information)
    if call.code().name not in codes:
        return None
    return call.code().name.lower(), call.details()


def _unreachable(exc: BaseException) -> tuple[str, str] | None:
    """`_failed_call` for a peer that could not be reached (or did not answer in time)."""
    return _failed_call(exc, "UNAVAILABLE", "DEADLINE_EXCEEDED")


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
    if (unreachable := _unreachable(exc)) is not None:
        where = f"the trainer at {args.trainer}" if getattr(args, "trainer", None) else "a trainer"
        code, details = unreachable
        return EXIT_RUNTIME, (f"cannot reach {where} ({code}: {details}); "
                              "is it running, and is --trainer its HOST:PORT?")
    if (overloaded := _failed_call(exc, "RESOURCE_EXHAUSTED")) is not None:   # after grpc_retry's retries
        where = f"the trainer at {args.trainer}" if getattr(args, "trainer", None) else "the trainer"
        code, details = overloaded
        return EXIT_RUNTIME, f"{where} is overloaded ({code}: {details}); try again later"
    interrupted = _lazy_class("swarmrl.node.local.interrupt", "UpInterrupted")
    if interrupted is not None and isinstance(exc, interrupted):
        return int(exc.code), str(exc)   # type: ignore[attr-defined]
    swarm_failed = _lazy_class("swarmrl.node.local.processes", "SwarmFailed")
    if swarm_failed is not None and isinstance(exc, swarm_failed):
        return EXIT_RUNTIME, f"{str(exc).splitlines()[0]} (logs: {getattr(args, 'out', '.')}/run/logs/)"
    for module, name in (("swarmrl.node.swarm.dht", "SwarmError"), ("swarmrl.node.submitter.client", "SubmitterError"),
                         ("swarmrl.node.net.tls", "PinError")):
        cls = _lazy_class(module, name)
        if cls is not None and isinstance(exc, cls):
            return EXIT_RUNTIME, str(exc)
    return None
