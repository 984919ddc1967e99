"""Rubrics as reward functions: what AgileRL's ``rubric_file_path`` and ``rubric_name`` name.

A rubric is OpenEnv's reward interface: an object with ``forward(action, observation) ->
float``, called as ``rubric(action, observation)`` (OpenEnv's ``Rubric.__call__`` runs its hooks
around ``forward``). AgileRL's dataset environments call it with an action whose ``message`` is
the completion and an observation holding the row's ``question`` and ``answer``; the name in
the file may also be a ``Rubric`` subclass (built once, with no arguments) or a plain
``reward_fn(completion, answer, question)``, which needs nothing from here.

A rubric becomes a ``reward_fn(completion, answer, question)`` that hands it the same two
objects. The test is by shape, not type: ``openenv`` is not imported here, the user's file
imports what it uses. Where this differs from AgileRL: only the rubric's total is the reward
(logged as ``reward/<name>``), not each component's score; the observation carries no prompt;
an async ``forward`` is refused, as AgileRL's dataset environment refuses it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pbt.config.errors import ConfigError


@dataclass(slots=True)
class RubricAction:
    """What the model did: its completion, as ``message``."""

    message: str


@dataclass(slots=True)
class RubricObservation:
    """The finished single-turn episode a rubric scores: the row's question and answer."""

    question: Any
    answer: Any
    done: bool = True
    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def is_rubric(obj: Any) -> bool:
    """Whether ``obj`` is a rubric or a rubric class: it has a callable ``forward`` (a plain
    function does not)."""
    return callable(getattr(obj, "forward", None)) and not inspect.isroutine(obj)


def rubric_reward(obj: Any, key: str) -> Callable[[str, Any, Any], Any]:
    """``reward_fn(completion, answer, question)`` scoring with the rubric ``obj`` (a class is
    built once, with no arguments).

    Raises:
        ConfigError: a rubric class that cannot be built without arguments.
    """
    rubric = obj
    if isinstance(obj, type):
        try:
            rubric = obj()
        except Exception as err:
            raise ConfigError(
                [
                    f"{key}.function ({obj.__name__!r}) is a rubric class that cannot be built "
                    f"with no arguments ({type(err).__name__}: {err}); name an instance of it "
                    "in the file instead"
                ]
            ) from None
    score = rubric if callable(rubric) else rubric.forward

    def reward(completion: str, answer: Any, question: Any) -> Any:
        result = score(RubricAction(completion), RubricObservation(question, answer))
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()
            raise TypeError("the rubric's forward is async; make it synchronous")
        return result

    return reward
