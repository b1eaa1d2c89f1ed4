"""The exported adapter: PEFT files written without the base model load with
`PeftModel.from_pretrained`, name the base model id, and carry swarmrl's model card."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import peft
import pytest
import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.models.card import add_heldout, write_model_card
from swarmrl.node.models.causal_lm import load_causal_lm, lora_config, with_lora
from swarmrl.node.submitter.client import export_peft
from swarmrl.protocol.jobspec import JobSpec, LoraSpec

JOB = "f" * 32


def _spec(base: str = "tiny", steps: int = 5) -> JobSpec:
    return JobSpec(base_model=base, base_model_sha256="0" * 64, environment="arithmetic", env_version="1",
                   steps=steps, lora=LoraSpec(rank=4, alpha=8))


@pytest.fixture()
def trained_state(model_cache: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = prepare_base_model("tiny", model_cache)
    model, _ = load_causal_lm(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)   # with_lora raises no FutureWarning
        wrapped = with_lora(model, lora_config(rank=4, alpha=8))
    gen = torch.Generator().manual_seed(3)
    state = {k: torch.randn(v.shape, generator=gen) for k, v in peft.get_peft_model_state_dict(wrapped).items()}
    return path, state


def test_export_without_the_base_model_loads_with_peft(trained_state, tmp_path: Path) -> None:
    path, state = trained_state
    out = export_peft(state, _spec(), tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny"
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                "up_proj", "v_proj"]
    base, _ = load_causal_lm(path)
    loaded = peft.PeftModel.from_pretrained(base, str(out))
    got = peft.get_peft_model_state_dict(loaded, save_embedding_layers=False)
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)


def test_card_names_the_hub_id_job_steps_reward_and_heldout(trained_state, tmp_path: Path) -> None:
    _, state = trained_state
    out = export_peft(state, _spec("google/gemma-3-270m", steps=60), tmp_path / "adapter")
    history = [{"policy_version": 59.0, "reward_mean": 0.5}, {"policy_version": 60.0, "reward_mean": 0.875}]
    card = write_model_card(out, _spec("google/gemma-3-270m", steps=60), JOB, 60, history,
                            adapter_hash=b"\xab" * 32).read_text()
    assert "base_model: google/gemma-3-270m" in card and "/root/" not in card and ".cache" not in card
    assert JOB in card and "60 of 60" in card and "0.875 (mean reward of the last step's batch)" in card
    assert "not measured yet" in card
    assert 'AutoModelForCausalLM.from_pretrained("google/gemma-3-270m")' in card
    assert "vllm serve google/gemma-3-270m --enable-lora --max-lora-rank 4" in card
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "google/gemma-3-270m"
    assert add_heldout(out, 0.655, 0.78, 200) is not None
    card = (out / "README.md").read_text()
    assert "0.780 (base model 0.655; greedy, n=200" in card
    write_model_card(out, _spec("google/gemma-3-270m", steps=60), JOB, 60, history)   # re-export keeps it
    assert "0.780" in (out / "README.md").read_text()
    facts = json.loads((out / "swarmrl.json").read_text())
    assert facts["policy_version"] == 60 and facts["job_id"] == JOB


def test_card_without_a_reward_or_for_the_local_tiny_model(trained_state, tmp_path: Path) -> None:
    _, state = trained_state
    out = export_peft(state, _spec(), tmp_path / "adapter")
    card = write_model_card(out, _spec(), JOB, 3).read_text()
    assert "| final reward | - |" in card and "random-init model swarmrl builds locally" in card
    assert add_heldout(tmp_path, 0.1, 0.2, 10) is None   # no swarmrl card there
