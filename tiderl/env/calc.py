"""Arithmetic with a calculator tool: the built-in tool-calling environment.

The task asks for the value of an integer expression such as ``17 * 23 + 4``; the model calls
``calculator(expression)`` (OpenAI schema in ``/start``'s ``tools``; calls in the Hermes /
Qwen2.5 ``<tool_call>`` format, :mod:`tiderl.env.tools`) and answers ``<answer>395</answer>``.
Reward 1.0 for the right value (``391``, ``391.0`` and ``1,391`` style numbers are read), 0 for a
wrong one or none by the turn cap.

The task text's first integer is the number of operators (1 to 4; none: 2); the expression is
drawn from ``random.Random`` seeded by the task text and the seed, so (task, seed) fixes the
episode. Operands of ``*`` are 11..99, of ``+`` and ``-`` 2..999.

``calculator`` evaluates safely (no ``eval``): the expression is parsed with :mod:`ast` and only
numbers, ``+ - * / // % **`` and parentheses are evaluated, at most 200 characters, exponents up
to 64 and every intermediate value under 10**30 in magnitude; anything else is an error the
model reads. The prompts use words and symbols outside the word-level vocabulary on purpose: the
environment is meant for a byte-level BPE tokenizer (``is_word_level`` False).

Scripted solver: one calculator call with the expression, then the answer it returned (2 turns).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Callable
from typing import Any

from tiderl.env.tools import ToolEnvironment, ToolTask

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10 ** 30

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and "
                       "parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string",
                                          "description": "for example (17 * 23) + 4"}},
            "required": ["expression"],
        },
    },
}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError for anything else."""
    if not isinstance(expression, str):
        raise ValueError("expression: expected a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression: longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
    raise ValueError(f"unsupported: {type(node).__name__}; use numbers, + - * / // % ** and "
                     "parentheses")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex) or abs(value) >= MAX_MAGNITUDE:
        raise ValueError("the result is too large" if not isinstance(value, complex)
                         else "the result is not a real number")
    return value


def format_number(value: int | float) -> str:
    """``391`` for integral values (``391.0`` included), else up to 12 significant digits."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def calculator(expression: str) -> str:
    return format_number(evaluate(expression))


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def read_number(text: str) -> float | None:
    """The first number in ``text`` (commas between digits ignored), or None."""
    match = _NUMBER.search(text)
    return float(match.group().replace(",", "")) if match else None


class CalcEnv(ToolEnvironment):
    name = "calc"
    tool_schemas = (CALCULATOR_SCHEMA,)
    system_prompt = ("You solve arithmetic problems. Call the calculator tool to compute, then "
                     "give the final value as <answer>NUMBER</answer>.")

    def tool_functions(self) -> dict[str, Callable[..., Any]]:
        return {"calculator": calculator}

    def make_task(self, task: str | None, seed: int) -> ToolTask:
        numbers = [int(n) for n in re.findall(r"\d+", task or "")]
        num_ops = min(max(numbers[0], 1), 4) if numbers else 2
        rng = random.Random(f"calc|{task or ''}|{seed}")
        expression = str(rng.randint(11, 99))
        for _ in range(num_ops):
            op = rng.choice("+-*")
            operand = rng.randint(11, 99) if op == "*" else rng.randint(2, 999)
            expression = f"{expression} {op} {operand}"
        prompt = f"What is {expression}?"
        return ToolTask(prompt, format_number(evaluate(expression)),
                        {"expression": expression})

    def score(self, answer: str, task: ToolTask) -> float:
        value = read_number(answer)
        return 1.0 if value is not None and value == float(task.answer) else 0.0

    def solve(self) -> str:
        results = [m.content for m in self.tool_results
                   if m.name == "calculator" and not m.content.startswith("error")]
        if results:
            return f"<answer>{results[-1]}</answer>"
        call = {"name": "calculator", "arguments": {"expression": self.task.info["expression"]}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
