"""The exported adapter's model card (`README.md`) and facts (`swarmrl.json`).

Both exports (`swarmrl fetch` / `swarmrl up`: `submitter.export_peft`; the trainer's own
`final/`: `JobRuntime.export`) call `write_model_card` after PEFT's `save_pretrained`: it replaces
PEFT's blank card (which names a local cache folder as the base model) with a short one, and sets
`adapter_config.json`'s `base_model_name_or_path` to the job's base model id (the hub id for Gemma)
instead of the folder the trainer loaded it from. `swarmrl eval` adds its held-out score
(`add_heldout`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

TINY = "tiny"  # swarmrl.node.models.recipes.TINY, without importing torch here
from swarmrl.protocol.jobspec import JobSpec

FACTS = "swarmrl.json"
CARD = "README.md"


def write_model_card(out: Path, spec: JobSpec, job_id: str, version: int,
                     history: Sequence[Mapping[str, float]] = (), *, adapter_hash: bytes = b"") -> Path:
    """Write `README.md` and `swarmrl.json` into the PEFT folder `out` and point its
    `adapter_config.json` at `spec.base_model`. `history`: the job's step rows (`policy_version`,
    `reward_mean`; the ledger's or the status history's); the row of `version` gives the final
    reward. Returns the card's path."""
    last = [float(r["reward_mean"]) for r in history
            if int(r["policy_version"]) == version and not math.isnan(float(r["reward_mean"]))][-1:]
    facts = {
        "job_id": job_id, "policy_version": int(version), "adapter_hash": adapter_hash.hex(),
        "base_model": spec.base_model, "environment": f"{spec.environment} v{spec.env_version}",
        "steps": int(spec.steps), "loss": spec.loss.variant,
        "lora": {"rank": spec.lora.rank, "alpha": spec.lora.alpha, "target_modules": spec.lora.target_modules},
        "reward_last_step": last[0] if last else None,
    }
    old = _read(out / FACTS)
    if old.get("job_id") == job_id and old.get("policy_version") == version and "heldout" in old:
        facts["heldout"] = old["heldout"]   # a re-export of the same version keeps its measured score
    set_base_model(out, spec.base_model)
    return _render(out, facts)


def add_heldout(out: Path, base_accuracy: float, adapter_accuracy: float, n: int) -> Path | None:
    """Record `swarmrl eval`'s held-out accuracy in the card of `out` (None: no swarmrl card there)."""
    facts = _read(out / FACTS)
    if "base_model" not in facts:
        return None
    facts["heldout"] = {"base_accuracy": base_accuracy, "adapter_accuracy": adapter_accuracy, "n": n}
    return _render(out, facts)


def set_base_model(out: Path, base_model: str) -> None:
    """Rewrite `adapter_config.json`'s `base_model_name_or_path` (PEFT saves the loaded folder)."""
    path = out / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = base_model
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def card_text(facts: dict[str, Any]) -> str:
    """The model card for `facts` (see `write_model_card`)."""
    base, lora = facts["base_model"], facts["lora"]
    targets = lora["target_modules"] if isinstance(lora["target_modules"], str) else ", ".join(lora["target_modules"])
    reward = facts.get("reward_last_step")
    held = facts.get("heldout")
    heldout = (f"{held['adapter_accuracy']:.3f} (base model {held['base_accuracy']:.3f}; greedy, "
               f"n={held['n']}, `swarmrl eval`)" if held else "not measured yet (`swarmrl eval --adapter DIR`)")
    where = ("`tiny` is a small random-init model swarmrl builds locally (`swarmrl up --model tiny`), "
             "not a hub model: load it with `swarmrl.node.models.base_model.prepare_base_model(\"tiny\")`.\n\n"
             if base == TINY else "")
    header = "\n".join(["---", f"base_model: {base}", "library_name: peft", "pipeline_tag: text-generation",
                        "tags:", "- lora", "- grpo", "- swarmrl", "---", ""])
    rows = [("base model", f"`{base}`"), ("job id", f"`{facts['job_id']}`"),
            ("environment", facts["environment"]), ("loss", facts["loss"]),
            ("steps", f"{facts['policy_version']} of {facts['steps']} (policy version {facts['policy_version']})"),
            ("final reward", f"{reward:.3f} (mean reward of the last step's batch)" if reward is not None else "-"),
            ("held-out accuracy", heldout),
            ("LoRA", f"r={lora['rank']}, alpha={lora['alpha']}, targets: {targets}")]
    if facts.get("adapter_hash"):
        rows.append(("adapter hash", f"`{facts['adapter_hash']}` (swarmrl's sha256 over the LoRA tensors)"))
    table = "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])
    return (f"{header}\n# LoRA adapter for {base}, trained by swarmrl (GRPO)\n\n{where}{table}\n\n"
            "## Load with peft\n\n```python\nfrom peft import PeftModel\n"
            "from transformers import AutoModelForCausalLM\n\n"
            f"base = AutoModelForCausalLM.from_pretrained(\"{base}\")\n"
            "model = PeftModel.from_pretrained(base, \"path/to/this/folder\")\n```\n\n"
            "## Serve with vLLM\n\n```bash\n"
            f"vllm serve {base} --enable-lora --max-lora-rank {lora['rank']} "
            "--lora-modules swarmrl=path/to/this/folder\n```\n\n"
            "then ask for `\"model\": \"swarmrl\"`; in Python: `LLM(model=..., enable_lora=True)` and "
            "`LoRARequest(\"swarmrl\", 1, \"path/to/this/folder\")`.\n")


def _render(out: Path, facts: dict[str, Any]) -> Path:
    (out / FACTS).write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
    card = out / CARD
    card.write_text(card_text(facts))
    return card


def _read(path: Path) -> dict[str, Any]:
    try:
        return cast(dict[str, Any], json.loads(path.read_text()))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
