"""``builtin:letters``: "Write the letter q over and over." with dense partial credit: half for a
run of any one character, half for the share of the requested letter. A tiny random-weight
model learns it on a CPU within minutes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

LETTER_TEMPLATES = (
    "Write the letter {c} over and over.",
    "Repeat the letter {c} many times.",
    "Say {c} again and again.",
    "Type the letter {c} as many times as you can.",
    "Only write {c}.",
    "Fill the line with the letter {c}.",
    "Write {c} and nothing else.",
    "Give me lots of {c}.",
)


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def letters_reward(completion: str, answer: Any, question: str) -> float:
    """Partial credit for the shape, full credit for the letter, in [0, 1].

    Half the reward is the share of non-space characters taken by the most frequent one (a
    run of one letter, whatever it is); the other half is the share that is the requested
    letter (case-insensitive). ``"qqqq"`` asked for q scores 1.0, ``"aaaa"`` scores 0.5.
    """
    chars = [ch for ch in completion.lower() if not ch.isspace()]
    if not chars:
        return 0.0
    counts = Counter(chars)
    target = counts[str(answer).lower()]
    return 0.5 * (counts.most_common(1)[0][1] + target) / len(chars)


def letters_problems() -> list[tuple[str, str]]:
    """Every (prompt, letter) pair: each template with each letter."""
    return [(t.format(c=c), c) for t in LETTER_TEMPLATES for c in LETTERS]
