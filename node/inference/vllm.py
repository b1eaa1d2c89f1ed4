"""vLLM inference backend: `InferenceBackend` over vLLM's OpenAI-compatible server (a child process
in vLLM's own environment, see `vllm_server.py`), with one LoRA slot per job.

Legend: B = prompts of a generate call, n = completions per prompt, T = completion tokens.

Sampling goes through POST /v1/completions with token-id prompts, one request per prompt (sent
concurrently; the server batches them) with seed `seed + b * n` (vLLM gives the n children of a
request seeds seed + i), `return_token_ids`, and the sampled token's log-prob (`logprobs: 0`).
The server runs with `--logprobs-mode processed_logprobs` and `--generation-config vllm`, and each
request turns off every other logits processor (top_k, min_p, penalties), so at top_p = 1 the
reported value IS the swarm's convention, `log_softmax(logits / T)[token]` over the full
vocabulary (`protocol/grpo/logprob_convention.py`); a job with top_p < 1 is refused
(`ConventionError`) rather than served with nucleus-renormalised log-probs.

Adapters: a slot (one per job) holds its newest version; each version is loaded into the server
under the name `lora-<content hash>` (sha256 of the tensors and the LoRA shape), never a reused
name, so the server can't serve a cached old version under a new version's name. A new version is
loaded before the slot's oldest one is unloaded; a slot keeps its `versions_per_slot` newest
versions loaded (the job's staleness window + 1), and a version a running request uses is never
unloaded under it. Every reply's `model` field is checked against the adapter asked for, so a
request can't run silently on the base model or another job's adapter.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import peft
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from swarmrl.node.inference.base import (
    FinishReason,
    GenerateRequest,
    InferenceBackend,
    LoraShape,
    SampledCompletion,
    Sampling,
)
from swarmrl.node.inference.stops import completion_end
from swarmrl.node.inference.vllm_lora import (
    BASE_SLOT,
    Slot,
    adapter_config,
    adapter_template,
    check_state,
    fresh_state,
    lora_shape_key,
    version_name,
    write_adapter_folder,
)
from swarmrl.node.inference.vllm_server import LOGPROBS_MODE, VLLMServer, VLLMServerError
from swarmrl.node.models.base_model import read_manifest
from swarmrl.node.models.causal_lm import lora_config as make_lora_config
from swarmrl.protocol.grpo.logprob_convention import from_engine

log = logging.getLogger(__name__)

MAX_CONCURRENT_REQUESTS = 64
class VLLMBackend(InferenceBackend):
    """`InferenceBackend` over a vLLM server (started by the caller: `VLLMServer.start`/`attach`).

    server: the running server; the backend owns it (`close` ends a started one).
    model_path: the HF folder the server serves (tokenizer, config, manifest are read from it).
    lora_config: LoRA shape of slots `set_adapter` creates (`add_slot` gives a slot another one).
    versions_per_slot: adapter versions kept loaded per slot, >= 2 (staleness window + 1).
    `batches_adapters`: several jobs' requests run in one engine batch (`generate_batch`).
    Thread-safe. `activated` is not available (no torch module in this process): scoring runs on
    an `HFBackend` (the validator's).
    """

    batches_adapters = True

    def __init__(self, server: VLLMServer, model_path: Path, lora_config: peft.LoraConfig,
                 versions_per_slot: int = 2) -> None:
        if versions_per_slot < 2:
            raise ValueError(f"versions_per_slot must be >= 2 (a new version loads before the old unloads), "
                             f"got {versions_per_slot}")
        self.server, self.model_path = server, Path(model_path)
        self.lora_config, self.versions_per_slot = lora_config, versions_per_slot
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self.eos_token_ids = _eos_ids(self.model_path, self.tokenizer)
        if not self.eos_token_ids:
            raise ValueError("neither the tokenizer nor the generation config names an EOS token")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else min(self.eos_token_ids)
        self.dtype = getattr(torch, serving_dtype(self.model_path, self.hf_config))
        self._meta_model: nn.Module | None = None
        self.vocab_size = _vocab_size(self._meta())
        self._slots: dict[str, Slot] = {}
        self._users: dict[str, set[str]] = {}   # loaded server adapter name -> slots holding it
        self._running: Counter[str] = Counter()  # server adapter name -> requests in flight
        self._dir = Path(tempfile.mkdtemp(prefix="swarmrl-vllm-adapters-"))
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(MAX_CONCURRENT_REQUESTS, thread_name_prefix="vllm-request")
        self.load_seconds: list[float] = []   # seconds per adapter load (write + server load)
        self._closed = False
        with self._lock:
            self._create_slot(BASE_SLOT, self.lora_config, zero=True)

    # ---- adapter slots
    @property
    def adapters(self) -> frozenset[str]:
        """Names of the adapter slots."""
        return frozenset(self._slots) - {BASE_SLOT}

    def add_slot(self, name: str, lora: LoraShape | peft.LoraConfig) -> None:
        """Create slot `name` of shape `lora`, loaded with a fresh adapter (peft's init: A random,
        B zero, so it samples like the base model). No-op if it exists with the same shape.
        Raises ValueError on an empty name or an existing slot of another shape."""
        config = lora if isinstance(lora, peft.LoraConfig) else make_lora_config(
            lora.rank, lora.alpha, lora.dropout,
            lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules))
        _check_public(name)
        with self._lock:
            if name in self._slots:
                if lora_shape_key(self._slots[name].config) != lora_shape_key(config):
                    raise ValueError(f"slot {name!r} exists with another LoRA shape")
                return
            self._create_slot(name, config)

    def set_adapter(self, name: str, state: dict[str, torch.Tensor]) -> None:
        """Load `state` (peft state-dict keys) as slot `name`'s newest version, under its content
        hash; creates the slot with `lora_config` if needed. The previous version stays loaded
        until `versions_per_slot` newer ones are. The slot keeps a float32 copy equal to `state`
        bit for bit; the engine computes in the model's dtype.
        Raises ValueError on missing/unexpected keys, wrong shapes, non-finite values;
        VLLMServerError if the server refuses the adapter. The slot is then unchanged."""
        _check_public(name)
        with self._lock:
            created = name not in self._slots
            if created:
                self._create_slot(name, self.lora_config)
            try:
                self._load_version(name, state)
            except Exception:
                if created:
                    self.remove_adapter(name)
                raise

    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        """A float32 copy of slot `name`'s newest state. Raises KeyError if there is no such slot."""
        with self._lock:
            return {k: v.clone() for k, v in self._require_slot(name).state.items()}

    def remove_adapter(self, name: str) -> None:
        """Free slot `name` and unload its versions (those no request uses now). KeyError if unknown."""
        _check_public(name)
        with self._lock:
            slot = self._require_slot(name)
            del self._slots[name]
            for version in slot.loaded:
                self._release(version, name)

    def loaded_versions(self, name: str) -> list[str]:
        """Server adapter names of slot `name`'s loaded versions, oldest first (newest serves)."""
        with self._lock:
            return list(self._require_slot(name).loaded)

    def _create_slot(self, name: str, config: peft.LoraConfig, *, zero: bool = False) -> None:
        if not name or name == BASE_SLOT and not zero:
            raise ValueError(f"adapter slot name {name!r} is reserved or empty")
        template = self._template(config)
        self._slots[name] = Slot(config=copy.deepcopy(config), template=template)
        try:
            self._load_version(name, fresh_state(template, zero=zero))
        except Exception:
            del self._slots[name]
            raise

    def _load_version(self, name: str, state: dict[str, torch.Tensor]) -> None:
        slot = self._slots[name]
        check_state(slot.template, state)
        state32 = {k: v.detach().to("cpu", torch.float32).clone() for k, v in state.items()}
        version = version_name(state32, slot.config)
        if version not in self._users:
            self._server_load(version, state32, slot.config)
        self._users.setdefault(version, set()).add(name)
        if version in slot.loaded:
            slot.loaded.remove(version)
        slot.loaded.append(version)
        slot.state = state32
        while len(slot.loaded) > self.versions_per_slot:
            self._release(slot.loaded.pop(0), name)

    def _server_load(self, version: str, state: dict[str, torch.Tensor], config: peft.LoraConfig) -> None:
        import time

        t0 = time.perf_counter()
        folder = self._dir / version
        write_adapter_folder(folder, state, adapter_config(self._meta(), config, self.model_path))
        request = {"lora_name": version, "lora_path": str(folder)}
        try:
            try:
                self.server.post("/v1/load_lora_adapter", request)
            except VLLMServerError as exc:   # an attached server kept it from an earlier worker run:
                if "already been loaded" not in str(exc):   # same name, same content; reload from our folder
                    raise
                self.server.post("/v1/load_lora_adapter", {**request, "load_inplace": True})
        except VLLMServerError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self.load_seconds.append(time.perf_counter() - t0)

    def _release(self, version: str, slot: str) -> None:
        """Drop `slot`'s hold on server adapter `version`; unload it once no slot holds it and
        no request runs on it."""
        users = self._users.get(version)
        if users is None:
            return
        users.discard(slot)
        if users or self._running[version]:
            return
        del self._users[version]
        try:
            self.server.post("/v1/unload_lora_adapter", {"lora_name": version})
        except VLLMServerError as exc:   # a dead server or an already unloaded adapter: nothing left to free
            log.warning("unloading %s failed: %s", version, exc)
        shutil.rmtree(self._dir / version, ignore_errors=True)

    def _template(self, config: peft.LoraConfig) -> dict[str, torch.Size]:
        return adapter_template(self._meta(), config)

    def _meta(self) -> nn.Module:
        if self._meta_model is None:
            with torch.device("meta"):
                self._meta_model = AutoModelForCausalLM.from_config(self.hf_config)
        return self._meta_model

    def _require_slot(self, name: str) -> Slot:
        if name not in self._slots:
            raise KeyError(f"no adapter slot {name!r} (loaded: {sorted(self._slots)})")
        return self._slots[name]

    # ---- sampling
    def generate(
        self, prompt_token_ids: list[list[int]], sampling: Sampling, adapter: str | None = None
    ) -> list[list[SampledCompletion]]:
        """Sample `sampling.n` completions per prompt on slot `adapter`'s newest version (None:
        the base model); results [prompt][n], log-probs in the swarm's convention.

        Raises ValueError on an empty prompt or an out-of-vocabulary id, KeyError on an unknown
        adapter, ConventionError (a ValueError) for top_p < 1, VLLMServerError if the server fails
        or answers with another model than the one asked for."""
        return self.generate_batch([GenerateRequest(prompt_token_ids, sampling, adapter)])[0]

    def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[list[list[SampledCompletion]]]:
        """`generate` for several jobs at once, results [request][prompt][n]: every prompt of every
        request is sent to the server together (one completion request each, concurrent), so the
        engine schedules them in one batch, each on the newest version of its own request's slot
        (the server maps a version's name to its `LoRARequest`; `max_loras` is sized for the jobs
        served at once: `vllm_start.start_vllm_backend(max_jobs=...)`). Every request is checked
        before any is sent; raises as `generate` does."""
        for r in requests:
            from_engine([], LOGPROBS_MODE, r.sampling.temperature, r.sampling.top_p)   # refuse unconvertible settings first
            self._check_prompts(r.prompt_token_ids)
        with self._lock:
            models = [self._require_slot(BASE_SLOT if r.adapter is None else r.adapter).current for r in requests]
            self._running.update(models)
        try:
            futures = [self._submit_on(model, r.prompt_token_ids, r.sampling) for model, r in zip(models, requests)]
            return [[f.result() for f in fs] for fs in futures]
        finally:
            with self._lock:
                for model in models:
                    self._running[model] -= 1
                    if not self._running[model] and self._users.get(model) == set():   # evicted while running
                        self._release(model, "")

    def _submit_on(self, model: str, prompt_token_ids: list[list[int]], sampling: Sampling) -> list[Future[list[SampledCompletion]]]:
        """The server requests of one `generate` on the server's model or adapter `model` (its
        served name), one per prompt, submitted now (no slot lookup)."""
        base_seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**31, ()).item())
        return [self._pool.submit(self._request, model, ids, sampling, (base_seed + b * sampling.n) % 2**63)
                for b, ids in enumerate(prompt_token_ids)]

    def _request(self, model: str, prompt: list[int], sampling: Sampling, seed: int) -> list[SampledCompletion]:
        body = {
            "model": model, "prompt": prompt, "n": sampling.n, "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "seed": seed,
            "stop": list(sampling.stop), "include_stop_str_in_output": True,
            "stop_token_ids": sorted(self.eos_token_ids), "ignore_eos": False, "min_tokens": 0,
            "logprobs": 0, "return_token_ids": True, "skip_special_tokens": True,
        }
        greedy_copies = sampling.n if sampling.temperature == 0.0 else 1   # vLLM refuses n > 1 for greedy
        body["n"] = sampling.n // greedy_copies
        reply = self.server.post("/v1/completions", body)
        if not isinstance(reply, dict) or reply.get("model") != model:
            got = reply.get("model") if isinstance(reply, dict) else reply
            raise VLLMServerError(f"asked the server for {model!r}, it answered as {got!r}")
        choices = sorted(reply["choices"], key=lambda c: int(c["index"])) * greedy_copies
        if len(choices) != sampling.n:
            raise VLLMServerError(f"asked for {sampling.n} completions, got {len(choices)}")
        return [self._completion(c, sampling) for c in choices]

    def _completion(self, choice: dict[str, Any], sampling: Sampling) -> SampledCompletion:
        """One choice cut as `HFBackend` cuts: after the first EOS or stop-string-completing token."""
        tokens = [int(t) for t in choice["token_ids"]]
        values = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        if len(values) != len(tokens):
            raise VLLMServerError(f"{len(tokens)} tokens but {len(values)} log-probs")
        if all(math.isfinite(v) for v in values):
            logprobs = from_engine(values, LOGPROBS_MODE, sampling.temperature, sampling.top_p)
        else:   # an engine fault (fp16 overflow, a broken adapter): passed on as NaN, so the worker
            logprobs = [v if math.isfinite(v) else math.nan for v in values]   # drops the group unsigned
        end, reason = completion_end(self.tokenizer, tokens, self.eos_token_ids, sampling.stop)
        if reason == "length" and end != sampling.max_new_tokens:
            raise VLLMServerError(f"completion of {end} tokens ended ({choice.get('finish_reason')}) "
                                  f"without EOS, stop string or length {sampling.max_new_tokens}")
        finish: FinishReason = "stop" if reason == "stop" else "length"
        ids = tokens[:end]
        return SampledCompletion(token_ids=ids, logprobs=logprobs[:end], finish_reason=finish,
                                 text=self.tokenizer.decode(ids, skip_special_tokens=True))

    def sampling_problem(self, temperature: float, top_p: float) -> str:
        """The `ConventionError` a job with these settings would hit ("" at top_p = 1)."""
        try:
            from_engine([], LOGPROBS_MODE, temperature, top_p)
        except ValueError as exc:   # ConventionError, or a bad temperature
            return str(exc)
        return ""

    def recover(self) -> None:
        """After a `BackendError`: if the server no longer answers, restart it (one this process
        started) or wait for it (an operator's), then load every version the slots hold again,
        from the folders they were written to, under the same content-hash names.
        Raises VLLMServerError if the server doesn't come back or refuses an adapter."""
        with self._lock:
            if self._closed:
                raise VLLMServerError("the vLLM backend is closed")
            if self.server.healthy() and self._served() >= set(self._users):
                return   # a failed request, not a failed server
            self.server.restart()
            for version in list(self._users):
                self.server.post("/v1/load_lora_adapter",
                                 {"lora_name": version, "lora_path": str(self._dir / version)})
            log.warning("vLLM backend recovered: %d adapter versions reloaded", len(self._users))

    def _served(self) -> set[str]:
        """Names the server serves now (adapters and the base model); empty if it can't say."""
        try:
            return {str(m["id"]) for m in self.server.get("/v1/models").get("data", [])}
        except (VLLMServerError, AttributeError, KeyError, TypeError):
            return set()

    @contextlib.contextmanager
    def activated(self, adapter: str | None) -> Iterator[nn.Module]:
        """Not available: the model's weights live in the vLLM server. Raises NotImplementedError
        (score with an `HFBackend`, as the validator does)."""
        raise NotImplementedError("VLLMBackend has no in-process torch model; score with an HFBackend")
        yield  # pragma: no cover - makes this a generator

    def close(self) -> None:
        """Unload this backend's adapters from an operator's server, or end the server this
        process started; delete the adapter folders. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server.proc is None:
            with self._lock:
                for name, slot in list(self._slots.items()):
                    del self._slots[name]
                    for version in slot.loaded:
                        self._release(version, name)
        self.server.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _check_public(name: str) -> None:
    if name == BASE_SLOT:
        raise ValueError(f"adapter slot name {name!r} is reserved (the base model's zero adapter)")


def _eos_ids(model_path: Path, tokenizer: Any) -> frozenset[int]:
    """EOS ids of the tokenizer and of the model's generation config (Gemma lists several)."""
    ids: set[int] = set()
    try:
        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        gen_eos = None
    for source in (getattr(tokenizer, "eos_token_id", None), gen_eos):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(i) for i in source)
    return frozenset(ids)


def _vocab_size(meta_model: nn.Module) -> int:
    rows = cast(nn.Embedding, cast(Any, meta_model).get_input_embeddings()).num_embeddings
    head = cast(Any, meta_model).get_output_embeddings()
    return min(rows, int(head.out_features)) if head is not None else rows

def serving_dtype(model_path: Path, hf_config: Any) -> str:
    """The dtype both backends load the model in: the manifest's (bf16 Gemma, fp32 tiny), else the
    config's, else float32 (vLLM's "auto" would serve an fp32 checkpoint in bf16)."""
    name = read_manifest(model_path).get("default_dtype")
    if name is None:
        config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        name = str(config_dtype).removeprefix("torch.") if config_dtype is not None else "float32"
    return str(name)
