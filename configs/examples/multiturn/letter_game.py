"""A multi-turn environment of your own: find the hidden letter, with a hint tool.

The model guesses one letter a turn; a wrong guess is told "earlier" or "later" in the
alphabet. ``alphabet_position`` is a tool the model may call to look a letter's position up.
The reward is 1 for finding the letter, less 0.1 per wrong guess before it.
"""

from __future__ import annotations

import random
import string


def alphabet_position(letter: str) -> int:
    """The position of a letter in the alphabet (a is 1).

    Args:
        letter: One letter, a to z.
    """
    return string.ascii_lowercase.index(letter.strip().lower()[:1]) + 1


class LetterGame:
    """Find a hidden lowercase letter among the first ``span`` letters of the alphabet."""

    system_prompt = "Find the hidden letter. Reply with one letter."

    def __init__(self, span: int = 8, max_turns: int = 4) -> None:
        self.letters = string.ascii_lowercase[:span]
        self.max_turns = max_turns
        self.tools = [alphabet_position]
        self.hidden, self.wrong = "a", 0

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.hidden, self.wrong = random.Random(seed).choice(self.letters), 0
        return f"I hid one of the letters {', '.join(self.letters)}. Which is it?", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        guess = next((c for c in action.lower() if c in string.ascii_lowercase), None)
        if guess == self.hidden:
            return "Found it.", 1.0 - 0.1 * self.wrong, True, False, {"success": True}
        self.wrong += 1
        if guess is None:
            return "Reply with one letter.", 0.0, False, False, {}
        return ("Later." if guess < self.hidden else "Earlier."), 0.0, False, False, {}
