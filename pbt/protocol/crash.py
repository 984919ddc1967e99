"""Named crash points, for the tests that kill the controller at chosen moments, and fault
points, for the tests that make a member's writes fail as a full disk would.

``PBT_CRASH_AT=store:2`` makes the controller SIGKILL itself the second time it reaches the
``store`` point, exactly as a crash (or ``kill -9``) would: no cleanup, no flushing. Unset, a
crash point costs one dictionary lookup. The points:

- ``launch``: members marked running in the store, no process started yet;
- ``task``: a member task started, the others queued or running (orphans are left behind);
- ``ahead``: a generation's results all in, the next generation's first members started on
  idle workers while its last checkpoints are written, nothing committed;
- ``selection``: a generation trained, its successors selected and mutated, nothing committed;
- ``store``: inside the generation's store transaction, every row written, not committed;
- ``commit``: the generation committed (the last one too), nothing after it done yet;
- ``gc``: one unreferenced checkpoint deleted from disk, the store not yet told.

``PBT_DELAY_AT=checkpoint_write:0.5`` makes every checkpoint write of this process start 0.5 s
late, as a slow disk would (see :func:`delay_point`): for the tests of what overlaps a write.
``PBT_FAULT_AT=disk_full:2`` makes the second checkpoint file this process writes fail with
``OSError(ENOSPC)`` before a byte of it lands, as a full disk would (see
:func:`fault_point`). Members inherit the variable from the controller.
"""

from __future__ import annotations

import errno
import os
import signal
import time

POINTS = ("launch", "task", "ahead", "selection", "store", "commit", "gc")
FAULTS = ("disk_full",)
_hits: dict[str, int] = {}
_fault_hits: dict[str, int] = {}


def _chosen(variable: str, name: str, hits: dict[str, int]) -> bool:
    """Whether ``variable`` (``point:n``) names ``name`` and this is its ``n``-th hit."""
    spec = os.environ.get(variable)
    if not spec:
        return False
    point, _, nth = spec.partition(":")
    if point != name:
        return False
    hits[name] = hits.get(name, 0) + 1
    return hits[name] == int(nth or 1)


def crash_point(name: str) -> None:
    """SIGKILL this process if ``PBT_CRASH_AT`` names ``name`` and this is the chosen hit."""
    if _chosen("PBT_CRASH_AT", name, _hits):
        os.kill(os.getpid(), signal.SIGKILL)


def fault_point(name: str, path: str | os.PathLike[str]) -> None:
    """Raise the error fault point ``name`` stands for, about to write ``path``, if
    ``PBT_FAULT_AT`` names it and this is the chosen hit.

    Raises:
        OSError: ``disk_full``: ``ENOSPC`` (No space left on device) for ``path``.
    """
    if _chosen("PBT_FAULT_AT", name, _fault_hits):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def delay_point(name: str) -> None:
    """Sleep the seconds ``PBT_DELAY_AT`` (``point:seconds``) gives, if it names ``name``."""
    spec = os.environ.get("PBT_DELAY_AT")
    if spec:
        point, _, seconds = spec.partition(":")
        if point == name:
            time.sleep(float(seconds))
