"""Loading a prepared causal LM, and what every role does with it the same way: prompt token ids,
the LoRA config and wrapper, the vocabulary size.

Workers (generation), trainers (the GRPO step) and validators (recomputation) all turn prompts
into ids here, so the three agree token for token.

Tensor legend: hidden_BTH = the lm_head's input (batch, tokens, hidden size).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import peft
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from swarmrl.node.models.base_model import read_manifest


def manifest_dtype(path: Path) -> torch.dtype:
    """The dtype a prepared model folder's manifest records (float32 for a plain HF folder)."""
    return cast(torch.dtype, getattr(torch, read_manifest(Path(path)).get("default_dtype", "float32")))


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
        dtype = manifest_dtype(folder)
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


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Text from a data set, an environment reply or a model turn as token ids: no special token
    added, and none read from the text (`split_special_tokens`), so a row or a reply that spells
    `<end_of_turn>` or `<|im_end|>` is encoded as those characters, never as the control token,
    and cannot forge a turn boundary. Text without such a spelling gets the ids it always had."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The one way plain prompt text becomes token ids: BOS (if the tokenizer has one) exactly
    once, then the text as `encode_text` encodes it (no control token read from the text).

    Used by workers (generation) and validators (recomputation), so both get the same ids.
    """
    return _with_bos(tokenizer, encode_text(tokenizer, text))


def _with_bos(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[int]:
    bos = tokenizer.bos_token_id
    if bos is None:
        return ids
    while ids and ids[0] == bos:
        ids.pop(0)
    return [bos, *ids]


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Any, chat_template: bool = False) -> list[int]:
    """The one way a prompt becomes token ids, for workers, trainers and validators alike.

    Plain: `encode_prompt(tokenizer, prompt.text)`. Chat: `prompt.messages` (or one user turn
    holding `prompt.text`) through the tokenizer's chat template with the generation prompt,
    tokenized without adding special tokens (the template writes BOS where the model wants it)
    and with transformers' `sanitize_control_tokens`: a control token spelled inside a message
    (a data-set row, a few-shot answer, an environment's text) is encoded as plain text; only the
    template's own markup is encoded as control tokens (a message without such a spelling gets
    the ids it always had). Then `prompt.response_prefix`, the job's own markup (`<think>`),
    encoded as the template's text is (`_encode_continuation`).

    Raises:
        ValueError: a chat job on a tokenizer without a chat template.
    """
    if not chat_template:
        return encode_prompt(tokenizer, prompt.text)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the job renders prompts with the chat template, but this model's tokenizer has none")
    turns = getattr(prompt, "messages", ()) or (("user", prompt.text),)
    ids = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in turns], add_generation_prompt=True,
                                        tokenize=True, sanitize_control_tokens=True, return_dict=False)
    prefix = str(getattr(prompt, "response_prefix", ""))   # the reply's opening the prompt writes (<think>)
    return [int(i) for i in cast(list[int], ids)] + (_encode_continuation(tokenizer, prefix) if prefix else [])


def _encode_continuation(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Ids of `text` as it reads after the template's text: encoded after a newline that is then
    dropped, so a SentencePiece tokenizer adds no prefix space (transformers' `encode_marked_chat`
    encodes its pieces the same way)."""
    newline = list(tokenizer("\n", add_special_tokens=False).input_ids)
    ids = list(tokenizer("\n" + text, add_special_tokens=False).input_ids)
    return ids[len(newline):] if ids[:len(newline)] == newline else list(tokenizer(text, add_special_tokens=False).input_ids)


def render_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[Any], chat_template: bool = False) -> list[list[int]]:
    """`render_prompt` of each prompt (the same ids), plain prompts encoded straight by a fast
    tokenizer's Rust backend: the trainer's admission renders every leased prompt, and the
    Python wrapper around one `encode` cost more than the encoding. (A batched call is slower
    still here: its thread pool costs more than 8 short prompts save.)"""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if chat_template or backend is None:
        return [render_prompt(tokenizer, p, chat_template) for p in prompts]
    backend.no_padding()      # what the wrapper sets for an unpadded call (it sets them per call)
    backend.no_truncation()
    backend.encode_special_tokens = True   # what `encode_text`'s split_special_tokens sets
    return [_with_bos(tokenizer, backend.encode(p.text, add_special_tokens=False).ids) for p in prompts]


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


def vocab_size(model: PreTrainedModel | peft.PeftModel) -> int:
    """Token ids accepted by the model: `0 <= id < vocab_size(model)` (embedding and lm_head); a
    peft model's are its base model's."""
    base = cast(PreTrainedModel, model.get_base_model()) if isinstance(model, peft.PeftModel) else model
    rows = cast(torch.nn.Embedding, base.get_input_embeddings()).num_embeddings
    head = base.get_output_embeddings()
    return min(rows, int(head.out_features)) if head is not None else rows
