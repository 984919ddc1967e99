"""Where a campaign may write, load and delete: inside its own folder, nowhere else.

Names and paths that come from a store, a task, a result or a state file (member ids, recorded
checkpoint paths) are checked here before anything is written, loaded or deleted there. A path
is resolved first, symlinks and ``..`` included, so neither can lead outside; inputs that are
only read (datasets, reward files, models) are the manifest's to place and are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

from pbt.config.errors import PbtError

_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def plain_name(name: str, what: str) -> str:
    """``name`` if it is one plain path component (letters, digits, ``.``, ``_``, ``-``; no
    separator, not ``..``), to be used in a file or folder name.

    Raises:
        PbtError: naming ``what``, the value and the rule.
    """
    if not isinstance(name, str) or not _PLAIN_NAME.fullmatch(name) or ".." in name:
        raise PbtError(
            f"{what} ({name!r}) is not a plain name: it must be letters, digits, '.', '_' or "
            "'-', start with a letter or digit and hold no '..', since it names a folder of the "
            "campaign; the store or file that gave it was altered: restore it from a backup"
        )
    return name


def inside(root: str | Path, relative: str | Path, under: str, what: str) -> Path:
    """``root / relative`` resolved, if it lies within ``root / under`` (``root`` resolved, so
    the campaign folder itself may be a symlink, but nothing below it leads out).

    Raises:
        PbtError: the path is absolute, climbs out, or a symlink takes it elsewhere; the
            message names ``what``, the value and where it would have gone.
    """
    base = Path(root).resolve() / under
    target = (Path(root).resolve() / relative).resolve()
    if not target.is_relative_to(base) or target == base:
        raise PbtError(
            f"{what} ({str(relative)!r}) resolves to {target}, which is not inside {base}; a "
            "campaign writes, loads and deletes only within its own folder, so it was refused "
            "and left alone; the store or file that named it was altered: restore it from a "
            "backup"
        )
    return target
