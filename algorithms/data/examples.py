"""One row of an RL task as the algorithms see it, and the chat it becomes.

Kept apart from the loaders (``datasets`` for files, procedural code for built-in tasks) so
that every loader and every rollout engine shares one shape without importing the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Chat = str | list[dict[str, str]]
"""A prompt for the chat template: a user turn as plain text, or the turns (``role`` and
``content``) themselves. A last ``assistant`` turn is a prefill: the start of the reply, which
the completion continues."""


def chat_turns(user: str, system: str | None = None, prefill: str | None = None) -> Chat:
    """The user turn as is, or the turns: a system turn when there is a system prompt, the user
    turn, and an assistant turn that starts the reply when there is a prefill."""
    if system is None and prefill is None:
        return user
    turns = [] if system is None else [{"role": "system", "content": system}]
    turns.append({"role": "user", "content": user})
    if prefill is not None:
        turns.append({"role": "assistant", "content": prefill})
    return turns


def as_messages(chat: Chat) -> list[dict[str, str]]:
    """``chat`` as the turns the tokenizer's chat template takes."""
    return [{"role": "user", "content": chat}] if isinstance(chat, str) else list(chat)


@dataclass(frozen=True, slots=True)
class Example:
    """One prompt and the answer its reward is judged against.

    ``question`` and ``answer`` are what the reward receives, as the row holds them (an answer
    may be any JSON value); ``prompt`` is the user turn when it differs from the question (a
    ``task.prompt_template``), ``system`` a system turn before it, and ``prefill`` the start of
    the assistant's reply (``task.assistant_prefill``), which the completion continues.
    """

    question: Any
    answer: Any
    prompt: str | None = None
    system: str | None = None
    prefill: str | None = None

    @property
    def chat(self) -> Chat:
        """What the model is prompted with."""
        user = self.prompt if self.prompt is not None else str(self.question)
        return chat_turns(user, self.system, self.prefill)
