"""The engine-neutral inference interface: one base model, one LoRA adapter slot per job.

Legend: B = prompts in a call, n = completions per prompt (the GRPO group size G), T = tokens of
one completion.

A backend samples `n` completions for each prompt and reports, for every sampled token, the
log-probability it was sampled with, `log_softmax(logits / temperature)[token]` in float32 (see
`Sampling`). The trainer's importance ratios and the validator's re-check both recompute that
number with `swarmrl.node.inference.scoring.completion_logprobs`, so every backend must report
exactly that quantity.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import nn

FinishReason = Literal["stop", "length"]


DEFAULT_LORA_RANK, DEFAULT_LORA_ALPHA = 16, 32
"""The LoRA shape of slots made by `set_adapter` without `add_slot`."""


class BackendError(RuntimeError):
    """The inference engine failed (e.g. a vLLM server that crashed or stopped answering), not the
    request: `InferenceBackend.recover` may bring it back, and the same call may then succeed."""


class LoraShape(Protocol):
    """The engine-neutral shape of a LoRA adapter (e.g. `protocol.jobspec.LoraSpec`, frozen)."""

    @property
    def rank(self) -> int:
        """r of the A [r, in] and B [out, r] matrices, >= 1."""

    @property
    def alpha(self) -> int:
        """Scaling numerator, >= 1: the weight update is `alpha / rank * B @ A`."""

    @property
    def dropout(self) -> float:
        """LoRA dropout probability, in [0, 1)."""

    @property
    def target_modules(self) -> str | tuple[str, ...]:
        """Either "all-linear" (every linear layer but the output head) or the adapted modules' names."""


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one `generate` call.

    n: completions per prompt (the group size G), >= 1.
    max_new_tokens: completion length cap in tokens, >= 1.
    temperature: softmax temperature, >= 0; 0 means greedy decoding (argmax), and the reported
        log-probs are then those of the untempered distribution (temperature 1).
    top_p: nucleus sampling mass in (0, 1]. The reported log-probs ignore it: they are always
        `log_softmax(logits / temperature)` over the full vocabulary.
    stop: stop strings; a completion ends right after the token that completes the first
        occurrence of any of them in the completion's decoded text (that token is kept).
    seed: makes sampling reproducible for the same prompts, parameters, adapter and backend;
        None draws from the process's global RNG.
    """

    n: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")


@dataclass
class SampledCompletion:
    """One sampled completion.

    token_ids: exactly the sampled ids, including the EOS or stop-string-completing token and
        nothing after it (never padding).
    logprobs: float32 sampling log-prob of each token, `log_softmax(logits / T)[token]`; same
        length as `token_ids`.
    finish_reason: "stop" (EOS sampled or a stop string completed) or "length".
    text: `tokenizer.decode(token_ids, skip_special_tokens=True)`.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str


@dataclass(frozen=True)
class GenerateRequest:
    """One job's share of a `generate_batch` call: its prompts [B] (token ids), its sampling
    parameters and its adapter slot (None: the base model)."""

    prompt_token_ids: list[list[int]]
    sampling: Sampling
    adapter: str | None = None


class InferenceBackend(ABC):
    """One base model loaded once, with named LoRA adapter slots (one per job).

    Every caller (worker, validator, `swarmrl eval`, the red-team drill) uses only what is
    declared here. Attributes, set by the implementation's constructor:

    tokenizer: the base model's tokenizer (transformers API: `decode`, `all_special_ids`, ...).
    vocab_size: token ids the model accepts are in `[0, vocab_size)` (embedding and output head).
    eos_token_ids: ids that end a completion with finish reason "stop": the tokenizer's EOS and
        those of the model's generation config (Gemma lists several); never empty.
    pad_token_id: the id batches are padded with (the tokenizer's pad token, else its smallest
        EOS id); pass it as `pad_id` to `scoring` functions run on `activated`'s model.
    dtype: floating dtype of the model's weights (its output head's), e.g. torch.bfloat16; it
        bounds how closely recomputed log-probs can match the sampled ones.
    sampled_dtype: the dtype the model's workers sample in elsewhere (its manifest's), when this
        backend computes in another (float32 on a device without native bf16: `device.py`); None:
        `dtype`. A validator's tolerance must admit the looser of the two.
    """

    tokenizer: Any
    vocab_size: int
    eos_token_ids: frozenset[int]
    pad_token_id: int
    dtype: torch.dtype
    sampled_dtype: torch.dtype | None = None
    batches_adapters: bool = False
    """Whether `generate_batch` runs several adapters' requests in one engine batch (vLLM), so a
    worker may hold several jobs' leases in one round; False: one job a round (transformers)."""

    def _check_prompts(self, prompt_token_ids: list[list[int]]) -> None:
        """Raise ValueError on an empty prompt or a token id outside `[0, vocab_size)`."""
        for i, p in enumerate(prompt_token_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if any(not 0 <= t < self.vocab_size for t in p):
                raise ValueError(f"prompt {i} has a token id outside [0, {self.vocab_size})")

    @property
    @abstractmethod
    def adapters(self) -> frozenset[str]:
        """Names of the adapter slots now loaded (made by `add_slot` or `set_adapter`)."""

    @abstractmethod
    def add_slot(self, name: str, lora: LoraShape) -> None:
        """Create adapter slot `name` with LoRA shape `lora` (its LoRA update starts at zero, so
        it samples like the base model until `set_adapter`). No-op if the slot exists with the
        same shape; ValueError if it exists with another shape or the name is reserved.
        """

    @abstractmethod
    def set_adapter(self, name: str, state: dict[str, torch.Tensor]) -> None:
        """Load or replace the LoRA tensors of slot `name`.

        `state` is keyed as `peft.get_peft_model_state_dict` returns it (what
        `adapter_model.safetensors` holds), creating the slot with a backend default shape if
        `add_slot` didn't. After the call the slot's tensors equal `state` bit for bit. Raises
        ValueError on missing/unexpected keys, wrong shapes, non-finite values or a dtype the
        slot cannot hold exactly.
        """

    @abstractmethod
    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        """A copy of slot `name`'s LoRA tensors, keyed as `set_adapter` takes them (a fresh slot's
        B matrices are zero; e.g. the starting adapter of a job's LoRA shape), in the slot's dtype.
        Raises KeyError if there is no such slot.
        """

    @abstractmethod
    def remove_adapter(self, name: str) -> None:
        """Free slot `name`. Raises KeyError if there is no such slot."""

    @abstractmethod
    def generate(
        self, prompt_token_ids: list[list[int]], sampling: Sampling, adapter: str | None = None
    ) -> list[list[SampledCompletion]]:
        """Sample `sampling.n` completions for each prompt; result indexed [prompt][n].

        `adapter` names a slot set with `set_adapter`; None samples from the base model.
        Raises ValueError on empty prompts, out-of-vocabulary ids and KeyError on an unknown
        adapter.
        """

    def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[list[list[SampledCompletion]]]:
        """`generate` for each request, results indexed [request][prompt][n]. A backend that
        `batches_adapters` runs every request in one engine batch, each on its own adapter; the
        default runs them in turn. Raises what `generate` raises (nothing is returned then)."""
        return [self.generate(r.prompt_token_ids, r.sampling, adapter=r.adapter) for r in requests]

    @abstractmethod
    def activated(self, adapter: str | None) -> AbstractContextManager[nn.Module]:
        """Context manager giving the torch causal LM that computes this backend's logits, with
        slot `adapter` active (None: the base model, adapters off), held exclusively until exit.

        The module takes `input_ids`/`attention_mask` [B, L] and returns logits [B, L, V] (a
        transformers model, possibly under a peft wrapper with `get_base_model()`); it is what
        `scoring.completion_logprobs` and the validator's re-scoring run one prefill on, so the
        recomputed log-probs are those of the sampler's exact weights. Don't keep it past the
        block. Raises KeyError on an unknown adapter.
        """

    def sampling_problem(self, temperature: float, top_p: float) -> str:
        """Why this backend can't report sampling log-probs in the swarm's convention at these
        settings ("" when it can). A job it can't serve this way is a configuration error, skipped
        before any rollout is signed, never served with numbers that would get the worker banned.
        The default (a backend that computes the convention itself) can serve every setting."""
        return ""

    def recover(self) -> None:
        """Bring a failed engine back after a `BackendError`: restart or reattach it and reload
        every adapter slot, so the slots serve what they served before. The default (an
        in-process engine) has nothing to restart. Raises BackendError if it can't."""

    def close(self) -> None:
        """Free what the backend holds outside this process (e.g. a vLLM server it started).
        The default does nothing; calling it twice is harmless."""
