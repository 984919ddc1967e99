"""Built-in environments: small games that learn on a 135M chat model in minutes.

- ``builtin:calculator``: 4-digit arithmetic (``+``, ``-``, ``*``) with a ``calculator`` tool;
  reward 1 for the exact answer. With ``task.env.tools: false`` the same problems are played
  without the tool, which measures what the tool is worth.
- ``builtin:guess_number``: find a secret whole number with higher/lower feedback; reward 1 on
  success less ``step_penalty`` per wrong guess, so the return rises as the turns to success
  fall.
- ``builtin:running_sum``: numbers arrive one a turn and the sum is asked for at the end; the
  only reward is the final one.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any

NUMBER = re.compile(r"-?\d+")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of whole numbers with +, - and *.

    Args:
        expression: The expression, e.g. "1234 * 5678".
    """

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only whole numbers with +, - and *")

    try:
        return str(value(ast.parse(expression.replace("x", "*"), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as err:
        return f"error: {err}"


def last_number(text: str) -> int | None:
    """The last whole number written in ``text``, or None."""
    found = NUMBER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


class CalculatorEnv:
    """One arithmetic problem on two ``digits``-digit numbers; the ``calculator`` tool helps.

    Args:
        digits: digits of each operand.
        max_turns: replies per episode (tool calls included).
    """

    system_prompt = "Use the calculator tool for arithmetic, then reply with the number."
    demonstration = (
        {"role": "user", "content": "What is 7350 + 2168?"},
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "calculator", "arguments": '
            '{"expression": "7350 + 2168"}}</tool_call>',
        },
        {"role": "tool", "content": "9518"},
        {"role": "assistant", "content": "9518"},
        {"role": "user", "content": "What is 1203 * 4511?"},
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "calculator", "arguments": '
            '{"expression": "1203 * 4511"}}</tool_call>',
        },
        {"role": "tool", "content": "5426733"},
        {"role": "assistant", "content": "5426733"},
    )
    """Two solved problems shown before the first, when the tool is offered: a 135M model
    rarely writes a call from the schema alone."""

    def __init__(self, digits: int = 4, max_turns: int = 3) -> None:
        self.digits, self.max_turns = digits, max_turns
        self.tools = [calculator]
        self.answer = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        a, b = rng.randint(low, high), rng.randint(low, high)
        op = rng.choice(["+", "-", "*"])
        self.answer = int(calculator(f"{a} {op} {b}"))
        return f"What is {a} {op} {b}?", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        right = last_number(action) == self.answer
        return "", float(right), True, False, {"success": right}


class GuessNumberEnv:
    """Guess a secret whole number in ``[low, high]``; each wrong guess is told higher or lower.

    Args:
        low, high: the range.
        max_turns: guesses per episode.
        step_penalty: subtracted from the success reward per wrong guess before it.
    """

    def __init__(
        self, low: int = 1, high: int = 16, max_turns: int = 6, step_penalty: float = 0.1
    ) -> None:
        self.low, self.high, self.max_turns = low, high, max_turns
        self.step_penalty = step_penalty
        self.secret, self.wrong = low, 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.secret, self.wrong = random.Random(seed).randint(self.low, self.high), 0
        return (
            f"I am thinking of a whole number from {self.low} to {self.high}. Guess it: reply "
            "with one number.",
            {},
        )

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        guess = last_number(action)
        if guess == self.secret:
            reward = max(1.0 - self.step_penalty * self.wrong, 0.0)
            return "Correct.", reward, True, False, {"success": True}
        self.wrong += 1
        if guess is None:
            return "Reply with one number.", 0.0, False, False, {}
        hint = "Higher." if guess < self.secret else "Lower."
        return hint, 0.0, False, False, {}


class RunningSumEnv:
    """``count`` numbers, one a turn; after the last, the model must reply with their sum. Only
    that last reply is rewarded (1 if right).

    Args:
        count: numbers per episode.
        high: the largest number.
    """

    def __init__(self, count: int = 3, high: int = 9) -> None:
        self.count, self.high = count, high
        self.max_turns = count
        self.numbers: list[int] = []
        self.turn = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        self.numbers = [rng.randint(1, self.high) for _ in range(self.count)]
        self.turn = 0
        return (
            f"I will give you {self.count} numbers, one at a time. After the last one, reply "
            f"with their sum. First number: {self.numbers[0]}.",
            {},
        )

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        if self.turn < self.count:
            last = (
                " This is the last one: reply with the sum." if self.turn == self.count - 1 else ""
            )
            return f"Next number: {self.numbers[self.turn]}.{last}", 0.0, False, False, {}
        right = last_number(action) == sum(self.numbers)
        return "", float(right), True, False, {"success": right}


BUILTIN_CLASSES = {
    "builtin:calculator": CalculatorEnv,
    "builtin:guess_number": GuessNumberEnv,
    "builtin:running_sum": RunningSumEnv,
}
