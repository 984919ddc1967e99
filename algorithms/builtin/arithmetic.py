"""``builtin:arithmetic``: short word problems ("Tom has 3 apples and buys 5 more...") with an
exact-answer reward on the last number of the completion; for real models. The addition task
(:mod:`pbt.algorithms.builtin.addition`) shares the reward.
"""

from __future__ import annotations

import random
import re
from typing import Any

NAMES = ("Tom", "Ana", "Li", "Sam", "Mia", "Omar", "Eva", "Raj", "Zoe", "Ben")


ITEMS = ("apples", "books", "coins", "shells", "stamps", "marbles", "pencils", "cards")


def _arithmetic_problem(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    kind = rng.randrange(3)
    if kind == 0:
        q, ans = f"{name} has {a} {item} and gets {b} more. How many {item} now?", a + b
    elif kind == 1:
        a += b
        q, ans = f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        q, ans = f"{name} has {a} bags with {b} {item} each. How many {item} in total?", a * b
    return q, str(ans)


_NUMBER = re.compile(r"-?\d+")


def arithmetic_reward(completion: str, answer: Any, question: str) -> float:
    """1.0 if the last integer in the completion equals the answer, else 0.0."""
    numbers = _NUMBER.findall(completion)
    return 1.0 if numbers and int(numbers[-1]) == int(answer) else 0.0


def arithmetic_problems(rng: random.Random, count: int) -> list[tuple[str, str]]:
    """Up to ``count`` distinct (word problem, answer) pairs drawn from ``rng``."""
    seen: dict[str, tuple[str, str]] = {}
    for _ in range(count * 20):
        question, answer = _arithmetic_problem(rng)
        seen.setdefault(question, (question, answer))
        if len(seen) >= count:
            break
    return list(seen.values())
