"""Guess the hidden number: "higher" / "lower" feedback until found or out of turns.

The task names the range (``"1 100"``, ``"between 1 and 500"``, any text whose first two
integers are the bounds; one integer ``n`` means 1..n; ``None`` means 1..100); numbers stay in
0..1000 so every observation tokenizes with the word-level tokenizer. The hidden number is drawn
from ``random.Random(seed)``. An action's first integer is the guess ("guess 42", "42", "is it
42?"); an action without one gets an observation saying so and costs a turn.

Reward: ``discount ** (turns - 1)`` when found (1.0 by default), 0 when the turn cap ends the
episode; with ``partial_credit`` p > 0, an episode lost scores ``p · closeness`` of its closest
guess, closeness = 1 − ln(1 + |guess − target|) / ln(1 + 1000) (1 at the target, 0 for a guess
1000 away): a dense signal for a policy that has not found any target yet (a random-init model
samples one of ~1,450 tokens; it hits the target about once in a thousand turns). The scripted
solver is a binary search (at most 7 turns for 1..100).
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

from tiderl.env.base import Environment, StepResult

_INT = re.compile(r"\d+")
MAX_NUMBER = 1000


def parse_range(task: str | None) -> tuple[int, int]:
    """The (low, high) range a task names, clamped to 0..1000."""
    numbers = [min(int(n), MAX_NUMBER) for n in _INT.findall(task or "")][:2]
    if not numbers:
        return 1, 100
    if len(numbers) == 1:
        return 1, max(1, numbers[0])
    low, high = sorted(numbers)
    return low, high


def first_int(text: str) -> int | None:
    match = _INT.search(text)
    return int(match.group()) if match else None


class GuessEnv(Environment):
    name = "guess"

    def __init__(self, max_turns: int = 20, discount: float = 1.0, partial_credit: float = 0.0):
        super().__init__(max_turns)
        if not 0.0 <= partial_credit < 1.0:
            raise ValueError(f"partial_credit: expected a number in [0, 1), got {partial_credit}")
        self.discount = discount
        self.partial_credit = partial_credit
        self.closest: int | None = None  # the smallest |guess - target| so far
        self.low = self.high = self.target = 0
        self.turns = 0
        self.done = True
        self._lo = self._hi = 0  # the solver's interval

    def reset(self, task: str | None, seed: int) -> tuple[str, dict[str, Any]]:
        self.low, self.high = parse_range(task)
        self.target = random.Random(seed).randint(self.low, self.high)
        self._lo, self._hi = self.low, self.high
        self.turns = 0
        self.done = False
        self.closest = None
        observation = (f"guess the secret number between {self.low} and {self.high} . "
                       f"say guess and a number . you have {self.max_turns} turns .")
        return observation, {"low": self.low, "high": self.high}

    def step(self, action: str) -> StepResult:
        if self.done:
            return StepResult("the game is over .", 0.0, True, {"turns": self.turns})
        self.turns += 1
        guess = first_int(action)
        if guess == self.target:
            self.done = True
            reward = self.discount ** (self.turns - 1)
            return StepResult(f"correct ! the number is {self.target} . you won in "
                              f"{self.turns} turns .", reward, True,
                              {"turns": self.turns, "won": True})
        if guess is not None:
            distance = abs(guess - self.target)
            self.closest = distance if self.closest is None else min(self.closest, distance)
        if guess is None:
            text = "invalid action : no number found . say guess and a number ."
        elif guess < self.target:
            text = f"higher . the number is higher than {guess} ."
            self._lo = max(self._lo, guess + 1)
        elif guess > MAX_NUMBER:  # numbers above 1000 are not in the word list: do not echo
            text = f"lower . the number is at most {self.high} ."
            self._hi = min(self._hi, self.high)
        else:
            text = f"lower . the number is lower than {guess} ."
            self._hi = min(self._hi, guess - 1)
        left = self.max_turns - self.turns
        if left <= 0:
            self.done = True
            return StepResult(f"{text} no turns left . the number was {self.target} . you lost .",
                              self._partial(), True, {"turns": self.turns, "won": False})
        return StepResult(f"{text} {left} turns left .", 0.0, False, {"turns": self.turns})

    def _partial(self) -> float:
        if not self.partial_credit or self.closest is None:
            return 0.0
        return self.partial_credit * (1.0 - math.log1p(self.closest) / math.log1p(MAX_NUMBER))

    def solve(self) -> str:
        return f"guess {(self._lo + self._hi) // 2}"
