"""The worker's entry point: ``python -m pbt.worker TASK_JSON`` runs one task
(:mod:`pbt.worker.task`) and exits; ``--serve FOLDER`` runs a long-lived worker
(:mod:`pbt.worker.serve`)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from pbt.protocol import faults
from pbt.protocol.controller import watch_controller
from pbt.protocol.files import Heartbeat
from pbt.protocol.logs import quiet_library_loggers
from pbt.protocol.messages import RESULT_FILE
from pbt.worker.serve import serve
from pbt.worker.task import failed, read_task, run_task

USAGE = "usage: python -m pbt.worker TASK_JSON | --serve FOLDER [--idle-timeout S]"

CONTROLLER_GONE_EXIT = 3
"""The exit code of a worker whose controller died: no one is left to read its results."""


def main(argv: list[str] | None = None) -> int:
    """Run one task, or serve tasks (see :class:`pbt.launch.persistent.PersistentLauncher`); the exit
    code: 0 done, 2 a reported fault or user error, 1 a bug, 3 the controller died."""
    argv = sys.argv[1:] if argv is None else argv
    quiet_library_loggers()
    faults.keep_reserve()  # freed before a fault report, which may come at the memory limit
    watch_controller(_controller_gone)
    if argv[:1] == ["--serve"] and len(argv) in (2, 4):
        idle = float(argv[3]) if len(argv) == 4 and argv[2] == "--idle-timeout" else 900.0
        return serve(Path(argv[1]), idle)
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    return _one_task(Path(argv[0]))


def _one_task(task_path: Path) -> int:
    """Run the task at ``task_path``; rank 0 writes its result beside it."""
    task = read_task(task_path)
    if task is None:
        return 2
    from pbt.distributed import shutdown

    rank = int(os.environ.get("RANK", 0))
    beat = Heartbeat(task_path.parent / "heartbeat") if rank == 0 else contextlib.nullcontext()
    with beat as heartbeat:
        try:
            result, _ = run_task(task, heartbeat=heartbeat)
        except BaseException as err:
            if not failed(task_path.parent, err):
                raise
            return 2
        finally:
            shutdown()
        if rank == 0:
            result.write(task_path.parent / RESULT_FILE)
    return 0


def _controller_gone(pid: int) -> None:
    """End this process at once: its controller (``pid``) has died, and a resumed one runs its
    task again; a checkpoint write cut off here leaves only a temporary folder behind."""
    print(f"error: the controller (pid {pid}) has ended; this worker stops", file=sys.__stderr__)
    os._exit(CONTROLLER_GONE_EXIT)


if __name__ == "__main__":
    sys.exit(main())
