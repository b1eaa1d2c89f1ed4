"""The learner: turns a batch of admitted groups into one LoRA GRPO optimizer step.

Legend: B = completions in the batch, T = completion tokens (right-padded), G = group size.
The policy-gradient math lives in swarmrl.protocol.grpo (pure functions); this file only builds
the tensors from the wire groups, runs the forward/backward pass and the optimizer.

There is one step (`Learner.step`) for a lone trainer and for several trainers of a job: between
the backward pass and the optimizer it hands the gradients to a `GradientReducer`, the identity
(`protocol.grpo.reduce.LocalReduce`) alone or hivemind averaging with cotrainers (`node.swarm.job_swarm`), as
TorchTitan reduces gradients with a hook instead of a second training loop.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict

from swarmrl.node.inference.device import load_on_device
from swarmrl.node.inference.scoring import completion_logprobs, shared_prompt_logprobs
from swarmrl.node.models.causal_lm import lora_config, with_lora
from swarmrl.protocol import adapter as ad
from swarmrl.protocol.grpo import (
    LossNormalizer,
    group_advantages,
    logprob_drift,
    policy_loss,
    staleness_histogram,
)
from swarmrl.protocol.grpo.reduce import GradientReducer, LocalReduce
from swarmrl.protocol.grpo.traces import model_mask_T
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

MICRO_BATCH_TOKENS = 2048
"""Decoder positions (prompt + completion tokens of whole groups) per forward/backward pass: a
long-completion step runs in several passes whose activations fit in memory, with the same loss
and gradients. Gemma 270M keeps ~1.7 MB a position for backward: a step of 4 groups of 8
completions of ~173 tokens over 407-token prompts (7,164 positions) peaked at 13.0 GB in one pass
(8192, the budget before) and at 6.6 GB in 4 passes of one group, 0.85x the seconds
(benchmarks/step_memory.py); the built-in job's step (at most 864 positions) is one pass either way.
The budget is for 2-byte weights: a float32 model (a CPU without native bf16, `device.py`) gets
half the positions a pass."""


def micro_batches(batch: StepBatch, max_tokens: int) -> list[tuple[int, int]]:
    """Row spans [lo, hi) of whole groups (rows sharing a prompt), each of at most `max_tokens`
    prompt + completion tokens unless a single group is larger; in order, covering every row."""
    spans: list[tuple[int, int]] = []
    lo, used, i, rows = 0, 0, 0, len(batch.completion_ids)
    while i < rows:
        j = i
        while j < rows and batch.prompt_ids[j] == batch.prompt_ids[i]:
            j += 1
        cost = len(batch.prompt_ids[i]) + sum(len(c) for c in batch.completion_ids[i:j])
        if used and used + cost > max_tokens:
            spans.append((lo, i))
            lo, used = i, 0
        used += cost
        i = j
    if rows:
        spans.append((lo, rows))
    return spans


@dataclass
class StepBatch:
    """Tensors of one step, built from wire groups (see `build_step_batch`)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    old_logprobs_BT: torch.Tensor
    mask_BT: torch.Tensor
    advantages_B: torch.Tensor
    rewards: list[float] = field(default_factory=list)       # valid rewards of every completion
    staleness: list[int] = field(default_factory=list)       # versions behind, per completion
    groups_total: int = 0
    groups_zero_variance: int = 0
    failed_grades: int = 0


def build_step_batch(groups: list[pb.Group], spec: JobSpec, current_version: int) -> StepBatch:
    """Group-relative advantages and padded tensors for the groups that carry signal.

    Zero-variance groups are counted; with `loss.drop_zero_variance_groups` they are left out
    of the loss (DAPO dynamic sampling, Yu et al. 2025). Completions with a failed grade (NaN
    reward) and, with `loss.mask_truncated`, completions cut by the length limit are masked.
    """
    cfg = spec.loss
    out = StepBatch([], [], torch.empty(0), torch.empty(0), torch.empty(0), groups_total=len(groups))
    olds: list[list[float]] = []
    masks: list[list[bool]] = []
    advs: list[float] = []
    for g in groups:
        rewards_G = torch.tensor([c.reward for c in g.completions], dtype=torch.float32)
        ga = group_advantages(rewards_G, scale=cfg.advantage_scale)
        out.failed_grades += int((~ga.valid_G).sum())
        out.rewards.extend(float(r) for r in rewards_G[ga.valid_G])
        out.staleness.extend(current_version - c.policy_version for c in g.completions)
        if ga.zero_variance:
            out.groups_zero_variance += 1
            if cfg.drop_zero_variance_groups:
                continue
        for c, adv, valid in zip(g.completions, ga.advantages_G.tolist(), ga.valid_G.tolist()):
            keep = bool(valid) and not (cfg.mask_truncated and c.finish_reason == "length")
            out.prompt_ids.append(list(g.prompt_token_ids))
            out.completion_ids.append(list(c.token_ids))
            olds.append(list(c.logprobs))
            masks.append(model_mask_T(c.token_mask, len(c.token_ids), keep))   # model tokens only
            advs.append(adv)
    b, t = len(olds), max((len(o) for o in olds), default=0)
    out.old_logprobs_BT = torch.zeros(b, t, dtype=torch.float32)
    out.mask_BT = torch.zeros(b, t, dtype=torch.bool)
    for i, (o, m) in enumerate(zip(olds, masks)):
        out.old_logprobs_BT[i, :len(o)] = torch.tensor(o, dtype=torch.float32)
        out.mask_BT[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
    out.advantages_B = torch.tensor(advs, dtype=torch.float32)
    return out


class Learner:
    """A peft LoRA model plus its AdamW optimizer, for one job.

    The LoRA initialisation is seeded by the job seed, so every trainer of a job starts from the
    same adapter (version 0).

    The model stays in eval mode, for the loss's forward pass too: LoRA dropout (`lora.dropout`)
    never enters a score. The importance ratio pi_theta / pi_behaviour must compare the function
    the sampler ran (workers and validators score with dropout off); with dropout in the loss's
    pass an on-policy ratio would not be 1 and log-probs would not be reproducible
    (tests/unit/test_learner_dropout.py). `lora.dropout` is kept in the exported adapter config.
    """

    def __init__(self, model_path: Path, spec: JobSpec, *, share_prompts: bool = True, device: str = "cpu",
                 token_budget: int | None = None, micro_batch_tokens: int | None = None) -> None:
        """share_prompts: score a group's completions over one prefill of its prompt
        (`scoring.shared_prompt_logprobs`, the same log-probs and gradients for ~G x fewer prompt
        positions); False prefills every prompt + completion (the baseline, for benchmarks).
        device: where the model and the step run (`node.inference.device.resolve_device`); the
        adapter state it hands out is always on the CPU.
        token_budget: tokens a completion may hold (dr_grpo's constant; a multi-turn job's episode
        `max_tokens`); default `sampling.max_new_tokens`.
        micro_batch_tokens: positions per forward/backward pass (`micro_batches`; default
        MICRO_BATCH_TOKENS scaled to the loaded dtype); a step's loss and gradients are the same
        however it is split (`LossNormalizer`)."""
        self.spec = spec
        self.token_budget = token_budget or spec.sampling.max_new_tokens
        self._logprobs = shared_prompt_logprobs if share_prompts else completion_logprobs
        base, self.tokenizer = load_on_device(model_path, device)
        self.micro_batch_tokens = micro_batch_tokens or MICRO_BATCH_TOKENS * 2 // base.dtype.itemsize
        torch.manual_seed(spec.seed)
        cfg = lora_config(spec.lora.rank, spec.lora.alpha, spec.lora.dropout, spec.lora.target_modules)
        model = with_lora(base, cfg)
        assert isinstance(model, PeftModel)
        model.eval()   # peft's new LoRA modules start in training mode: dropout off (class docstring)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            p.data = p.data.float()
        self.optimizer = torch.optim.AdamW(
            self.params, lr=spec.learning_rate, betas=(0.9, 0.99), weight_decay=spec.weight_decay
        )
        self.pad_id = int(self.tokenizer.pad_token_id)

    def state(self) -> ad.State:
        """The adapter's tensors (float32 copies), keyed as in adapter_model.safetensors."""
        return ad.clone_state(get_peft_model_state_dict(self.model))

    def load_state(self, state: ad.State) -> None:
        """Set the adapter's tensors exactly (bit for bit)."""
        set_peft_model_state_dict(self.model, state)
        got = ad.adapter_hash(self.state())
        if got != ad.adapter_hash(state):
            raise RuntimeError("adapter state did not load exactly")

    def set_params(self, values: list[torch.Tensor]) -> None:
        """Set the LoRA parameters (in `params` order) to `values` exactly, e.g. an outer step's result.

        Raises:
            ValueError: the count or a shape differs from the parameters'.
        """
        if len(values) != len(self.params) or any(v.shape != p.shape for v, p in zip(values, self.params)):
            raise ValueError("values do not match the LoRA parameters")
        with torch.no_grad():
            for p, v in zip(self.params, values):
                p.copy_(v)

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's `state_dict()` (AdamW moments and step counts, for a checkpoint)."""
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Restore the optimizer from an `optimizer_state()` (same parameters, same order)."""
        self.optimizer.load_state_dict(state)

    def completion_logprobs(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the batch's completion tokens under the model as it is (adapter active or
        disabled, grad or not, as the caller set it), at the job's sampling temperature.
        Returns `(logprobs_BT, mask_BT)` as `scoring.completion_logprobs` does."""
        return self._logprobs(self.model, batch.prompt_ids, batch.completion_ids,
                              temperature=self.spec.sampling.temperature, pad_id=self.pad_id)

    def compute_gradients(self, batch: StepBatch) -> tuple[float, dict[str, float]]:
        """Forward/backward of the GRPO loss; leaves gradients in `self.params`. Returns (loss, metrics).

        A batch larger than `micro_batch_tokens` runs in several passes (whole groups each), each
        loss normalised by the whole batch's counts, so the gradients accumulate to the one-pass
        gradients; the metrics are computed once over the whole batch's log-probs."""
        self.optimizer.zero_grad(set_to_none=True)
        if not batch.completion_ids:
            return 0.0, {"tokens": 0.0}
        spans = micro_batches(batch, self.micro_batch_tokens)
        if len(spans) == 1:
            return self._pass(batch, 0, len(batch.completion_ids), None)
        normalizer = LossNormalizer.of(batch.mask_BT)
        total, lp_rows = 0.0, []
        for lo, hi in spans:
            loss, _, lp_BT = self._pass_tensors(batch, lo, hi, normalizer)
            total += loss
            lp_rows.append(lp_BT)
        width = batch.mask_BT.shape[1]
        logprobs_BT = torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in lp_rows])
        mask_BT = batch.mask_BT.to(logprobs_BT.device)
        old_BT, advantages_B = batch.old_logprobs_BT.to(mask_BT.device), batch.advantages_B.to(mask_BT.device)
        ref_BT = None
        if self.spec.loss.kl_beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                ref_BT, _ = self.completion_logprobs(batch)
        with torch.no_grad():
            _, metrics = policy_loss(logprobs_BT, old_BT, advantages_B, mask_BT, self.spec.loss,
                                     max_new_tokens=self.token_budget, ref_logprobs_BT=ref_BT)
        metrics.update(logprob_drift(logprobs_BT, old_BT, mask_BT))
        metrics["micro_batches"] = float(len(spans))
        return total, metrics

    def _pass(self, batch: StepBatch, lo: int, hi: int,
              normalizer: LossNormalizer | None) -> tuple[float, dict[str, float]]:
        loss, metrics, _ = self._pass_tensors(batch, lo, hi, normalizer)
        return loss, metrics

    def _pass_tensors(self, batch: StepBatch, lo: int, hi: int,
                      normalizer: LossNormalizer | None) -> tuple[float, dict[str, float], torch.Tensor]:
        """Forward/backward of rows [lo, hi) (gradients accumulate); (loss, metrics, detached log-probs)."""
        prompts, completions = batch.prompt_ids[lo:hi], batch.completion_ids[lo:hi]
        logprobs_BT, mask_BT = self._logprobs(self.model, prompts, completions,   # eval mode: no LoRA dropout
                                              temperature=self.spec.sampling.temperature, pad_id=self.pad_id)
        device, width = logprobs_BT.device, logprobs_BT.shape[1]   # the batch's tensors are built on the CPU
        old_BT = batch.old_logprobs_BT[lo:hi, :width].to(device)
        advantages_B = batch.advantages_B[lo:hi].to(device)
        mask_BT = mask_BT & batch.mask_BT[lo:hi, :width].to(device)
        ref_BT = None
        if self.spec.loss.kl_beta > 0:
            with torch.no_grad(), self.model.disable_adapter():
                ref_BT, _ = self._logprobs(self.model, prompts, completions,
                                           temperature=self.spec.sampling.temperature, pad_id=self.pad_id)
        loss, metrics = policy_loss(
            logprobs_BT, old_BT, advantages_B, mask_BT, self.spec.loss,
            max_new_tokens=self.token_budget, ref_logprobs_BT=ref_BT, normalizer=normalizer,
        )
        loss.backward()
        metrics.update(logprob_drift(logprobs_BT.detach(), old_BT, mask_BT))
        return float(loss.detach()), metrics, logprobs_BT.detach()

    def grads(self) -> list[torch.Tensor]:
        """The gradients of the LoRA parameters in order (zeros where a parameter has none)."""
        return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def set_grads(self, grads: list[torch.Tensor]) -> None:
        """Replace the gradients (e.g. by the average over a job's trainers)."""
        if len(grads) != len(self.params):
            raise ValueError(f"expected {len(self.params)} gradients, got {len(grads)}")
        for p, g in zip(self.params, grads):
            p.grad = g.detach().to(p.dtype).clone().reshape(p.shape)

    def clear_grads(self) -> None:
        """Drop every gradient (set to None), as before a fresh backward pass."""
        self.optimizer.zero_grad(set_to_none=True)

    def gradients_finite(self) -> bool:
        """False if any gradient holds a NaN or an infinity (the step must then be skipped)."""
        return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in self.params)

    def apply_gradients(self) -> float:
        """Clip and take the optimizer step; returns the pre-clip gradient norm (0 with no grads)."""
        if all(p.grad is None for p in self.params):
            return 0.0
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.spec.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def step(self, groups: list[pb.Group], current_version: int,
             reducer: GradientReducer | None = None) -> dict[str, float] | None:
        """One GRPO step on `groups`: advantages -> loss -> backward -> reduce -> optimizer.

        reducer: combines the gradients with other trainers' (default `LocalReduce`). A batch
            without signal (no unmasked tokens: every group zero-variance) or with non-finite
            gradients goes in with weight 0, and the optimizer step is skipped unless the reducer
            returns others' gradients. Non-finite reduced gradients are never applied.
        Returns the metrics row (`summarize`; `stepped` is 1.0 when the adapter changed), or None
        when the reducer abandoned the step (nothing applied).
        """
        reducer = reducer or LocalReduce()
        t0 = time.monotonic()
        batch = build_step_batch(groups, self.spec, current_version)
        reducer.begin()
        loss, metrics = self.compute_gradients(batch)
        finite = self.gradients_finite()
        # the loss's own denominator: the average over trainers is then the step on the union batch
        weight = LossNormalizer.of(batch.mask_BT).denominator(self.spec.loss.variant) if finite else 0.0
        out = reducer.reduce(self.grads() if finite else [torch.zeros_like(p) for p in self.params], weight)
        if out.abandon:
            self.clear_grads()
            return None
        usable = out.grads is not None and all(bool(torch.isfinite(g).all()) for g in out.grads)
        if out.grads is not None and usable:
            self.set_grads(out.grads)
        else:
            self.clear_grads()   # nothing to step on, or the reduced gradients are not finite: no step
        stepped = usable
        grad_norm = self.apply_gradients() if stepped else (0.0 if finite else math.nan)
        row = summarize(batch, loss, metrics, grad_norm, finite, time.monotonic() - t0)
        row.update({"stepped": float(stepped), "grad_weight": weight, **out.metrics})
        return row


def summarize(
    batch: StepBatch, loss: float, metrics: dict[str, float], grad_norm: float, finite: bool, seconds: float
) -> dict[str, float]:
    """The metrics row of one step (what metrics.csv and `swarmrl status` show)."""
    hist = staleness_histogram(batch.staleness)
    row = {
        "reward_mean": sum(batch.rewards) / len(batch.rewards) if batch.rewards else math.nan,
        "loss": loss,
        "grad_norm": grad_norm,
        "skipped_nonfinite": 0.0 if finite else 1.0,
        "staleness_mean": sum(batch.staleness) / len(batch.staleness) if batch.staleness else 0.0,
        "staleness_max": float(max(batch.staleness, default=0)),
        "zero_variance_frac": batch.groups_zero_variance / batch.groups_total if batch.groups_total else 0.0,
        "failed_grades": float(batch.failed_grades),
        "train_seconds": seconds,
    }
    row.update({f"staleness_{k}": float(v) for k, v in sorted(hist.items())})
    row.update({k: float(v) for k, v in metrics.items()})
    return row
