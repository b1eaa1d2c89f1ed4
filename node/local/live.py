"""`swarmrl up`'s live status line, and the loop that follows the job until it is done.

On a terminal the line is a rich progress bar that redraws in place; in a log or a pipe it is a
plain line each time the step advances ("training 3/60 ..."). Its last figures are the snapshot
summary.json is written from (`LiveLine.finish`), so the two never disagree.
"""

from __future__ import annotations

import math
import time
from types import TracebackType
from typing import Protocol, Self

import grpc
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

from swarmrl.node.local.processes import LocalSwarm, SwarmFailed
from swarmrl.node.submitter.client import job_status
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb


class Sampler(Protocol):
    """Something sampled on every poll (`up.DiskWatch`)."""

    def sample(self) -> int:
        """Take one sample."""


def progress_info(st: pb.JobStatus) -> str:
    """The live status line's figures: the reward and staleness are the last step's (summary.json's
    `reward_last` is a mean over the last `reward_window` steps)."""
    rejected = sum(st.groups_rejected.values())
    last = st.history[-1] if st.history else None
    reward = f"{last.reward_mean:.3f}" if last and not math.isnan(last.reward_mean) else "-"
    stale = f"{last.staleness_mean:.2f}" if last else "-"
    return (f"v{st.policy_version}  last step: reward {reward}, staleness {stale}  groups: {st.groups_admitted} "
            f"admitted, {rejected} rejected, {st.validator_checked} checked"
            + (f", {st.groups_on_probation} on probation" if st.groups_on_probation else ""))


class LiveLine:
    """The status line of one job of `total_steps` steps, shown on `console` while the block runs.
    The line wraps rather than being cut at the terminal's width."""

    def __init__(self, console: Console, total_steps: int) -> None:
        self.console, self.total = console, total_steps
        columns = [TextColumn("[bold]training"), BarColumn(bar_width=16), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[info]}", table_column=Column(ratio=1, no_wrap=False, overflow="fold"))]
        self.progress = Progress(*columns, console=console, transient=False, expand=True,
                                 disable=not console.is_terminal)   # a log gets the plain lines alone
        self.task = self.progress.add_task("steps", total=total_steps, info="waiting for rollouts")
        self.printed_step = -1
        self.last: pb.JobStatus | None = None

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.progress.stop()

    def show(self, st: pb.JobStatus) -> None:
        """Show `st`'s figures (off a terminal: print them when the step has advanced)."""
        self.last = st
        self.progress.update(self.task, completed=st.step, info=progress_info(st))
        if not self.console.is_terminal and st.step != self.printed_step:
            self.print_plain(st)

    def finish(self, st: pb.JobStatus) -> None:
        """Show the final snapshot `st`, the one the summary is written from, whatever was shown."""
        self.last = st
        self.progress.update(self.task, completed=st.step, info=progress_info(st))
        if not self.console.is_terminal:
            self.print_plain(st)

    def print_plain(self, st: pb.JobStatus) -> None:
        """Print the line once, as text (a log or a pipe)."""
        self.printed_step = st.step
        self.progress.console.print(f"training {st.step}/{self.total}  {progress_info(st)}", markup=False,
                                    highlight=False, soft_wrap=True)


STATUS_ERRORS_IN_A_ROW = 5   # a trainer's status error (a bug there) fails the run only when it persists


def follow(swarm: LocalSwarm, endpoint: str, job_id: str, spec: JobSpec, timeout_s: float, live: LiveLine,
           watch: list[str] | None = None, disk: Sampler | None = None) -> pb.JobStatus:
    """Show live progress until the job is done; returns the final status (full history)."""
    deadline = time.monotonic() + timeout_s
    failed = 0   # status calls in a row that the trainer answered with an error
    while True:
        swarm.check_alive(watch or ["bootstrap", "trainer", "validator"])
        try:
            st = job_status(endpoint, job_id, history=1)
        except grpc.RpcError as exc:   # a busy trainer on a loaded machine (transient): ask again;
            transient = exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
            failed = 0 if transient else failed + 1   # its death is check_alive's to report
            if failed > STATUS_ERRORS_IN_A_ROW:
                raise SwarmFailed(f"the trainer's status failed {failed} times in a row: {exc.code().name}: "
                                  f"{exc.details()}") from exc
            live.console.print(f"[yellow]status:[/] {exc.code().name}"
                               f"{'' if transient else ': ' + str(exc.details())}; asking again")
            if time.monotonic() > deadline:
                raise SwarmFailed(f"job not done after {timeout_s:.0f}s (trainer not answering)") from exc
            time.sleep(2.0)
            continue
        failed = 0
        live.show(st)
        if disk is not None:
            disk.sample()
        if st.state == "done":
            return job_status(endpoint, job_id, history=spec.steps)
        if time.monotonic() > deadline:
            raise SwarmFailed(f"job not done after {timeout_s:.0f}s (step {st.step}/{st.total_steps})")
        time.sleep(0.5)
