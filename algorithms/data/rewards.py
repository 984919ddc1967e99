"""Rewards: one or several weighted reward functions, scored over a batch, every call guarded.

A reward function has AgileRL's signature ``reward_fn(completion: str, answer, question) ->
float``; with ``batched: true`` it takes lists ``(completions, answers, questions)`` and returns
one number per completion. The name may also be an OpenEnv rubric, as AgileRL's
``rubric_name`` (:mod:`pbt.algorithms.data.rubrics`). :class:`Reward` holds the terms of a task (its own reward for a
built-in task, else the user's ``task.reward`` or ``task.rewards``) and scores a batch into the
weighted sum and each term's raw values, which are logged as ``reward/<name>``.

Every call is guarded: one that raises, runs past ``task.reward_timeout_s``, or returns anything
but a finite ``int`` or ``float`` (None, NaN, inf, a bool, a string even if it reads as a
number, a list of the wrong length) raises :class:`~pbt.config.errors.RewardError`, one line that
names the function, the row and what it returned. Nothing is silently counted as 0. A call that
raised or returned a bad value is made once more on the same input first: when that fails too,
the error is ``reproduced`` and a campaign does not retry the member (it would fail the same
way); when it succeeds, its value counts. A call runs in a daemon thread so that the caller can
stop waiting for one that hangs: the thread cannot be killed, but it keeps neither the member nor
its process from ending. The user's file is imported in such a thread too, within the same time.

:func:`check_reward_terms` is ``pbt check``'s look at the user's rewards: each loads, takes
``(completion, answer, question)``, and one call on a sample row returns a finite number.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import inspect
import math
import numbers
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from pbt.algorithms.data.rubrics import is_rubric, rubric_reward
from pbt.config import RewardRef, TaskConfig
from pbt.config.errors import ConfigError, RewardError

RewardFn = Callable[[str, Any, str], float]
T = TypeVar("T")
SIGNATURE = "(completion, answer, question) -> float"
BATCHED_SIGNATURE = "(completions, answers, questions) -> list of floats"
IMPORT_TIMEOUTS = 10
"""A reward file's top level may run for this many ``task.reward_timeout_s`` (it may load a
judge); past it, the import is taken for a hang."""
EXCERPT_CHARS = 80
"""How much of a completion a reward error quotes."""
SIGNAL_HINT = (
    " (reward calls run outside the main thread, so that task.reward_timeout_s can stop them: "
    "turn off the function's own signal-based timeout)"
)


class Row(Protocol):
    """What a reward is judged against: a prompt's question and answer."""

    question: str
    answer: Any


@dataclass(frozen=True, slots=True)
class RewardTerm:
    """One reward function in the weighted sum.

    Attributes:
        name: its metric name, ``reward/<name>`` (letters, digits, ``_`` and ``.``).
        source: how errors name it: ``file.py:function``, or the task for a task's own reward.
        fn: the function.
        weight: its factor in the sum.
        batched: whether ``fn`` takes lists and returns one number per completion.
    """

    name: str
    source: str
    fn: Callable[..., Any]
    weight: float = 1.0
    batched: bool = False


class Reward:
    """A task's reward: the weighted sum of its terms, each call guarded.

    Args:
        terms: the reward functions (at least one).
        timeout_s: how long one call (one completion, or one batch of a batched term) may take.
    """

    def __init__(self, terms: Sequence[RewardTerm], timeout_s: float = 30.0) -> None:
        if not terms:
            raise ValueError("a reward needs at least one term")
        self.terms = list(terms)
        self.timeout_s = float(timeout_s)
        self._runner = _Runner()

    @property
    def names(self) -> list[str]:
        """The terms' metric names, in order."""
        return [t.name for t in self.terms]

    def __call__(
        self, rows: Sequence[Row], completions: Sequence[str]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Score ``completions[i]`` against ``rows[i]``.

        Returns:
            The weighted total ``[N]`` (float32) and each term's raw values ``{name: [N]}``.

        Raises:
            RewardError: a call raised, timed out, or returned something that is not a finite
                number (or a batched term returned a list of the wrong length).
        """
        if len(rows) != len(completions):
            raise ValueError(f"{len(completions)} completions for {len(rows)} rows")
        parts = {t.name: self._score_term(t, rows, completions) for t in self.terms}
        total = torch.zeros(len(rows), dtype=torch.float32)
        for term in self.terms:
            total += term.weight * parts[term.name]
        return total, parts

    def probe(self, row: Row, completion: str) -> list[str]:
        """Each term called once on ``row`` and ``completion`` (``pbt check``): one problem
        (the :class:`RewardError`'s line) for each term that fails."""
        problems = []
        for term in self.terms:
            try:
                self._score_term(term, [row], [completion])
            except RewardError as err:
                problems.append(str(err))
        return problems

    def _score_term(self, term: RewardTerm, rows: Sequence[Row], texts: Sequence[str]) -> Tensor:
        if term.batched:
            values = _confirmed(lambda: self._batched(term, rows, texts))
        else:
            values = [
                _confirmed(lambda row=row, text=text: self._single(term, row, text))
                for row, text in zip(rows, texts, strict=True)
            ]
        return torch.tensor(values, dtype=torch.float32)

    def _single(self, term: RewardTerm, row: Row, text: str) -> float:
        return _number(
            term, self._call(term, (text, row.answer, row.question), row, text), row, text
        )

    def _batched(self, term: RewardTerm, rows: Sequence[Row], texts: Sequence[str]) -> list[float]:
        if not rows:
            return []
        args = (list(texts), [r.answer for r in rows], [r.question for r in rows])
        values = self._call(term, args, rows[0], texts[0], batch=len(rows))
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise RewardError(
                f"reward {term.source} (batched) returned {_show(values)} for a batch of "
                f"{len(rows)} completions; a batched reward returns a list of {len(rows)} "
                "numbers, one per completion: fix the function, or set batched: false"
            )
        if len(values) != len(rows):
            raise RewardError(
                f"reward {term.source} (batched) returned {len(values)} values for a batch of "
                f"{len(rows)} completions; return one number per completion, in order"
            )
        return [_number(term, v, r, t) for v, r, t in zip(values, rows, texts, strict=True)]

    def _call(self, term: RewardTerm, args: tuple, row: Row, text: str, batch: int = 0) -> Any:
        """``term.fn(*args)`` in the guard thread; its value, or a :class:`RewardError`."""
        where = _where(row, text, batch)
        try:
            return self._runner.call(term.fn, args, self.timeout_s)
        except _Hung:
            raise RewardError(
                f"reward {term.source} took longer than task.reward_timeout_s "
                f"({self.timeout_s:g} s) {where}; make it faster, or raise task.reward_timeout_s",
                reproduced=False,
            ) from None
        except Exception as err:
            hint = SIGNAL_HINT if "main thread" in str(err) else ""
            raise RewardError(
                f"reward {term.source} raised {type(err).__name__}: {_one_line(err)} {where}"
                f"{hint}; fix the function"
            ) from err


def _confirmed(score: Callable[[], T]) -> T:
    """``score()``, made once more when it fails with a :class:`RewardError` that is not a
    timeout (a timeout is not waited for twice): the second failure is raised (reproduced, the
    same input failing twice), or the second value returned."""
    try:
        return score()
    except RewardError as err:
        if not err.reproduced:
            raise
    return score()


class _Hung(Exception):
    """A call ran past its time."""


class _Runner:
    """Runs calls one at a time in a daemon thread, so that the caller can stop waiting for
    one that hangs; a hung thread is abandoned and a fresh one serves the next call."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue | None = None

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        """``fn(*args)``'s value or exception; :class:`_Hung` after ``timeout_s`` seconds."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(
                target=_serve, args=(self._jobs,), name="pbt-reward", daemon=True
            ).start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, future))
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            if future.done():  # it finished just now, or raised TimeoutError itself
                return future.result()
            self._jobs.put(None)  # the thread ends if the call ever returns
            self._jobs = None
            raise _Hung from None


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        fn, args, future = job
        try:
            future.set_result(fn(*args))
        except BaseException as err:
            future.set_exception(err)


def _number(term: RewardTerm, value: Any, row: Row, text: str) -> float:
    """``value`` as a float when it is a finite real number (not a bool); else the error."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number):
            return number
    raise RewardError(
        f"reward {term.source} returned {_show(value)} {_where(row, text)}; a reward must return "
        "a finite int or float for every completion (not None, NaN, inf, a bool or a string): "
        "fix the function"
    )


def _show(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _where(row: Row, text: str, batch: int = 0) -> str:
    """The row a call failed on, on one line."""
    quoted = f"question {_excerpt(str(row.question))}, completion {_excerpt(text)}"
    return f"for a batch of {batch} completions (the first: {quoted})" if batch else f"for {quoted}"


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or "(no message)"


# -- building a task's reward ----------------------------------------------------------------


def build_reward(cfg: TaskConfig, base_dir: str | Path, default: RewardTerm | None) -> Reward:
    """The task's reward: the user's ``task.reward`` or ``task.rewards`` when given, else the
    task's own ``default``; calls limited to ``task.reward_timeout_s``.

    Raises:
        ConfigError: a reward file or function that cannot be loaded, or no reward at all (no
            user reward and no ``default``).
    """
    refs = cfg.reward_refs()
    if not refs:
        if default is None:
            raise ConfigError(
                [
                    f"task ({cfg.source!r}) has no reward: add task.reward ({{file: rewards.py, "
                    "function: my_reward}) or task.rewards"
                ]
            )
        return Reward([default], cfg.reward_timeout_s)
    keys = cfg.reward_keys()
    names = _term_names(refs)
    terms = [
        RewardTerm(
            name,
            f"{ref.file}:{ref.function}",
            load_reward_fn(ref, base_dir, key, cfg.reward_timeout_s),
            ref.weight,
            ref.batched,
        )
        for ref, key, name in zip(refs, keys, names, strict=True)
    ]
    return Reward(terms, cfg.reward_timeout_s)


def _term_names(refs: Sequence[RewardRef]) -> list[str]:
    """Each ref's metric name: its function's name, or ``<file stem>.<function>`` where two
    functions share a name, with a number where even that repeats."""
    functions = [r.function for r in refs]
    names = [
        r.function if functions.count(r.function) == 1 else f"{Path(r.file).stem}.{r.function}"
        for r in refs
    ]
    return [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]


def load_reward_fn(
    ref: RewardRef, base_dir: str | Path, key: str = "task.reward", timeout_s: float = 30.0
) -> RewardFn:
    """Import ``ref.function`` from ``ref.file`` (relative to ``base_dir``; the import limited to
    :data:`IMPORT_TIMEOUTS` times ``timeout_s``, the time of one call) and check its signature; a rubric there (AgileRL's ``rubric_name``,
    :mod:`pbt.algorithms.data.rubrics`) scores through one.

    Raises:
        ConfigError: one line naming ``file:function`` for a missing file, an import that fails
            or hangs, a missing or non-callable name, or a function that cannot be called with
            ``(completion, answer, question)`` (the lists, when ``batched``) by position.
    """
    module = _import_file(ref, base_dir, key, timeout_s)
    where = f"{key}.function ({ref.file}:{ref.function})"
    if not hasattr(module, ref.function):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ConfigError([f"{where} is not defined in {ref.file}; its functions: {names}"])
    fn = getattr(module, ref.function)
    if is_rubric(fn):
        if ref.batched:
            problem = f"{key}.batched (true): {ref.function!r} is a rubric, which scores one "
            raise ConfigError([problem + "completion at a time; set batched: false"])
        return rubric_reward(fn, key)
    expected = BATCHED_SIGNATURE if ref.batched else SIGNATURE
    if not callable(fn):
        raise ConfigError(
            [f"{where} is {_show(fn)}, not a function; define def {ref.function}{expected}"]
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its call will tell
        return fn
    try:
        signature.bind("completion", "answer", "question")
    except TypeError:
        raise ConfigError(
            [
                f"{where} must take {expected.split(' ->')[0]} by position, but its signature "
                f"is {signature}; define def {ref.function}{expected}"
            ]
        ) from None
    return fn


def _import_file(ref: RewardRef, base_dir: str | Path, key: str, timeout_s: float) -> Any:
    """The module of ``ref.file``, executed in a guard thread: an import that raises, exits or
    runs past :data:`IMPORT_TIMEOUTS` times ``timeout_s`` is a :class:`ConfigError`."""
    path = (Path(base_dir) / ref.file).resolve()
    if not path.is_file():
        raise ConfigError([f"{key}.file ({ref.file!r}) not found at {path}; check the path"])
    spec = importlib.util.spec_from_file_location(f"pbt_user_reward_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        _Runner().call(spec.loader.exec_module, (module,), IMPORT_TIMEOUTS * timeout_s)
    except _Hung:
        raise ConfigError(
            [
                f"{key}.file ({ref.file!r}) took longer than {IMPORT_TIMEOUTS} x "
                f"task.reward_timeout_s ({IMPORT_TIMEOUTS * timeout_s:g} s) to import; move slow "
                "work out of the module's top level, or raise task.reward_timeout_s"
            ]
        ) from None
    except (Exception, SystemExit) as err:
        raise ConfigError(
            [f"{key}.file ({ref.file!r}) failed to import: {_one_line_repr(err)}; fix the file"]
        ) from None
    return module


def _one_line_repr(err: BaseException) -> str:
    return " ".join(repr(err).split())


# -- pbt check -------------------------------------------------------------------------------


def check_reward_terms(cfg: TaskConfig, base_dir: str | Path, row: Row | None) -> list[str]:
    """``pbt check``'s look at the user's rewards (``task.reward`` or ``task.rewards``): each
    loads (:func:`load_reward_fn`), and, given a sample ``row``, one call with the row's answer
    as the completion returns a finite number. Runs the user's code, guarded as a member runs
    it; one problem per reward that fails, naming its key and ``file:function``."""
    refs = cfg.reward_refs()
    keys = cfg.reward_keys()
    problems: list[str] = []
    terms: list[tuple[str, RewardTerm]] = []
    for ref, key, name in zip(refs, keys, _term_names(refs), strict=True):
        try:
            fn = load_reward_fn(ref, base_dir, key, cfg.reward_timeout_s)
        except ConfigError as err:
            problems += err.problems
            continue
        source = f"{ref.file}:{ref.function}"
        terms.append((key, RewardTerm(name, source, fn, ref.weight, ref.batched)))
    if row is None:
        return problems
    completion = row.answer if isinstance(row.answer, str) else str(row.answer)
    for key, term in terms:
        for problem in Reward([term], cfg.reward_timeout_s).probe(row, completion):
            expected = BATCHED_SIGNATURE if term.batched else SIGNATURE
            problems.append(
                f"{key}: {problem} (pbt check called it on the first training row, with the "
                f"row's answer as the completion; a reward is {term.source}{expected})"
            )
    return problems
