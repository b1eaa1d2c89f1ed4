"""Export the built-in `arithmetic` task as a data-set job: OUT/arithmetic.jsonl + OUT/arithmetic.toml.

Rows {"question": "6+7 =", "answer": "13", "family": ...} are drawn the way the environment
draws its prompts: a family by the environment's weights, then a problem of that family
uniformly (the few-shot problems excluded). A data-set job samples rows uniformly, so a file of
distinct problems would be a different task: the two-digit families hold most problems but
carry little of the environment's weight (base accuracy 0.45 on such a file vs 0.655 on the
environment's own prompts). Repeated problems are expected (the job warns about them); the
seed-hash split keeps every copy of a problem on the same side. `--distinct` writes each
problem once instead. The job shows the same five few-shot equations, so workers render exactly the prompt text the
installed environment produces ("2+3 = 5\\n...\\n6+7 ="). Rewards: `exact_match` on the first
line (weight 1.0) and a `regex_format` integer check (weight 0.1), the data-set twins of the
environment's correctness and format rewards.

    python scripts/export_arithmetic.py OUT_DIR [--model tiny] [--steps 5] [--rows 4000] [--distinct]
"""

from __future__ import annotations

import argparse
import json
import random
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
    """Every distinct problem of the environment's families, in a fixed order (few-shot ones excluded)."""
    out, seen = [], set()
    for family, (_, op, range_a, range_b) in FAMILIES.items():
        for a in range_a:
            for b in (range_b if op != "-" else range(range_b.start, min(range_b.stop, a + 1))):
                if (a, op, b) in FEW_SHOT or (a, op, b) in seen:
                    continue
                seen.add((a, op, b))
                out.append({"question": f"{a}{op}{b} =", "answer": str(apply_op(a, op, b)), "family": family})
    return out


def weighted_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` problems drawn as the environment draws them: a family by its weight, then one of that
    family's distinct problems uniformly."""
    by_family: dict[str, list[dict]] = {}
    for row in rows():
        by_family.setdefault(row["family"], []).append(row)
    names = list(FAMILIES)
    weights = [FAMILIES[name][0] for name in names]
    rng = random.Random(f"export-arithmetic:{seed}")
    return [rng.choice(by_family[rng.choices(names, weights)[0]]) for _ in range(n)]


def main() -> None:
    """Parse the command line and write the JSONL file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=4000, help="rows drawn with the environment's family weights")
    p.add_argument("--distinct", action="store_true", help="each distinct problem once (not the environment's mix)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = rows() if args.distinct else weighted_rows(args.rows)
    (args.out / "arithmetic.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    shots = ", ".join(f'{{prompt = "{a}{o}{b} =", answer = "{apply_op(a, o, b)}"}}' for a, o, b in FEW_SHOT)
    (args.out / "arithmetic.toml").write_text(JOB.format(model=args.model, steps=args.steps, shots=shots))
    assert format_prompt(6, "+", 7).endswith("6+7 =")
    print(f"{len(data)} rows -> {args.out / 'arithmetic.jsonl'}; job -> {args.out / 'arithmetic.toml'}")


if __name__ == "__main__":
    main()
