"""Export the built-in `arithmetic` task as a data-set job: OUT/arithmetic.jsonl + OUT/arithmetic.toml.

Every problem of every family (both of the environment's splits; the data-set job splits rows
by its own seed hash) becomes a row {"question": "6+7 =", "answer": "13", "family": ...}; the
job shows the same five few-shot equations, so workers render exactly the prompt text the
installed environment produces ("2+3 = 5\\n...\\n6+7 ="). Rewards: `exact_match` on the first
line (weight 1.0) and a `regex_format` integer check (weight 0.1), the data-set twins of the
environment's correctness and format rewards.

    python scripts/export_arithmetic.py OUT_DIR [--model tiny] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from swarmrl.protocol.envs.arithmetic import FAMILIES, FEW_SHOT, apply_op, format_prompt

JOB = """# The built-in arithmetic task as a data-set job (scripts/export_arithmetic.py).
base_model = "{model}"
steps = {steps}

[environment]
dataset = "arithmetic.jsonl"
prompt_field = "question"
answer_field = "answer"
few_shot = [{shots}]
rewards = [{{name = "exact_match", weight = 1.0, first_line = true}},
           {{name = "regex_format", weight = 0.1, pattern = '^\\s*-?\\d+\\s*$'}}]
"""


def rows() -> list[dict]:
    """Every distinct problem of the environment's families, in a fixed order."""
    out, seen = [], set()
    for family, (_, op, range_a, range_b) in FAMILIES.items():
        for a in range_a:
            for b in (range_b if op != "-" else range(range_b.start, min(range_b.stop, a + 1))):
                if (a, op, b) in FEW_SHOT or (a, op, b) in seen:
                    continue
                seen.add((a, op, b))
                out.append({"question": f"{a}{op}{b} =", "answer": str(apply_op(a, op, b)), "family": family})
    return out


def main() -> None:
    """Parse the command line and write the JSONL file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = rows()
    (args.out / "arithmetic.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    shots = ", ".join(f'{{prompt = "{a}{o}{b} =", answer = "{apply_op(a, o, b)}"}}' for a, o, b in FEW_SHOT)
    (args.out / "arithmetic.toml").write_text(JOB.format(model=args.model, steps=args.steps, shots=shots))
    assert format_prompt(6, "+", 7).endswith("6+7 =")
    print(f"{len(data)} rows -> {args.out / 'arithmetic.jsonl'}; job -> {args.out / 'arithmetic.toml'}")


if __name__ == "__main__":
    main()
