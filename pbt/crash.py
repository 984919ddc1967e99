"""Named crash points, for the tests that kill the controller at chosen moments.

``PBT_CRASH_AT=store:2`` makes the controller SIGKILL itself the second time it reaches the
``store`` point, exactly as a crash (or ``kill -9``) would: no cleanup, no flushing. Unset, a
crash point costs one dictionary lookup. The points:

- ``launch``: members marked running in the store, no process started yet;
- ``task``: a member task started, the others queued or running (orphans are left behind);
- ``selection``: a generation trained, its successors selected and mutated, nothing committed;
- ``store``: inside the generation's store transaction, every row written, not committed;
- ``gc``: one unreferenced checkpoint deleted from disk, the store not yet told.
"""

from __future__ import annotations

import os
import signal

POINTS = ("launch", "task", "selection", "store", "gc")
_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    """SIGKILL this process if ``PBT_CRASH_AT`` names ``name`` and this is the chosen hit."""
    spec = os.environ.get("PBT_CRASH_AT")
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
