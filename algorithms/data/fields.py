"""The fields a task's rows must have, and how a row becomes a prompt.

Which fields each algorithm reads (``task.question_field`` and ``answer_field`` for RL,
``prompt_field`` with ``response_field`` for SFT or ``chosen_field`` and ``rejected_field`` for
DPO), the fields ``task.prompt_template`` names, and the user turn and :class:`Example` built
from one row. No ``datasets`` here: :mod:`pbt.algorithms.data.rows` reads the rows.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from typing import Any

from pbt.algorithms.data.examples import Example
from pbt.config import TaskConfig
from pbt.config.errors import ConfigError

Row = dict[str, Any]
"""One row of the user's data: field name -> value."""


def required_fields(cfg: TaskConfig, algorithm: str) -> dict[str, str]:
    """``{manifest key: field name}`` that every row must have for ``algorithm``."""
    if algorithm == "SFT":
        keys = ["prompt_field", "response_field"]
    elif algorithm == "DPO":
        keys = ["prompt_field", "chosen_field", "rejected_field"]
    else:
        keys = ["question_field", "answer_field"]
    if algorithm in ("SFT", "DPO") and cfg.prompt_template is not None:
        keys.remove("prompt_field")
    return {f"task.{k}": getattr(cfg, k) for k in keys}


def check_fields(found: Sequence[str], wanted: dict[str, str], where: str) -> None:
    """Every wanted field is among ``found``.

    Raises:
        ConfigError: one problem per missing field, listing the fields the rows have.
    """
    have = ", ".join(found)
    problems = [
        f"{key} ({name!r}) is not a field of {where}; its rows have: {have}; set {key} to one "
        "of them, or rename the field in the file"
        for key, name in wanted.items()
        if name not in found
    ]
    if problems:
        raise ConfigError(problems)


def template_fields(template: str) -> list[str]:
    """The row fields ``task.prompt_template`` names.

    Raises:
        ConfigError: not a format string, or a positional ``{}`` field.
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ConfigError(
            [
                f"task.prompt_template ({template!r}) is not a format string ({err}); write "
                "{field} for a row's field and {{ or }} for a literal brace"
            ]
        ) from None
    names = [re.split(r"[.\[]", name)[0] for _, name, _, _ in parsed if name is not None]
    if any(not name or name.isdigit() for name in names):
        raise ConfigError(
            [
                f"task.prompt_template ({template!r}) has a positional field ({{}}); name the "
                "row's field, e.g. {question}"
            ]
        )
    return names


def check_template(template: str | None, found: Sequence[str], where: str) -> None:
    """Every field the template names is a field of the rows."""
    if template is None:
        return
    unknown = [name for name in template_fields(template) if name not in found]
    if unknown:
        raise ConfigError(
            [
                f"task.prompt_template ({template!r}) names {', '.join(map(repr, unknown))}, not a "
                f"field of {where}; its rows have: {', '.join(found)}; fix the template"
            ]
        )


def user_turn(cfg: TaskConfig, field: str) -> Callable[[Row], str | None]:
    """A row's user turn: the template filled from the row, or None (``field`` as is)."""
    template = cfg.prompt_template
    if template is None:
        return lambda row: None
    return lambda row: template.format(**row)


def rl_example(cfg: TaskConfig) -> Callable[[Row], Example]:
    """Makes an RL row into an :class:`Example`: the question and answer fields as they are,
    the prompt from ``task.prompt_template``, the system turn from ``task.system_prompt``, the
    start of the reply from ``task.assistant_prefill``."""
    question, answer, system = cfg.question_field, cfg.answer_field, cfg.system_prompt
    prompt, prefill = user_turn(cfg, question), cfg.assistant_prefill
    return lambda row: Example(row[question], row[answer], prompt(row), system, prefill)
