"""Which controller and campaign a member process belongs to, so that none outlives them.

The local launcher starts every member process with two variables, which each process it starts
in turn (torchrun's ranks, their helpers) inherits:

- ``PBT_CAMPAIGN``: the campaign folder, resolved. A resumed controller ends every process
  whose environment names its campaign before it starts anything, and again before it exits
  (:func:`pbt.launch.processes.end_campaign_processes`), whatever a killed predecessor
  left running, in whatever session.
- ``PBT_CONTROLLER``: ``<pid>:<start time>`` of the controller that started it (the start in
  clock ticks after boot, ``/proc/<pid>/stat`` field 22, which tells the controller from a
  later process given the same pid). A long-lived worker watches it (:func:`watch_controller`)
  and ends within :data:`WATCH_S` of the controller's death, rather than waiting for its idle
  timeout while it holds memory.

A Slurm job gets neither: its controller may run on another node, and a resumed controller
adopts its jobs. No torch here.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

CAMPAIGN_ENV = "PBT_CAMPAIGN"
CONTROLLER_ENV = "PBT_CONTROLLER"
WATCH_S = 1.0
"""Seconds between two looks at the controller."""


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot); None when it does not exist, is
    a zombie (it has ended, not yet reaped), or there is no ``/proc``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces
    return None if fields[0] in "ZX" else int(fields[19])


def controller_token() -> str:
    """This process as ``PBT_CONTROLLER`` names it: ``<pid>:<start time>``."""
    return f"{os.getpid()}:{start_time(os.getpid())}"


def controller_alive(token: str) -> bool:
    """Whether the process ``token`` names still runs (a token that cannot be read, or a
    system without ``/proc``, counts as alive: nothing is ended on a guess)."""
    pid, _, started = token.partition(":")
    if not pid.isdigit() or not started.isdigit() or not Path("/proc/self/stat").exists():
        return True
    return start_time(int(pid)) == int(started)


def watch_controller(on_gone: Callable[[int], object], every_s: float = WATCH_S) -> bool:
    """Call ``on_gone(pid)`` from a daemon thread once the controller named by
    ``PBT_CONTROLLER`` has ended; returns whether there is one to watch."""
    token = os.environ.get(CONTROLLER_ENV, "")
    if not token:
        return False

    def watch() -> None:
        while controller_alive(token):
            time.sleep(every_s)
        on_gone(int(token.partition(":")[0]))

    threading.Thread(target=watch, name="pbt-controller-watch", daemon=True).start()
    return True
