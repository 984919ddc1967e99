"""Value rules shared by the config sections."""

from __future__ import annotations


def positive(problems: list[str], key: str, value: float, fix: str = "") -> None:
    if value <= 0:
        problems.append(f"{key} ({value}) must be > 0{'; ' + fix if fix else ''}")
