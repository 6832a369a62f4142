"""What the calc agents share: the task's problem from its seed, the calculator tool, the
answer's score. The same task, seed and scoring as the built-in ``calc`` environment."""

from __future__ import annotations

import re

from tiderl.env.calc import CALCULATOR_SCHEMA, CalcEnv, calculator, read_number

SYSTEM = CalcEnv.system_prompt
TOOLS = [CALCULATOR_SCHEMA]
MAX_TURNS = 4  # model calls per task
# what the built-in calc environment answers a turn with neither a call nor an answer
NUDGE = "No tool call and no <answer>...</answer> found: call a tool or give the final answer."
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def problem(task: str | None, seed: int) -> tuple[str, str]:
    """The question and its answer for (task text, seed)."""
    made = CalcEnv().make_task(task, seed)
    return made.prompt, made.answer


def run_calculator(arguments: dict) -> str:
    try:
        return calculator(arguments.get("expression", ""))
    except (ValueError, TypeError) as exc:
        return f"error: {exc}"


def score(text: str | None, answer: str) -> float | None:
    """1.0 for the right ``<answer>``, 0.0 for a wrong one, None if the text gives none."""
    match = _ANSWER.search(text or "")
    if match is None:
        return None
    value = read_number(match.group(1))
    return 1.0 if value is not None and value == float(answer) else 0.0
