"""The environment protocol (AgileRL's ``MultiTurnEnv`` shape) and the guard every call goes
through.

An environment is any object with::

    max_turns: int
    reset(seed: int | None = None) -> (observation: str, info: dict)
    step(action: str) -> (observation: str, reward: float, terminated: bool, truncated: bool,
                          info: dict)

and optionally ``tools``: a list of plain functions the model may call (see
:mod:`pbt.algorithms.envs.tools`); ``system_prompt``: a system turn before the first
observation; and ``demonstration``: chat turns (a solved example of a tool call) between the
system turn and the first observation. The last two are shown only when tools are offered. ``info`` may hold ``success`` (bool), which the episode metrics count.

:class:`Guard` runs each call in a daemon thread so that a call that hangs past
``task.env_timeout_s`` can be abandoned: it raises :class:`~pbt.config.errors.EnvError`, one line
naming the class, the turn and the action, as it does for a call that raises or returns a
malformed value. Nothing is retried and nothing silently counts as zero.
"""

from __future__ import annotations

import concurrent.futures
import math
import numbers
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pbt.config.errors import EnvError

EXCERPT = 60
"""Characters of an action an error quotes."""


@runtime_checkable
class MultiTurnEnv(Protocol):
    """What the trainer needs of an environment (AgileRL's ``agilerl.protocols.MultiTurnEnv``)."""

    max_turns: int

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; the first observation and an info dict."""
        ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play the model's reply; the next observation, the turn's reward, whether the
        episode ended (terminated) or was cut (truncated), and an info dict."""
        ...


@dataclass(frozen=True, slots=True)
class Step:
    """One validated ``step`` result."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


class Guard:
    """Calls into one environment's code, each within ``timeout_s`` seconds, in a daemon
    thread (a hung call is abandoned, not killed: it keeps neither the member nor its process
    from ending).

    Args:
        name: how errors name the environment (its class, and file).
        timeout_s: ``task.env_timeout_s``.
    """

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name, self.timeout_s = name, timeout_s
        self._jobs: queue.SimpleQueue | None = None

    def call(self, fn: Callable[..., Any], args: tuple, what: str, turn: int, action: str) -> Any:
        """``fn(*args)``; :class:`EnvError` if it raises or runs past the timeout."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name="pbt-env", daemon=True).start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, future))
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            if not future.done():
                self._jobs.put(None)  # the thread ends if the call ever returns
                self._jobs = None
                raise self.error(
                    what, turn, action, f"ran past task.env_timeout_s ({self.timeout_s:g} s)",
                    "make it return sooner, or raise task.env_timeout_s", reproduced=False,
                ) from None  # fmt: skip
            return future.result()
        except EnvError:
            raise
        except Exception as err:
            detail = " ".join(f"{type(err).__name__}: {err}".split())
            raise self.error(what, turn, action, f"raised {detail}", f"fix {what}") from None

    def error(
        self, what: str, turn: int, action: str, problem: str, fix: str, reproduced: bool = True
    ) -> EnvError:
        """One line: the environment, the call, the turn, the action, what went wrong, the fix."""
        on = f" on action {_excerpt(action)!r}" if action else ""
        return EnvError(
            f"environment {self.name}: {what} at turn {turn}{on} {problem}; {fix}", reproduced
        )

    def reset(self, env: Any, seed: int) -> tuple[str, dict[str, Any]]:
        """``env.reset(seed)``, checked: a string observation and a dict (or None) info."""
        out = self.call(env.reset, (seed,), "reset()", 0, "")
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str)):
            raise self.error(
                "reset()", 0, "", f"returned {_show(out)}", "return (observation: str, info: dict)"
            )
        return out[0], dict(out[1] or {})

    def step(self, env: Any, action: str, turn: int) -> Step:
        """``env.step(action)``, checked: a 5-tuple whose reward is a finite int or float."""
        out = self.call(env.step, (action,), "step()", turn, action)
        shape = "return (observation: str, reward: float, terminated: bool, truncated: bool, info)"
        if not (isinstance(out, tuple) and len(out) == 5):
            raise self.error("step()", turn, action, f"returned {_show(out)}", shape)
        observation, reward, terminated, truncated, info = out
        if not _finite_number(reward):
            raise self.error(
                "step()", turn, action, f"returned the reward {_show(reward)}",
                "the reward must be a finite int or float",
            )  # fmt: skip
        if not isinstance(observation, str):
            raise self.error(
                "step()", turn, action, f"returned observation {_show(observation)}", shape
            )
        return Step(observation, float(reward), bool(terminated), bool(truncated), dict(info or {}))


def _finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return math.isfinite(float(value))


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        fn, args, future = job
        try:
            future.set_result(fn(*args))
        except BaseException as err:
            future.set_exception(err)


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= EXCERPT else text[: EXCERPT - 3] + "..."


def _show(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= EXCERPT else text[: EXCERPT - 3] + "..."
    return f"{text} ({type(value).__name__})"
