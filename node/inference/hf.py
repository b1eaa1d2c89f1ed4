"""transformers + peft inference backend (CPU default): one base model, one LoRA slot per job.

Legend: R = rows of a generate call (prompts x n), P = padded prompt length, T = generated
steps, V = vocabulary.

`generate` runs HF's decoding loop (KV cache, batching, EOS handling) in greedy mode, and a
logits processor (`_Sampler`) does the sampling: it takes the raw float32 logits of each step,
records `log_softmax(logits / temperature)` at the token it draws (the same function the scorer
uses: `scoring.tempered_log_softmax`) and forces that token. Why not `do_sample=True`:
`torch.multinomial` over Gemma's 262k vocabulary costs ~250 ms per step for 16 rows on this CPU
(inverse-CDF sampling here: ~16 ms), HF's top-p sorts the whole vocabulary (~850 ms), a
private `torch.Generator` makes seeds reproducible without touching the global RNG, and nothing
keeps R x T x V logits alive (`output_logits=True` would: 64 rows x 256 steps x 262k = 17 GB).
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
from collections.abc import Iterator
from typing import Any, cast

import peft
import torch
from torch import nn
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    StoppingCriteria,
    StoppingCriteriaList,
)

from swarmrl.node.inference.base import FinishReason, InferenceBackend, LoraShape, SampledCompletion, Sampling
from swarmrl.node.inference.scoring import tempered_log_softmax
from swarmrl.node.inference.stops import completion_end, first_stop
from swarmrl.node.models.causal_lm import lora_config as make_lora_config
from swarmrl.node.models.causal_lm import vocab_size as model_vocab_size
from swarmrl.node.models.causal_lm import with_lora

TOP_P_CANDIDATES = 1024  # top-p looks at the k most likely tokens first, widening k x8 while short of mass
PLACEHOLDER_ADAPTER = "swarmrl-placeholder"  # peft needs >= 1 adapter; this one stays all-zero, never active
_HOOK_FLAG = "_swarmrl_contiguous_input_hook"


def ensure_contiguous_head_input(causal_lm: PreTrainedModel) -> None:
    """Install (once) a forward pre-hook making the LM head's input contiguous.

    torch 2.13 CPU runs `F.linear` on a non-contiguous input with a frozen weight up to ~300x
    slower (bf16); HF generate feeds the head a strided slice of the last position.
    """
    head = causal_lm.get_output_embeddings()
    hooks = head._forward_pre_hooks.values()  # also recognizes causal_lm.load_causal_lm's hook
    if getattr(head, _HOOK_FLAG, False) or any("contiguous" in getattr(h, "__name__", "") for h in hooks):
        return
    head.register_forward_pre_hook(_contiguous_inputs)
    setattr(head, _HOOK_FLAG, True)


def _contiguous_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)


class HFBackend(InferenceBackend):
    """`InferenceBackend` over a transformers causal LM wrapped in a multi-adapter PeftModel.

    model: a transformers causal LM (any dtype/device); the backend takes it over: puts it in
        eval mode, replaces its generation config by a neutral one (no model-default top-k,
        repetition penalty, ...) and injects LoRA layers.
    tokenizer: its tokenizer; its pad token (else its EOS) pads batches.
    lora_config: the LoRA shape of slots that `set_adapter` creates (`add_slot` gives a slot
        another one).
    Thread-safe: calls are serialized by a lock.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: Any, lora_config: peft.LoraConfig) -> None:
        eos_ids = _eos_ids(model, tokenizer)
        if not eos_ids:
            raise ValueError("neither the tokenizer nor the model config names an EOS token")
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_ids
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
        self.lora_config = lora_config
        model.eval()
        model.generation_config = GenerationConfig(
            bos_token_id=getattr(tokenizer, "bos_token_id", None),
            eos_token_id=sorted(eos_ids),
            pad_token_id=self.pad_token_id,
        )
        ensure_contiguous_head_input(model)
        self.vocab_size = model_vocab_size(model)
        self.dtype = model.get_output_embeddings().weight.dtype
        self.model = with_lora(model, copy.deepcopy(lora_config), adapter_name=PLACEHOLDER_ADAPTER)
        self.model.eval()
        self._slots: dict[str, tuple[Any, ...]] = {}  # name -> LoRA shape key
        self._lock = threading.RLock()

    @property
    def adapters(self) -> frozenset[str]:
        """Names of the loaded adapter slots."""
        return frozenset(self._slots)

    def add_slot(self, name: str, lora: LoraShape | peft.LoraConfig) -> None:
        """Create slot `name` with LoRA shape `lora` (a `LoraShape` such as the job spec's
        `LoraSpec`, or a peft config). Its B matrices start at zero (it samples like the base
        model until `set_adapter`). No-op if the slot exists with the same shape.
        Raises ValueError on a reserved or empty name or an existing slot of another shape.
        """
        config = lora if isinstance(lora, peft.LoraConfig) else make_lora_config(
            lora.rank, lora.alpha, lora.dropout,
            lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules),
        )
        with self._lock:
            if name in self._slots:
                if self._slots[name] != _shape(config):
                    raise ValueError(f"slot {name!r} exists with another LoRA shape")
                return
            self._create_slot(name, config)

    def set_adapter(self, name: str, state: dict[str, torch.Tensor]) -> None:
        """Load/replace slot `name` with `state` (keys as `peft.get_peft_model_state_dict` gives).

        A slot that doesn't exist yet is created with the backend's `lora_config`.
        Raises ValueError on a reserved name, missing/unexpected keys, wrong shapes, non-finite
        values, or values the slot's dtype can't hold exactly; the slot is then unchanged (a new
        slot is not created).
        """
        with self._lock:
            created = name not in self._slots
            if created:
                self._create_slot(name, self.lora_config)
            try:
                _check_state(_lora_state(self.model, name), state)
                peft.set_peft_model_state_dict(self.model, state, adapter_name=name)
            except Exception:
                if created:
                    self.remove_adapter(name)
                raise
            self.model.eval()
            loaded = _lora_state(self.model, name)
            assert all(torch.equal(loaded[k], v.to(loaded[k].dtype)) for k, v in state.items())

    def _create_slot(self, name: str, config: peft.LoraConfig) -> None:
        if name == PLACEHOLDER_ADAPTER or not name:
            raise ValueError(f"adapter name {name!r} is reserved or empty")
        shape = _shape(config)  # before peft resolves "all-linear" in its copy
        self.model.add_adapter(name, copy.deepcopy(config))
        self.model.eval()
        self._slots[name] = shape

    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        """A copy of slot `name`'s tensors (peft state-dict keys). Raises KeyError if unknown."""
        with self._lock:
            self._require_slot(name)
            state = _lora_state(self.model, name)
            return {k: v.detach().clone() for k, v in state.items()}

    def remove_adapter(self, name: str) -> None:
        """Free slot `name`. Raises KeyError if there is no such slot."""
        with self._lock:
            self._require_slot(name)
            if name in self.model.active_adapters:
                self.model.set_adapter(PLACEHOLDER_ADAPTER)
            self.model.delete_adapter(name)
            del self._slots[name]

    @contextlib.contextmanager
    def activated(self, adapter: str | None) -> Iterator[nn.Module]:
        """Context: the PeftModel with slot `adapter` active (None: adapters disabled), locked.

        For scoring with the sampler's exact weights, e.g.
        `with backend.activated("job"): scoring.completion_logprobs(backend.model, ...)`.
        """
        with self._lock:
            if adapter is None:
                with self.model.disable_adapter():
                    yield self.model
                return
            self._require_slot(adapter)
            if list(self.model.active_adapters) != [adapter]:
                self.model.set_adapter(adapter)
            self.model.eval()
            yield self.model

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: Sampling, adapter: str | None = None
    ) -> list[list[SampledCompletion]]:
        """Sample `sampling.n` completions per prompt, in one left-padded batch of B x n rows.

        Results are [prompt][n]; see `SampledCompletion`. Deterministic for a given
        `sampling.seed`, batch, adapter and thread count. Raises ValueError on an empty prompt or
        an out-of-vocabulary id, KeyError on an unknown adapter.
        """
        self._check_prompts(prompt_token_ids)
        if not prompt_token_ids:
            return []
        rows = [list(p) for p in prompt_token_ids for _ in range(sampling.n)]
        input_ids_RP, attention_RP = _left_pad(rows, self.pad_token_id, self.model.device)
        sampler = _Sampler(sampling, self.model.device)
        criteria = StoppingCriteriaList()
        if sampling.stop:
            criteria.append(_StopStrings(self.tokenizer, sampling.stop, input_ids_RP.shape[1]))
        with self.activated(adapter), torch.inference_mode():
            sequences_RL = self.model.generate(
                input_ids=input_ids_RP,
                attention_mask=attention_RP,
                generation_config=self._generation_config(sampling),
                logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=criteria,
            )
        new_RT = sequences_RL[:, input_ids_RP.shape[1]:].cpu()
        logprobs_RT = sampler.logprobs(new_RT.shape[1])
        done = [self._finish(new_RT[r].tolist(), logprobs_RT[r].tolist(), sampling) for r in range(len(rows))]
        return [done[i * sampling.n: (i + 1) * sampling.n] for i in range(len(prompt_token_ids))]

    def _generation_config(self, sampling: Sampling) -> GenerationConfig:
        """Greedy decoding of the tokens `_Sampler` forces; every other logits processor off."""
        return GenerationConfig(
            do_sample=False,
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            repetition_penalty=1.0,
            num_beams=1,
            eos_token_id=sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )

    def _finish(self, tokens: list[int], logprobs: list[float], sampling: Sampling) -> SampledCompletion:
        """Cut a generated row after its first EOS or stop-string-completing token."""
        end, reason = completion_end(self.tokenizer, tokens, self.eos_token_ids, sampling.stop)
        assert reason == "stop" or end == sampling.max_new_tokens, (end, tokens)
        finish: FinishReason = "stop" if reason == "stop" else "length"
        ids = tokens[:end]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return SampledCompletion(token_ids=ids, logprobs=logprobs[:end], finish_reason=finish, text=text)

    def _require_slot(self, name: str) -> None:
        if name not in self._slots:
            raise KeyError(f"no adapter slot {name!r} (loaded: {sorted(self._slots)})")


class _Sampler(LogitsProcessor):
    """Draws each step's tokens from the raw logits, records their log-probs, forces them.

    The only active logits processor (the backend's neutral generation config enables no other),
    so `scores` are the model's raw float32 logits. Temperature 0: argmax of the raw logits
    (log-probs at temperature 1). Otherwise a draw from softmax(logits / T), restricted to the
    top-p nucleus (the smallest most-likely set with mass >= top_p), by inverse CDF with one
    float32 uniform per row from a private generator. The recorded log-prob is always the full
    `tempered_log_softmax` (top-p ignored). A row whose logits hold NaN draws uniformly (token 0
    when greedy) and records NaN, so the batch finishes and the worker drops that group unsigned.
    """

    def __init__(self, sampling: Sampling, device: torch.device) -> None:
        self.sampling = sampling
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.steps: list[torch.Tensor] = []  # [R] float32 log-prob of each step's token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logp_RV = tempered_log_softmax(scores, self.sampling.temperature)
        nan_R = torch.isnan(logp_RV).any(dim=-1)   # NaN logits (fp16 overflow, a broken adapter)
        if bool(nan_R.any()):   # clamp such rows to a uniform draw so the batch goes on, record NaN:
            uniform = torch.full_like(logp_RV, -math.log(logp_RV.shape[-1]))   # the worker drops the group
            logp_RV = torch.where(nan_R[:, None], uniform, logp_RV)
        if self.sampling.temperature == 0.0:
            tokens_R = torch.where(nan_R, 0, scores.argmax(dim=-1))
        else:
            tokens_R = _draw(logp_RV.exp(), self.sampling.top_p, self.generator)
        picked_R = logp_RV.gather(-1, tokens_R[:, None])[:, 0]
        self.steps.append(torch.where(nan_R, torch.full_like(picked_R, math.nan), picked_R).cpu())
        forced_RV = torch.full_like(scores, float("-inf"))
        # transformers annotates processors with the legacy FloatTensor; torch ops return Tensor
        return cast(torch.FloatTensor, forced_RV.scatter_(-1, tokens_R[:, None], 0.0))

    def logprobs(self, steps: int) -> torch.Tensor:
        """[R, steps] float32 log-probs of the first `steps` generated tokens."""
        assert len(self.steps) >= steps, (len(self.steps), steps)
        if steps == 0:
            return torch.zeros((0, 0), dtype=torch.float32)
        return torch.stack(self.steps[:steps], dim=1)


def _draw(probs_RV: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row from `probs_RV` (rows sum to ~1), within the top-p nucleus; ids [R]."""
    u_R1 = torch.rand((probs_RV.shape[0], 1), generator=generator, device=probs_RV.device)
    if top_p >= 1.0:
        return _inverse_cdf(probs_RV, u_R1)
    vocab, k = probs_RV.shape[-1], min(TOP_P_CANDIDATES, probs_RV.shape[-1])
    while True:
        top_Rk, ids_Rk = probs_RV.topk(k, dim=-1)  # sorted, most likely first
        mass_before_Rk = top_Rk.cumsum(-1) - top_Rk
        if k == vocab or bool((mass_before_Rk[:, -1] + top_Rk[:, -1] >= top_p).all()):
            break
        k = min(vocab, 8 * k)
    nucleus_Rk = torch.where(mass_before_Rk < top_p, top_Rk, torch.zeros_like(top_Rk))
    return ids_Rk.gather(-1, _inverse_cdf(nucleus_Rk, u_R1)[:, None])[:, 0]


def _inverse_cdf(weights_RV: torch.Tensor, u_R1: torch.Tensor) -> torch.Tensor:
    """Index j with cdf[j-1] <= u * total < cdf[j] per row (zero-weight entries never chosen)."""
    cdf_RV = weights_RV.cumsum(-1)
    total_R1 = cdf_RV[:, -1:]
    x_R1 = torch.minimum(u_R1 * total_R1, torch.nextafter(total_R1, torch.zeros_like(total_R1)))
    return torch.searchsorted(cdf_RV, x_R1, right=True)[:, 0]


class _StopStrings(StoppingCriteria):
    """Marks a row done once its decoded completion contains a stop string (early exit only;
    `first_stop` decides where the completion ends)."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], prompt_len: int) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.prompt_len = prompt_len
        # a stop string of c chars spans at most 4c byte-level tokens; +4 for context at the window start
        self.window = 4 * max(len(s) for s in stops) + 4

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for r, row in enumerate(input_ids[:, self.prompt_len:].tolist()):
            tail = self.tokenizer.decode(row[-self.window:], skip_special_tokens=True)
            if any(s in tail for s in self.stops):
                done[r] = first_stop(self.tokenizer, row, self.stops) is not None
        return cast(torch.BoolTensor, done)  # transformers' legacy annotation, as in _Sampler


def _lora_state(model: peft.PeftModel, name: str) -> dict[str, torch.Tensor]:
    """Slot `name`'s LoRA tensors. `save_embedding_layers=False`: we never train embeddings, and
    peft's default ("auto") looks for a `config.json` under the slot's `base_model_name_or_path`,
    which for an exported adapter is a hub id (a network lookup; offline it warns "Could not find
    a config file in ...")."""
    return cast(dict[str, torch.Tensor],  # peft's function is untyped
                peft.get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False))


def _shape(config: peft.LoraConfig) -> tuple[Any, ...]:
    targets = config.target_modules
    key = targets if isinstance(targets, str) else frozenset(targets or ())
    return (config.r, config.lora_alpha, config.lora_dropout, key)


def _eos_ids(model: PreTrainedModel, tokenizer: Any) -> frozenset[int]:
    """EOS ids of the tokenizer and of the model's generation config (Gemma lists several)."""
    ids: set[int] = set()
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(i) for i in source)
    return frozenset(ids)


def _left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(r) for r in rows)
    input_ids_RP = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention_RP = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids_RP[i, length - len(r):] = torch.tensor(r, dtype=torch.long)
        attention_RP[i, length - len(r):] = 1
    return input_ids_RP.to(device), attention_RP.to(device)


def _check_state(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """ValueError unless `state` has exactly the slot's keys and shapes, finite values, and a
    dtype that converts to the slot's dtype without loss."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"adapter state keys differ: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for key, slot in expected.items():
        value = state[key]
        if not isinstance(value, torch.Tensor) or value.shape != slot.shape:
            raise ValueError(f"{key}: want a tensor of shape {tuple(slot.shape)}")
        if not value.is_floating_point() or not torch.isfinite(value).all():
            raise ValueError(f"{key}: values must be finite floats")
        if not torch.equal(value.to(slot.dtype).to(value.dtype), value):
            raise ValueError(f"{key}: {value.dtype} values don't fit the slot's {slot.dtype} exactly")
