"""The swarm against TRL's GRPOTrainer: same job, same machine, held-out accuracy over wall time.

Per seed, the built-in arithmetic job on `--model` runs twice: (a) TRL 1.16 `GRPOTrainer` with
peft LoRA in this process, (b) `swarmrl up` (its own processes: a trainer, workers, a validator)
on the same cores. Both take the job's settings (`trl_settings` maps each JobSpec field to
GRPOConfig and lists what can't be matched, and how it was matched instead). Adapters are taken
at fixed wall-clock checkpoints from the start of training (TRL: `train()` begins, model
loaded; swarm: the trainer hosts the job, every process started and models loaded), and after
the last step; a run that finished before a checkpoint counts its final adapter there. TRL trains
`--steps` steps or until `--budget` wall seconds (default: the last checkpoint), whichever comes
first: on CPU with Gemma's 262k-token vocabulary a TRL step takes minutes. Where only the swarm
reaches the target, the ratio is bounded: at most the swarm's time / TRL's training time. Every
adapter is scored afterwards by the same code (`node.evaluation.heldout.evaluate`: greedy, the held-out
prompts, the environment's correctness reward) on the same backend.

Printed and written to OUT/results.json and OUT/table.md: per seed and as mean and spread
(sample std, min-max) over seeds, for each side: wall seconds per step, generated tokens/s end
to end (completion tokens sampled / training wall time), held-out accuracy at each checkpoint,
time to reach `--target` accuracy (first checkpoint at or above it), and the ratio swarm / TRL
of that time (goal <= 1). A seed whose OUT/seedN/report.json exists is read back, not run again,
so an interrupted study resumes at the seed it was on. Needs the `trl` extra (`pip install -e '.[trl]'`).

    .venv/bin/python benchmarks/vs_trl.py --model tiny --seeds 0 --steps 4 --checkpoints 30,60 \
        --target 0.1 --n-eval 16 --out runs/vs_trl_tiny
    .venv/bin/python benchmarks/vs_trl.py --model gemma --seeds 0,1,2 --steps 60 \
        --checkpoints 150,300,450,600,750 --target 0.7 --n-eval 200 --out runs/vs_trl

Legend: G = completions per prompt, B = groups per step.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmrl.protocol.jobspec import JobSpec

if __package__ in (None, ""):   # run as a script: benchmarks/ is sys.path[0], the repository root is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.vs_trl_figures import accuracy_by_checkpoint, ratio, ratio_bound, summary, time_to_target

# GSPO is TRL's GRPO loss at sequence-level importance sampling.
TRL_LOSS = {"grpo": "grpo", "dapo": "dapo", "dr_grpo": "dr_grpo", "gspo": "grpo", "cispo": "cispo"}


@dataclass(frozen=True)
class Mismatch:
    """A setting one side can't express as the other does, and what was done about it."""

    setting: str
    swarm: str
    trl: str
    how: str


def trl_settings(spec: JobSpec) -> tuple[dict[str, Any], list[Mismatch]]:
    """GRPOConfig keyword arguments for `spec`, and the settings that could not be matched exactly.

    One swarm step = one TRL optimizer step over one generation batch of B prompts x G
    completions (steps_per_generation=1, num_iterations=1, no gradient accumulation), so both
    sides are on-policy up to the swarm's asynchrony.
    """
    loss = spec.loss
    kwargs: dict[str, Any] = {
        "num_generations": spec.group_size,
        "per_device_train_batch_size": spec.group_size * spec.batch_max,
        "gradient_accumulation_steps": 1, "steps_per_generation": 1, "num_iterations": 1,
        "max_steps": spec.steps, "seed": spec.seed, "data_seed": spec.seed, "shuffle_dataset": False,
        "learning_rate": spec.learning_rate, "lr_scheduler_type": "constant", "warmup_steps": 0,
        "adam_beta1": 0.9, "adam_beta2": 0.99, "weight_decay": spec.weight_decay,
        "max_grad_norm": spec.max_grad_norm,
        "max_completion_length": spec.sampling.max_new_tokens, "temperature": spec.sampling.temperature,
        "top_p": spec.sampling.top_p, "top_k": 0,
        "loss_type": TRL_LOSS[loss.variant],
        "importance_sampling_level": "sequence" if loss.variant == "gspo" else "token",
        "epsilon": loss.eps_low, "epsilon_high": loss.effective_eps_high, "beta": loss.kl_beta,
        "scale_rewards": "group" if loss.advantage_scale == "std" else "none",
        "mask_truncated_completions": loss.mask_truncated,
        "disable_dropout": True, "gradient_checkpointing": False, "bf16": False,
        "use_cpu": True, "logging_steps": 1, "save_strategy": "no", "report_to": [],
        "remove_unused_columns": False, "dataloader_num_workers": 0,
    }
    if loss.variant == "dr_grpo" and loss.loss_constant not in (None, spec.sampling.max_new_tokens):
        raise ValueError("TRL's dr_grpo divides by max_completion_length; loss_constant must be unset")
    return kwargs, mismatches(spec)


def mismatches(spec: JobSpec) -> list[Mismatch]:
    """What `trl_settings` could not express exactly for `spec`."""
    loss = spec.loss
    rows = [
        Mismatch("stop strings", f"sampling.stop={list(spec.sampling.stop)}: the completion ends after the token "
                 "that completes the first stop string", "no stop strings in GRPOConfig (generate's stop_strings "
                 "needs the tokenizer at call time)", "every token whose text contains a stop string is an EOS id "
                 "of the model's generation config (TRL ends and masks there, keeping it); exact for one-character "
                 "stops such as the built-in '\\n'"),
        Mismatch("asynchrony", f"max_async_level={spec.max_async_level}: rollouts may lag the head by that many "
                 "versions (importance ratio to the sampler's log-probs)", "on-policy: generates with the current "
                 "weights each step", "not matched: it is the swarm's design; staleness is in the swarm's metrics.csv"),
        Mismatch("zero-variance groups", f"loss.drop_zero_variance_groups={loss.drop_zero_variance_groups}: "
                 "left out of the token/sequence denominators", "kept (advantage 0) in the denominators",
                 "not matched: the same gradient direction, a larger per-token scale on the swarm's side"
                 if loss.drop_zero_variance_groups else "matched (both keep them)"),
        Mismatch("failed grades", "reward NaN: the completion is masked out of the loss", "reward None counts as 0 "
                 "(nansum)", "not matched; the arithmetic rewards do not fail"),
        Mismatch("LoRA dropout", f"lora.dropout={spec.lora.dropout}: kept in the adapter config, off in every "
                 "scoring pass (the learner stays in eval mode)", "dropout on in training mode",
                 "disable_dropout=True (dropout off, as the swarm scores)"),
        Mismatch("prompt order", "leases hand out prompt indices 0, 1, 2, ... to whichever worker asks",
                 "a data set of the same indices in order, shuffle_dataset=False",
                 "the same prompts per step up to the order in which workers' leases finish"),
        Mismatch("sampling log-probs", "the worker's sampler (HF generate) records them; the trainer's ratio is "
                 "against them", "recomputed by the trainer before the step (old = current at one iteration)",
                 "not matched; the ratio is 1 either way when on-policy"),
        Mismatch("activation checkpointing", "none: the learner keeps activations (LoRA on a small model)",
                 "gradient_checkpointing=True by default", "gradient_checkpointing=False"),
        Mismatch("mixed precision", "none: base weights in the model's dtype (bf16 Gemma, fp32 tiny), LoRA in fp32",
                 "bf16=True by default (autocast)", "bf16=False: the model as loaded, as the swarm runs it"),
        Mismatch("clock start", "the trainer hosts the job: all processes started, models loaded",
                 "train() begins: model loaded", "both exclude start-up; eval is outside both clocks"),
    ]
    if loss.tis_cap is not None:
        rows.append(Mismatch("TIS cap", f"loss.tis_cap={loss.tis_cap}", "vllm_importance_sampling_cap (vLLM only)",
                             "not matched: TRL applies it only with vLLM generation"))
    return rows


def stop_token_ids(tokenizer: Any, stops: tuple[str, ...]) -> list[int]:
    """Ids of the vocabulary's tokens whose text contains one of `stops`."""
    if not stops:
        return []
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=True)
    return [i for i, text in enumerate(texts) if any(s in text for s in stops)]


def trl_prompt_text(tokenizer: Any, text: str, ids: list[int]) -> str:
    """The text that TRL's tokenizer call (`tokenizer(text)`, special tokens added) turns into the
    swarm's prompt `ids` (BOS exactly once). Raises ValueError when none does."""
    for candidate in (text, (tokenizer.bos_token or "") + text):
        if list(tokenizer(candidate)["input_ids"]) == ids:
            return candidate
    raise ValueError(f"no prompt text tokenizes to the swarm's ids for {text!r}")


@dataclass
class ArmResult:
    """One side's run of one seed: adapters taken at wall times, and its throughput."""

    adapters: list[tuple[float, Path]] = field(default_factory=list)
    wall_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    t0_unix: float | None = None   # swarm: when the trainer began hosting the job

    def figures(self) -> dict[str, float]:
        """Seconds per step and generated tokens per second."""
        return {"s_per_step": self.wall_s / self.steps if self.steps else math.nan,
                "tokens_per_s": self.tokens / self.wall_s if self.wall_s else math.nan}


# ---- TRL
def run_trl(spec: JobSpec, model_path: Path, checkpoints: list[float], out: Path, budget_s: float) -> ArmResult:
    """Train `spec` with TRL's GRPOTrainer + peft in this process; adapters at the checkpoints.
    Training stops after `spec.steps` steps or at the first step end past `budget_s` wall seconds."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from swarmrl.node.models.causal_lm import load_causal_lm, lora_config, render_prompt
    from swarmrl.protocol.envs import get_environment

    env = get_environment(spec.environment_id, spec.env_version)
    model, tokenizer = load_causal_lm(model_path)
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
    model.generation_config.eos_token_id = sorted({*eos_ids, *stop_token_ids(tokenizer, tuple(spec.sampling.stop))})
    prompts = env.prompts(spec.seed, range(spec.steps * spec.batch_max))
    by_index = {p.index: p for p in prompts}
    rows = [{"prompt": trl_prompt_text(tokenizer, p.text, render_prompt(tokenizer, p, spec.chat_template)),
             "index": p.index} for p in prompts]

    def reward(prompts: list[str], completions: list[str], index: list[int], **_: Any) -> list[float | None]:
        specs = [by_index[i] for i in index]
        return [env.total(r) for r in env.rewards(specs, completions)]

    kwargs, _ = trl_settings(spec)
    result = ArmResult()
    clock = _TrlClock(checkpoints, out, result, budget_s)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, processing_class=tokenizer,
                          args=GRPOConfig(output_dir=str(out / "trainer"), **kwargs),
                          train_dataset=Dataset.from_list(rows), callbacks=[clock.callback(TrainerCallback)],
                          peft_config=lora_config(spec.lora.rank, spec.lora.alpha, spec.lora.dropout,
                                                  spec.lora.target_modules))
    clock.trainer = trainer
    trainer.train()
    result.wall_s, result.steps = clock.elapsed(), trainer.state.global_step
    if clock.saved_step != trainer.state.global_step:   # else the last checkpoint is the final adapter
        clock.save("final")
    result.tokens = int(sum(h.get("completions/mean_length", 0.0) * spec.group_size * spec.batch_max
                            for h in trainer.state.log_history))
    return result


class _TrlClock:
    """Training wall time (adapter saves excluded) and adapters saved as checkpoints pass."""

    def __init__(self, checkpoints: list[float], out: Path, result: ArmResult, budget_s: float) -> None:
        self.pending, self.out, self.result, self.budget_s = sorted(checkpoints), out, result, budget_s
        self.t0, self.paused, self.trainer, self.saved_step = 0.0, 0.0, None, -1

    def elapsed(self) -> float:
        return time.monotonic() - self.t0 - self.paused

    def save(self, label: str) -> None:
        t, s0 = self.elapsed(), time.monotonic()
        path = self.out / f"adapter-{label}"
        assert self.trainer is not None
        self.trainer.model.save_pretrained(str(path))
        self.result.adapters.append((t, path))
        self.saved_step = self.trainer.state.global_step
        self.paused += time.monotonic() - s0

    def callback(self, base: type) -> Any:
        clock = self

        class Clock(base):  # type: ignore[misc, valid-type]
            def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
                clock.t0 = time.monotonic()

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                while clock.pending and clock.elapsed() >= clock.pending[0]:
                    clock.save(f"{clock.pending.pop(0):g}s")
                if clock.elapsed() >= clock.budget_s:
                    control.should_training_stop = True
        return Clock()


# ---- swarm
def run_swarm(spec: JobSpec, model: str, checkpoints: list[float], out: Path, timeout_s: float) -> ArmResult:
    """`swarmrl up` on the built-in job with `spec`'s steps and seed; adapters copied from the
    trainer's newest checkpoint as the wall-clock checkpoints pass."""
    run_dir = out / "up"
    shutil.rmtree(run_dir, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(Path(sys.executable).with_name("swarmrl")), "up", "--model", model, "--steps", str(spec.steps),
           "--seed", str(spec.seed), "--out", str(run_dir), "--timeout", str(timeout_s), "--no-eval"]   # it scores its own checkpoints
    result, stop = ArmResult(), threading.Event()
    watcher = threading.Thread(target=_watch_swarm, args=(run_dir, spec, sorted(checkpoints), out, result, stop))
    watcher.start()
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=(out / "up.log").open("w"))
    finally:
        stop.set()
        watcher.join()
    _swarm_figures(run_dir, result)
    _export(run_dir / "adapter", result.wall_s, out / "adapter-final", result)
    return result


def _watch_swarm(run_dir: Path, spec: JobSpec, pending: list[float], out: Path, result: ArmResult,
                 stop: threading.Event) -> None:
    t0, job_dir = 0.0, None
    while not stop.is_set():
        if job_dir is None and (found := sorted(run_dir.glob("run/*/jobs/*/adapters"))):
            t0, result.t0_unix, job_dir = time.monotonic(), time.time(), found[0].parent
        while job_dir is not None and pending and time.monotonic() - t0 >= pending[0]:
            c = pending.pop(0)
            _copy_checkpoint(job_dir / "checkpoints", spec, time.monotonic() - t0, out / f"adapter-{c:g}s", result)
        stop.wait(0.2)


def _copy_checkpoint(folder: Path, spec: JobSpec, t: float, dest: Path, result: ArmResult) -> None:
    """The trainer's newest checkpoint as a PEFT adapter folder (retried: it prunes as it goes)."""
    from safetensors.torch import save_file

    from swarmrl.node.models.causal_lm import lora_config
    from swarmrl.node.trainer.checkpoint import load_checkpoint

    for _ in range(20):
        try:
            ckpt = load_checkpoint(folder)
        except (FileNotFoundError, ValueError):
            time.sleep(0.05)
            continue
        if ckpt is None:
            break
        dest.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in ckpt.state.items()}, str(dest / "adapter_model.safetensors"))
        lora_config(spec.lora.rank, spec.lora.alpha, spec.lora.dropout, spec.lora.target_modules) \
            .save_pretrained(str(dest))
        result.adapters.append((t, dest))
        return


def _swarm_figures(run_dir: Path, result: ArmResult) -> None:
    """Training wall time (hosting the job -> last step), steps and tokens from metrics.csv."""
    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    summary = json.loads((run_dir / "summary.json").read_text())
    result.steps = len(rows)
    end = float(rows[-1]["time"]) if rows else math.nan
    result.wall_s = end - result.t0_unix if result.t0_unix else math.nan
    result.tokens = swarm_tokens(run_dir / "run" / "trainer" / "ledger.sqlite", summary["job_id"], end)


def swarm_tokens(ledger_path: Path, job_id: str, until_unix: float) -> int:
    """Completion tokens of the batches the trainer admitted up to its last step (its ledger)."""
    from swarmrl.node.trainer.ledger import Ledger
    from swarmrl.protocol.pb import swarm_pb2 as pb

    ledger = Ledger(ledger_path)
    try:
        batches = [pb.RolloutBatch.FromString(env.body) for _, _, env in ledger.batches_after(job_id, 0, 10**9)]
    finally:
        ledger.close()
    return sum(len(c.token_ids) for b in batches if b.created_ms <= until_unix * 1000
               for g in b.groups for c in g.completions)


def _export(folder: Path, t: float, dest: Path, result: ArmResult) -> None:
    if folder.exists():
        shutil.copytree(folder, dest, dirs_exist_ok=True)
        result.adapters.append((t, dest))


# ---- evaluation and the report
def evaluate_adapters(model_path: Path, spec: JobSpec, arms: dict[str, ArmResult], n: int) -> dict[str, Any]:
    """Held-out greedy accuracy of the base model and of every adapter, by `node.evaluation.heldout.evaluate`."""
    from swarmrl.node.evaluation.heldout import evaluate, load_adapter
    from swarmrl.node.inference import build_backend
    from swarmrl.protocol.envs import get_environment, heldout_prompts

    backend = build_backend("hf", model_path)
    env = get_environment(spec.environment_id, spec.env_version)
    prompts = heldout_prompts(env, n, spec.seed)
    score = lambda adapter: evaluate(backend, env, prompts, adapter, spec.sampling.max_new_tokens,
                                     tuple(spec.sampling.stop), spec.chat_template).accuracy
    curves: dict[str, list[tuple[float, float]]] = {"base": [(0.0, score(None))]}
    for side, arm in arms.items():
        curves[side] = [(0.0, curves["base"][0][1])]
        for k, (t, path) in enumerate(arm.adapters):
            name = f"{side}-{k}"
            load_adapter(backend, name, path)
            curves[side].append((t, score(name)))
            backend.remove_adapter(name)
    return curves


def seed_report(curves: dict[str, list[tuple[float, float]]], arms: dict[str, ArmResult],
                checkpoints: list[float], target: float) -> dict[str, Any]:
    """One seed's figures for both sides."""
    out: dict[str, Any] = {"base_accuracy": curves["base"][0][1]}
    for side, arm in arms.items():
        curve = sorted(curves[side])
        out[side] = {**arm.figures(), "steps": arm.steps, "wall_s": arm.wall_s,
                     "final_accuracy": curve[-1][1],
                     "accuracy_at": accuracy_by_checkpoint(curve, checkpoints),
                     "time_to_target_s": time_to_target(curve, target), "curve": curve}
    out["time_to_target_ratio"] = ratio(out["swarm"]["time_to_target_s"], out["trl"]["time_to_target_s"])
    out["time_to_target_ratio_at_most"] = ratio_bound(out["swarm"], out["trl"])
    return out


def markdown(result: dict[str, Any], spec: JobSpec) -> str:
    """The comparison as markdown tables (figures, then the settings that could not be matched)."""
    fmt = lambda s: "-" if s["mean"] is None else (f"{s['mean']:.3g} ± {s['std']:.2g} "
                                                   f"({s['min']:.3g}-{s['max']:.3g}, n={s['n']})")
    summ, lines = result["summary"], ["| figure | swarm | TRL |", "|---|---|---|"]
    for key, label in (("s_per_step", "wall s / step"), ("tokens_per_s", "generated tokens/s"), ("steps", "steps"),
                       ("final_accuracy", "held-out accuracy, final"), ("time_to_target_s",
                                                                         f"s to accuracy {result['target']}")):
        lines.append(f"| {label} | {fmt(summ['swarm'][key])} | {fmt(summ['trl'][key])} |")
    for c, s in summ["swarm"]["accuracy_at"].items():
        lines.append(f"| held-out accuracy at {c} s | {fmt(s)} | {fmt(summ['trl']['accuracy_at'][c])} |")
    ratio_line = (f"\nbase accuracy {fmt(summ['base_accuracy'])}; time-to-target ratio swarm/TRL "
                  f"{fmt(summ['time_to_target_ratio'])}; where only the swarm reached the target, the ratio is "
                  f"at most {fmt(summ['time_to_target_ratio_at_most'])}\n")
    lines += [ratio_line, "| setting | swarm | TRL | how matched |", "|---|---|---|---|"]
    lines += [f"| {m.setting} | {m.swarm} | {m.trl} | {m.how} |" for m in mismatches(spec)]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=None, help="default: the built-in job's")
    p.add_argument("--checkpoints", default="150,300,450,600,750", help="wall seconds, comma-separated")
    p.add_argument("--target", type=float, default=0.7)
    p.add_argument("--n-eval", type=int, default=200)
    p.add_argument("--budget", type=float, default=None,
                   help="wall seconds each TRL run may train (default: the last checkpoint)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the TRL process")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per swarm run")
    p.add_argument("--cache-dir", type=Path)
    p.add_argument("--out", type=Path, default=Path("runs/vs_trl"))
    args = p.parse_args()
    import torch

    from swarmrl.node.models.base_model import prepare_base_model, resolve_model_name
    from swarmrl.node.tasks.builtin_jobs import builtin_job

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    name = resolve_model_name(args.model)
    model_path = prepare_base_model(name, args.cache_dir)
    checkpoints = [float(c) for c in args.checkpoints.split(",")]
    per_seed: dict[int, dict[str, Any]] = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        spec = builtin_job(name, args.cache_dir, seed=seed, steps=args.steps)
        out = args.out / f"seed{seed}"
        if (kept := out / "report.json").exists():  # a finished seed is not run again
            per_seed[seed] = json.loads(kept.read_text())
            for side in ("swarm", "trl"):   # this run's checkpoints, from the kept curves
                curve = [(t, acc) for t, acc in per_seed[seed][side]["curve"]]
                per_seed[seed][side]["accuracy_at"] = accuracy_by_checkpoint(curve, checkpoints)
            print(f"seed {seed}: kept from {kept}")
            continue
        torch.manual_seed(seed)
        arms = {"trl": run_trl(spec, model_path, checkpoints, out / "trl", args.budget or max(checkpoints)),
                "swarm": run_swarm(spec, args.model, checkpoints, out / "swarm", args.timeout)}
        curves = evaluate_adapters(model_path, spec, arms, args.n_eval)
        per_seed[seed] = seed_report(curves, arms, checkpoints, args.target)
        kept.write_text(json.dumps(per_seed[seed], indent=2, default=str))
        print(json.dumps({"seed": seed, **{k: v for k, v in per_seed[seed].items()}}, default=str))
    result = {"model": name, "target": args.target, "checkpoints": checkpoints, "per_seed": per_seed,
              "summary": summary(per_seed, checkpoints), "settings": trl_settings(spec)[0]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    (args.out / "table.md").write_text(markdown(result, spec))
    print(markdown(result, spec))


if __name__ == "__main__":
    main()
