"""The built-in `calculator` environment (version 1): arithmetic word problems with a tool.

The model may call a calculator by writing `<calc>EXPRESSION</calc>`; its turn stops right after
`</calc>` and the environment answers ` = RESULT` (or ` = error: ...`), then the model goes on.
A turn that ends otherwise (a newline, EOS or the length limit) ends the episode; its last
`Answer: N` (else its last integer) is the answer. The first observation is a two-example block
showing the syntax (a base model follows examples better than instructions), then the problem.

Expressions are evaluated safely: Python's `ast` restricted to numbers, + - * / // % ** and
unary signs, at most 64 characters, exponents at most 12, results at most 1e15 in magnitude;
nothing else runs, so a call cannot hang or reach anything.

Rewards (weights): `correct_reward` 1.0, `format_reward` 0.1 (an `Answer:` line; half for a bare
integer, which keeps some reward variance in groups of an untrained model),
`shortest_correct_reward` 0.2, a group-level reward (`protocol.envs.group_rewards`): the correct
episodes of minimal length in their group. Total in [0, 1.3].
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from swarmrl.protocol.envs.base import HELDOUT_START, PromptSpec, check_seed_index
from swarmrl.protocol.envs.episode import EpisodeEnv, Reply
from swarmrl.protocol.envs.group_rewards import shortest_correct_bonus

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_ANSWER = re.compile(r"Answer:\s*(-?\d+)")
_INT = re.compile(r"-?\d+")
MAX_EXPRESSION = 64
MAX_EXPONENT = 12
MAX_MAGNITUDE = 1e15

EXAMPLES = (
    "Q: A box holds 12 pens. How many pens are in 3 boxes?\nA: <calc>12*3</calc> = 36. Answer: 36\n\n"
    "Q: Sam had 50 stickers and gave away 18. How many are left?\nA: <calc>50-18</calc> = 32. Answer: 32\n\n"
)

# name -> (weight, template, op, range of a, range of b)
PROBLEMS: dict[str, tuple[float, str, str, range, range]] = {
    "add": (0.3, "A farm has {a} sheep and buys {b} more. How many sheep does it have?", "+",
            range(100, 1000), range(10, 1000)),
    "sub": (0.3, "A library had {a} books and lent out {b}. How many books are still there?", "-",
            range(100, 1000), range(10, 100)),
    "mul": (0.4, "A crate holds {a} apples. How many apples are in {b} crates?", "*",
            range(12, 100), range(3, 40)),
}

_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}


class ToolError(ValueError):
    """An expression the calculator refuses or cannot compute."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (see the module docstring for what is allowed).

    Raises:
        ToolError: anything else, a division by zero, or a result out of bounds.
    """
    text = expression.strip()
    if not text or len(text) > MAX_EXPRESSION:
        raise ToolError(f"expression must have 1 to {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ToolError("not an arithmetic expression") from exc
    value = _eval(tree.body)
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError("result too large")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or abs(left) > MAX_MAGNITUDE):
            raise ToolError(f"exponent above {MAX_EXPONENT}")
        if abs(left) > MAX_MAGNITUDE or abs(right) > MAX_MAGNITUDE:
            raise ToolError("operand too large")
        try:
            return _OPS[type(node.op)](left, right)  # type: ignore[no-any-return]
        except ZeroDivisionError as exc:
            raise ToolError("division by zero") from exc
    raise ToolError(f"{type(node).__name__} is not allowed")


def format_result(value: float) -> str:
    """An integer as digits, a float with at most 6 decimals (trailing zeros dropped)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6f}".rstrip("0").rstrip(".")


def tool_reply(turn: str) -> Reply:
    """The answer to one model turn: the tool's result when the turn ends with a call, else the end."""
    if not turn.rstrip().endswith("</calc>"):
        return Reply("", done=True)
    calls = CALL.findall(turn)
    if not calls:
        return Reply(" = error: no <calc> opening", done=False)
    try:
        return Reply(f" = {format_result(evaluate(calls[-1]))}", done=False)
    except ToolError as exc:
        return Reply(f" = error: {exc}", done=False)


def parse_answer(text: str) -> int | None:
    """The episode's answer: the last `Answer: N`, else the last integer of its last line."""
    found = _ANSWER.findall(text)
    if found:
        return int(found[-1])
    last = text.strip().rsplit("\n", 1)[-1] if text.strip() else ""
    ints = _INT.findall(last)
    return int(ints[-1]) if ints and len(ints[-1]) <= 18 else None


def tool_calls(turns: Sequence[str]) -> int:
    """How many calculator calls the model's turns hold."""
    return sum(len(CALL.findall(t)) for t in turns)


def _final(turns: Sequence[str]) -> str:
    return turns[-1] if turns else ""


def correct_reward(prompts: list[str], completions: list[str], answer: list[int], turns: list[list[str]],
                   **kwargs: Any) -> list[float | None]:
    """1.0 when the final turn's answer is right, else 0.0."""
    return [1.0 if parse_answer(_final(ts)) == int(a) else 0.0 for a, ts in zip(answer, turns, strict=True)]


def format_reward(prompts: list[str], completions: list[str], turns: list[list[str]],
                  **kwargs: Any) -> list[float | None]:
    """1.0 when the final turn holds an `Answer: N` line, 0.5 when it holds some other parseable
    answer (an integer on its last line), else 0.0."""
    return [1.0 if _ANSWER.search(_final(ts)) else 0.5 if parse_answer(_final(ts)) is not None else 0.0
            for ts in turns]


def shortest_correct_reward(prompts: list[str], completions: list[str], answer: list[int],
                            turns: list[list[str]], group: list[Any], **kwargs: Any) -> list[float | None]:
    """Group-level: 1.0 for the correct episodes with the shortest text in their group."""
    correct = [parse_answer(_final(ts)) == int(a) for a, ts in zip(answer, turns, strict=True)]
    return list(shortest_correct_bonus(correct, [len(c) for c in completions], group))


def is_heldout_problem(a: int, op: str, b: int) -> bool:
    """Whether a problem belongs to the held-out split (a fixed hash, one in eight)."""
    return hashlib.sha256(f"calculator-v1:{a}{op}{b}".encode()).digest()[0] < 32


class CalculatorEnv(EpisodeEnv):
    """Word problems with a calculator tool; see the module docstring."""

    name = "calculator"
    version = "1"
    reward_funcs = (correct_reward, format_reward, shortest_correct_reward)
    reward_weights = (1.0, 0.1, 0.2)
    reward_range = (0.0, 1.3)
    regrade_tolerance = 1e-6
    stop = ("</calc>", "\n")
    max_new_tokens = 24
    max_turns = 4
    group_rewards = True

    def prompt(self, seed: int, index: int) -> PromptSpec:
        """The problem at (seed, index), drawn by `random.Random(f"calculator-v1:{seed}:{index}")`
        from the index's split.

        Raises:
            ValueError: negative seed or index outside [0, 2**63).
        """
        check_seed_index(seed, index)
        rng = random.Random(f"calculator-v1:{seed}:{index}")
        heldout = index >= HELDOUT_START
        names = list(PROBLEMS)
        while True:   # terminates: every family has problems in both splits
            kind = rng.choices(names, [PROBLEMS[n][0] for n in names])[0]
            _, template, op, range_a, range_b = PROBLEMS[kind]
            a, b = rng.choice(range_a), rng.choice(range_b)
            if is_heldout_problem(a, op, b) == heldout:
                break
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        text = f"{EXAMPLES}Q: {template.format(a=a, b=b)}\nA:"
        return PromptSpec(index=index, text=text, info={"answer": answer, "family": kind, "expression": f"{a}{op}{b}"})

    def reply(self, spec: PromptSpec, turns: Sequence[str]) -> Reply:
        """The tool's result when the last turn ends with a call, else the end of the episode."""
        return tool_reply(turns[-1])

    def scripted_turn(self, spec: PromptSpec, turns: Sequence[str]) -> str:
        """The reference player: calls the tool on the problem, then answers with its result."""
        if not turns:
            return f" <calc>{spec.info['expression']}</calc>"
        return f". Answer: {spec.info['answer']}\n"

    @staticmethod
    def tool_calls(turns: Sequence[str]) -> int:
        """Calculator calls in an episode's turns (`swarmrl eval`'s tool-call rate)."""
        return tool_calls(turns)

    @staticmethod
    def solved(info: dict[str, Any], turns: Sequence[str]) -> bool:
        """Whether the final answer is right (for `swarmrl eval`)."""
        return parse_answer(_final(turns)) == int(info["answer"])
