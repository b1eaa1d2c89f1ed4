"""What an interrupted `swarmrl up` keeps: the run so far, saved from the stopped trainer's folder.

On SIGINT / SIGTERM `up` stops the roles first (`LocalSwarm.stop_all`), then `keep_what_it_did`
reads the first trainer's state folder, which nothing writes any more: the newest published
adapter (the nearest snapshot plus the deltas after it, `AdapterStore.state_at`, as every
replica rebuilds it) goes to `out/adapter` in PEFT format, the ledger's step rows to metrics.csv
and reward.png, and summary.json is marked `"interrupted": true`. A second signal can't cut
this short (`saving`), and a hard bound ends the process if saving ever hangs. A run that fails
(a role died, a timeout) keeps the same, with `"interrupted_by": "failure"`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmrl.node.local.processes import signal_handler
from swarmrl.node.local.summary import summarize, write_outputs
from swarmrl.node.models.card import write_model_card
from swarmrl.node.submitter.client import export_peft
from swarmrl.node.trainer.adapter_store import AdapterStore
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.node.trainer.status import fill_from_ledger
from swarmrl.protocol import adapter as ad
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

SAVE_BOUND_S = 30.0
"""Seconds stopping the roles and saving may take, at most, before the process exits hard: the
roles are gone by STOP_S; reading a stopped trainer's folder and writing a few files takes seconds."""


class Signalled(BaseException):
    """SIGTERM reached `up` (raised by its handler, as SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class UpInterrupted(Exception):
    """`up` was interrupted and has kept what it could: exit `code` (128 + the signal) after `line`."""

    def __init__(self, code: int, line: str) -> None:
        super().__init__(line)
        self.code, self.line = code, line


@dataclass(frozen=True)
class Kept:
    """What `keep_what_it_did` wrote: the adapter's version (None: no adapter stored yet), the
    steps reached of the job's total, and the file names under `out`."""

    version: int | None
    steps: int
    total_steps: int
    files: list[str]


@dataclass
class RunSoFar:
    """What `up` has reached, filled in as it goes: what an interrupt has to save."""

    out: Path
    keys: dict[str, Identity] = field(default_factory=dict)
    trainer_dir: Path | None = None   # the first trainer's state folder
    spec: JobSpec | None = None
    dataset: bytes | None = None      # the job's data set (a data-set job)
    job_id: str | None = None         # set once the job is submitted
    started: float = field(default_factory=time.monotonic)
    finished: bool = False            # the normal path wrote its outputs
    kept: Kept | None = None          # what an interrupt saved


def signal_of(exc: BaseException) -> int:
    """The signal behind an interrupt: SIGINT for KeyboardInterrupt, else `Signalled`'s."""
    return exc.signum if isinstance(exc, Signalled) else int(signal.SIGINT)


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM are ignored (a second Ctrl-C can't leave half the
    files written) and a C-level watchdog exits the process after SAVE_BOUND_S."""
    faulthandler.dump_traceback_later(SAVE_BOUND_S, exit=True)
    try:
        with signal_handler(signal.SIGINT, signal.SIG_IGN), signal_handler(signal.SIGTERM, signal.SIG_IGN):
            yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def warm_plotting() -> threading.Thread:
    """Import matplotlib's pyplot on a thread (a second or more on a loaded machine) while the
    roles stop, so reward.png does not wait for it."""
    thread = threading.Thread(target=importlib.import_module, args=("matplotlib.pyplot",), daemon=True)
    thread.start()
    return thread


def keep_what_it_did(run: RunSoFar, interrupted_by: str) -> Kept | None:
    """Save the run so far from the stopped trainer's folder into `run.out`; None when no job
    was submitted yet (nothing to keep)."""
    if run.job_id is None or run.spec is None or run.trainer_dir is None:
        return None
    spec, job_id, out = run.spec, run.job_id, run.out
    status, steps = ledger_status(run.trainer_dir / "ledger.sqlite", job_id, spec)
    version, state = newest_adapter(run.trainer_dir / "jobs" / job_id / "adapters", job_id, run.keys.get("trainer"))
    files = []
    adapter_hash = b""
    if state is not None and version is not None:
        adapter_hash = ad.adapter_hash(state)
        export_peft(state, spec, out / "adapter")
        write_model_card(out / "adapter", spec, job_id, version, steps, adapter_hash=adapter_hash)
        status.policy_version = status.step = version
        files.append("adapter")
    summary = summarize(status, spec, job_id, version or 0, adapter_hash, {}, run.keys,
                        time.monotonic() - run.started)
    summary.update(interrupted=True, interrupted_by=interrupted_by, total_steps=spec.steps,
                   adapter_hash_agreement=None, final_version=version)
    write_outputs(out, status, summary)
    files += ["metrics.csv", "reward.png", "summary.json"]
    return Kept(version, int(status.step), spec.steps, files)


def ledger_status(path: Path, job_id: str, spec: JobSpec) -> tuple[pb.JobStatus, list[dict[str, Any]]]:
    """The job's status as the trainer's ledger at `path` records it (every step row), and the
    step rows themselves; a ledger without the job gives an empty status."""
    st = pb.JobStatus(job_id=job_id, state="interrupted", total_steps=spec.steps)
    if not path.exists():
        return st, []
    ledger = Ledger(path, synchronous="normal")   # read by one process, the trainer stopped
    try:
        fill_from_ledger(st, ledger, job_id, history=spec.steps)
        rows = ledger.steps(job_id)
    finally:
        ledger.close()
    st.step = st.policy_version = max((h.policy_version for h in st.history), default=0)
    return st, rows


def newest_adapter(root: Path, job_id: str, identity: Identity | None) -> tuple[int | None, ad.State | None]:
    """(version, state) of the newest adapter stored under `root` (a trainer's per-job adapter
    folder), rebuilt as the store rebuilds it; (None, None) when nothing is stored."""
    if not root.is_dir():
        return None, None
    store = AdapterStore(root, job_id, identity or Identity.generate())   # signs nothing here
    for version in sorted({int(p.stem[1:]) for p in root.glob("[ds]*.hdr")}, reverse=True):
        state = store.state_at(version)
        if state is not None:
            return version, state
    return None, None


def interrupted_line(signum: int, run: RunSoFar) -> str:
    """The one line an interrupted `up` prints (after "swarmrl up: ")."""
    name = signal.Signals(signum).name
    if run.finished:
        return (f"interrupted by {name} after the job ended: its adapter, metrics.csv, reward.png and "
                f"summary.json are in {run.out} (no held-out figures)")
    if run.job_id is None:
        return f"interrupted by {name} before the job was submitted: nothing to keep"
    if run.kept is None:
        return f"interrupted by {name} while stopping the swarm: nothing was kept"
    return f"interrupted by {name} at step {run.kept.steps} of {run.kept.total_steps}: {_kept(run)}"


def failed_line(run: RunSoFar) -> str:
    """What a failed `up` kept, one line, said after the failure's own."""
    if run.kept is None:
        return "nothing was kept (no job submitted yet)"
    return f"the run reached step {run.kept.steps} of {run.kept.total_steps}: {_kept(run)}"


def _kept(run: RunSoFar) -> str:
    assert run.kept is not None
    what = f"the adapter of version {run.kept.version}, " if run.kept.version is not None else "no adapter (none stored), "
    return f"kept {what}metrics.csv, summary.json in {run.out}"
