"""Value rules shared by the config sections.

Numbers that are durations, timeouts, sizes or counts declare their lower bound in their type,
``steps: PositiveInt = 100`` or ``task_timeout_s: Seconds | None = None``, and
:func:`bound_problems` checks every such field of a section in one pass (each section's
``check()`` starts with it). A bound also refuses NaN and infinities, so a NaN cannot slip
through a ``> 0`` rule. The loader refuses NaN and infinities in every float field, bounded or
not, before a section is built (:mod:`pbt.config.read.loader`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import reprlib
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any


@dataclass(frozen=True, slots=True)
class Bound:
    """A lower bound on a numeric field: ``value > low`` when ``strict``, else ``value >= low``;
    ``fix`` is what the message suggests."""

    low: float = 0
    strict: bool = True
    fix: str = ""

    def problem(self, key: str, value: float) -> str | None:
        """The one-line problem of ``value`` under this bound, or None when it holds."""
        finite = math.isfinite(value)
        holds = finite and (value > self.low if self.strict else value >= self.low)
        if holds:
            return None
        bound = f"{'>' if self.strict else '>='} {self.low:g}"
        rule = f"must be a finite number {bound}" if not finite else f"must be {bound}"
        return f"{key} ({value}) {rule}{'; ' + self.fix if self.fix else ''}"


def above_zero(fix: str = "") -> Bound:
    """``> 0``, e.g. ``Annotated[int, above_zero("use a rank such as 8")]``."""
    return Bound(0, True, fix)


def at_least_zero(fix: str = "") -> Bound:
    """``>= 0``, e.g. ``Annotated[int, at_least_zero("0 disables")]``."""
    return Bound(0, False, fix)


Seconds = Annotated[float, above_zero()]
"""A duration or timeout in seconds: > 0."""
PositiveFloat = Annotated[float, above_zero()]
"""A size or scale that must be > 0 (GiB, hours, a learning rate)."""
NonNegativeFloat = Annotated[float, at_least_zero()]
PositiveInt = Annotated[int, above_zero()]
"""A count that zero would make meaningless (steps, members, slots, attempts)."""
Count = Annotated[int, at_least_zero()]
"""A count or index where 0 means something (none, the first, disabled)."""


_REPR = reprlib.Repr()  # Python 3.11's takes no arguments
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 3, 8, 8
_REPR.maxstring, _REPR.maxlong, _REPR.maxother = 60, 24, 60


def shown(value: Any) -> str:
    """``repr(value)`` cut to a line: a message quotes a value, never a whole structure (a list
    of a million items, a 400-digit number, a 200,000-character name)."""
    return _REPR.repr(value)


def bound_problems(config: object, prefix: str) -> list[str]:
    """A problem for each field of dataclass ``config`` whose type declares a :class:`Bound`
    that its value breaks (``None`` values and non-numbers are left to the type check); a list
    of bounded numbers is checked item by item."""
    problems: list[str] = []
    for name, (bound, of_list) in _bounds(type(config)).items():
        value = getattr(config, name)
        key = f"{prefix}.{name}"
        items = enumerate(value) if of_list and isinstance(value, list) else None
        for k, v in items if items is not None else [(None, value)]:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            problem = bound.problem(key if k is None else f"{key}[{k}]", v)
            if problem is not None:
                problems.append(problem)
    return problems


@functools.cache
def _bounds(cls: type) -> dict[str, tuple[Bound, bool]]:
    """``{field: (its bound, whether the bound is on a list's items)}`` of dataclass ``cls``."""
    hints = typing.get_type_hints(cls, include_extras=True)
    found: dict[str, tuple[Bound, bool]] = {}
    for f in dataclasses.fields(cls):
        for hint in _alternatives(hints[f.name]):
            of_list = typing.get_origin(hint) is list
            inner = typing.get_args(hint)[0] if of_list else hint
            bound = _bound_of(inner)
            if bound is not None:
                found[f.name] = (bound, of_list)
    return found


def _alternatives(hint: Any) -> tuple[Any, ...]:
    """The members of a union (``X | None``), or the hint itself."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _bound_of(hint: Any) -> Bound | None:
    if typing.get_origin(hint) is not Annotated:
        return None
    return next((m for m in hint.__metadata__ if isinstance(m, Bound)), None)


def positive(problems: list[str], key: str, value: float, fix: str = "") -> None:
    """Append a problem unless ``value`` is a finite number > 0 (for values that are not a
    bounded field of their own, such as an entry of a mapping)."""
    problem = above_zero(fix).problem(key, value)
    if problem is not None:
        problems.append(problem)
