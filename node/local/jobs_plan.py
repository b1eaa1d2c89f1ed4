"""Which jobs one `swarmrl up` runs, checked before torch is imported: the job files given, then
`--jobs N` copies of the built-in job, each with a name (its folder under the run's out dir), a
seed offset, a weight and the trainer that hosts it.

    swarmrl up                       one built-in job (node/local/up.py, unchanged)
    swarmrl up A.toml                one job from the file (node/local/up.py)
    swarmrl up A.toml B.toml         two jobs, one swarm (node/local/many.py)
    swarmrl up --jobs 3              three copies of the built-in job, seeds s, s+1, s+2
    swarmrl up A.toml --jobs 1       the file's job and one built-in copy

A copy differs from the others by its seed (so by its prompts and its job id). Job i is hosted by
trainer i mod T (T = --trainers, default one per job): with fewer trainers than jobs a trainer
hosts several (a trainer process hosts any number of jobs, node/trainer/hosting.py); several
trainers averaging one job is the one-job `up`'s, so T above the number of jobs is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from swarmrl.protocol.market import MAX_WEIGHT


@dataclass(frozen=True)
class JobSource:
    """One job of an `up` run: `file` (None: the built-in job, seed + `seed_offset`), its folder
    `name`, its `weight` (None: the job's own, 1 unless the file says) and its `trainer` (index)."""

    name: str
    file: Path | None
    seed_offset: int
    weight: float | None
    trainer: int


def plan_jobs(files: list[Path], copies: int | None, weights: str, trainers: int | None,
              red_team: list[str]) -> list[JobSource]:
    """The jobs of one `up` run, in order (the job files, then the copies of the built-in job).

    files: the job files given; copies: `--jobs` (None: 1 when no file is given, else 0);
    weights: `--weights` ("" or one positive number per job, comma-separated); trainers:
    `--trainers` (None: its default).

    Raises:
        ValueError: a job file given twice, --weights with one job, weights that are not one positive number (at most
            MAX_WEIGHT) per job, more trainers than jobs, or the red-team drill with several jobs.
    """
    n_copies = copies if copies is not None else (0 if files else 1)
    seen: dict[Path, Path] = {}
    for f in files:
        key = f.resolve()
        if key in seen:
            raise ValueError(f"duplicate job: {seen[key]} and {f} are the same job file (give each job once)")
        seen[key] = f
    n = len(files) + n_copies
    parsed = parse_weights(weights, n)
    if n == 1:
        if weights.strip():
            raise ValueError("--weights is for several jobs (one job's weight shares nothing; -j weight=W sets it)")
        return [JobSource(files[0].stem if files else "job", files[0] if files else None, 0, None, 0)]
    if trainers is not None and trainers > n:
        raise ValueError(f"--trainers {trainers} with {n} jobs: each trainer hosts one job or more (several "
                         "trainers averaging one job is the one-job `up`'s)")
    if red_team:
        raise ValueError("--red-team runs with one job (give one job file, or none)")
    names = unique_names([f.stem for f in files] + [f"builtin-{i}" for i in range(n_copies)])
    t = trainers or n
    return [JobSource(names[i], files[i] if i < len(files) else None, i - len(files) if i >= len(files) else 0,
                      parsed[i], i % t) for i in range(n)]


def parse_weights(text: str, n: int) -> list[float | None]:
    """`--weights`: "" -> [None] * n (each job's own weight); else exactly `n` numbers in (0, MAX_WEIGHT].

    Raises:
        ValueError: another count, or a number that is not finite and in (0, MAX_WEIGHT].
    """
    if not text.strip():
        return [None] * n
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != n:
        raise ValueError(f"--weights {text!r}: {len(parts)} weights for {n} jobs (give one per job, job files first)")
    out: list[float | None] = []
    for p in parts:
        try:
            w = float(p)
        except ValueError:
            raise ValueError(f"--weights: {p!r} is not a number") from None
        if not (math.isfinite(w) and 0 < w <= MAX_WEIGHT):
            raise ValueError(f"--weights: {p} is not in (0, {MAX_WEIGHT:g}]")
        out.append(w)
    return out


def unique_names(names: list[str]) -> list[str]:
    """`names` with a repeated one suffixed "-2", "-3", ... (folders under the out dir must differ)."""
    out: list[str] = []
    for name in names:
        candidate, k = name, 1
        while candidate in out:
            k += 1
            candidate = f"{name}-{k}"
        out.append(candidate)
    return out
