"""Deleting the checkpoints a campaign no longer references, and what cut-off writes left
behind, so that its disk stays bounded. No torch here."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from pbt.config.errors import PbtError
from pbt.controller.store import CampaignStore
from pbt.protocol.crash import crash_point
from pbt.protocol.paths import inside


def collect_garbage(
    directory: Path, store: CampaignStore, writing: set[str], say: Callable[[str], None]
) -> None:
    """Delete checkpoints nothing references any more, and the temporary folders of writes
    that were cut off. No member runs while this does but the next generation's members handed
    ahead (``writing``: their ids, :mod:`pbt.launch.handahead`), whose checkpoints may be being
    written: their temporary folders are left alone. A recorded path that leads outside the
    checkpoints folder is forgotten, its target left alone."""
    for path in store.unreferenced_checkpoints():
        try:
            inside(directory, path, "checkpoints", "an unreferenced checkpoint")
        except PbtError as err:
            say(f"  not deleting it: {err}")
        else:
            _remove(directory / path)
        crash_point("gc")
        store.forget_checkpoint(path)
    folder = directory / "checkpoints"
    if folder.is_dir() and not folder.is_symlink():
        for leftover in folder.glob(".*"):
            name = leftover.name[1:].partition(".tmp-")[0].partition(".old-")[0]
            if name != leftover.name[1:] and name not in writing:
                _remove(leftover)


def _remove(path: Path) -> None:
    """Delete a checkpoint folder; a symlink is unlinked, never followed."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
