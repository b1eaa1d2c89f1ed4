"""What a model costs on the clock and on the wire: per-model profiles and GPU classes.

Local profiles are calibrated from the product's measured runs on 2 CPU cores (tests/fixtures/
sim_calibration.json and the Gemma figures in docs/ARCHITECTURE.md); GPU profiles are assumptions
stated here (tokens/s of batched generation, trainer step time), to be replaced by measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Generation throughput of a 270M-parameter model (tokens/s, batched sampling with the adapter
# applied), by worker class. "cpu" is one core of the local test machine.
GPU_CLASSES = ("cpu", "rtx3060", "rtx3090", "rtx4090", "a100")


@dataclass(frozen=True)
class ModelProfile:
    """Clock and wire costs of one base model with the job's adapter."""

    delta_bytes: int                  # one published version's delta on the wire
    snapshot_bytes: int               # one adapter snapshot on the wire
    tokens_per_completion: float      # mean sampled tokens per completion
    tokens_per_s: dict[str, float]    # generation speed by worker class
    round_overhead_s: float           # per lease round: grading, signing, framework
    step_fixed_s: float               # trainer step time = fixed + per_group * groups
    step_per_group_s: float
    publish_s: float                  # from the optimizer step to the delta being served
    rollout_bytes_per_token: float = 16.0   # token id + log-prob + framing, per completion token
    notes: str = ""
    speed_spread: float = field(default=0.25)   # sigma of the log-normal speed draw within a class

    def step_s(self, groups: int) -> float:
        """Trainer step time in seconds for a batch of `groups` groups."""
        return self.step_fixed_s + self.step_per_group_s * groups


MODEL_PROFILES: dict[str, ModelProfile] = {
    # `swarmrl up --model tiny --steps 5` on 2 CPU cores (fixture): a lease round of 2 prompts x 4
    # completions x ~6 tokens takes ~40 ms, a step ~0.05 s; the delta and snapshot sizes are the
    # bytes each worker received (287,946 = one snapshot + 5 deltas).
    "tiny": ModelProfile(delta_bytes=43_663, snapshot_bytes=69_632, tokens_per_completion=6.0,
                         tokens_per_s={"cpu": 1500.0}, round_overhead_s=0.02, step_fixed_s=0.05,
                         step_per_group_s=0.0, publish_s=0.02, speed_spread=0.0,
                         notes="measured: swarmrl up --model tiny --steps 5"),
    # The main job, Gemma 3 270M r16 all-linear on 2 CPU cores: step median 4.1 s for 8 groups of 8,
    # ~486 groups admitted over 60 steps in ~390 s with 2 workers (a lease of 2 prompts x 8
    # completions x ~6 tokens every ~3.2 s per worker while sharing the cores with the trainer).
    # A version's delta is the int4 codec's (the job default): median 1,906,378 B over 3 versions,
    # `benchmarks/delta_size.py --model gemma --steps 3` (12.47 MB as float32); snapshots stay float32.
    "gemma-270m-cpu": ModelProfile(delta_bytes=1_906_000, snapshot_bytes=12_700_000, tokens_per_completion=6.0,
                                   tokens_per_s={"cpu": 31.0}, round_overhead_s=0.1, step_fixed_s=4.1,
                                   step_per_group_s=0.0, publish_s=0.2, speed_spread=0.0,
                                   notes="measured: swarmrl up (Gemma 270M), docs/ARCHITECTURE.md"),
    # The same adapter on volunteer GPUs, a reasoning-length job (assumed figures).
    "gemma-270m-gpu": ModelProfile(delta_bytes=1_906_000, snapshot_bytes=12_700_000, tokens_per_completion=512.0,
                                   tokens_per_s={"cpu": 30.0, "rtx3060": 2000.0, "rtx3090": 4000.0,
                                                 "rtx4090": 6000.0, "a100": 8000.0},
                                   round_overhead_s=0.5, step_fixed_s=1.0, step_per_group_s=0.03, publish_s=0.5,
                                   notes="assumed: vLLM batched sampling; trainer on one H100"),
}
