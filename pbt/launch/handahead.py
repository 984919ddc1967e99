"""The hand-ahead: the next generation's first tasks started while this one's last checkpoints
are still being written.

A long-lived worker releases a task once its state is in host memory and writes the checkpoint
in the background (:mod:`pbt.worker.serve`). When every task of a call has ended ok or been
released, the launcher asks its caller for a guess of the next call's tasks (the campaign runs
selection on the released results, recording nothing) and hands them to idle workers at once,
as many a slot as its worker runs at once (``launch.members_per_batch``: a worker batching 8
members handed one would run it alone); a task whose parent is still being written (its
``parent_digest`` null) goes only
to the worker writing that parent, which holds its state. The next call *adopts* each task
handed ahead whose :class:`~pbt.launch.attempt.TaskSpec` and ``task.json`` it is given
unchanged (for a task handed with a null digest: unchanged but for the digest its parent's
write gave), and *discards* the rest: their workers are ended and the tasks run afresh. A guess
that does not hold costs the work started on it, never a decision.

:class:`HandAhead` keeps what was handed and decides what is adopted; the launcher consults it
and does the starting and ending of processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pbt.launch.attempt import Outcome, Running, TaskSpec
from pbt.protocol.files import RELEASED
from pbt.protocol.messages import RESULT_FILE, TASK_FILE, ResultMessage, TaskMessage

Guess = Callable[[dict[str, ResultMessage]], list[TaskSpec]]
"""Given every task's result (the released ones' without a digest), the next call's first
tasks, their ``task.json`` written."""


@dataclass
class Handed:
    """A task of the next call started ahead on a worker."""

    item: Running
    message: TaskMessage
    """Its ``task.json`` as handed, which the next call must match to adopt it."""
    parent_written_by: Path | None
    """When its parent was still being written: the folder of the task writing it, on the same
    worker, whose ``result.json`` gives the digest the next call's ``task.json`` must name."""


class HandAhead:
    """The tasks handed ahead to a launcher's workers, kept from one :meth:`run
    <pbt.launch.local.LocalLauncher.run>` to the next."""

    def __init__(self) -> None:
        self._handed: dict[str, Handed] = {}
        self.kept: list[str] = []
        """The tasks of the last call that the one before had handed ahead (adopted)."""

    def handed(self) -> set[str]:
        """The ids of the tasks handed ahead and not yet adopted or discarded."""
        return set(self._handed)

    def running(self) -> list[Running]:
        """The attempts handed ahead (their processes are the launcher's to end)."""
        return [h.item for h in self._handed.values()]

    def clear(self) -> None:
        """Forget what was handed (its processes ended by the caller)."""
        self._handed.clear()

    @staticmethod
    def results(
        running: list[Running], outcomes: dict[int, Outcome]
    ) -> dict[str, ResultMessage] | None:
        """Every task's result once each has ended ok or been released and some are still
        writing (the released ones' from ``released``); None before, or while one cannot be
        read."""
        if not running or not all(item.released for item in running):
            return None
        if not all(o.status == "ok" and o.result is not None for o in outcomes.values()):
            return None
        results = {o.task_id: o.result for o in outcomes.values() if o.result is not None}
        for item in running:
            result = ResultMessage.peek(Path(item.task.task_dir) / RELEASED)
            if result is None:
                return None
            results[item.task.task_id] = result
        return results

    def hand(
        self,
        tasks: list[TaskSpec],
        idle: list[int],
        running: list[Running],
        results: dict[str, ResultMessage],
        start: Callable[[TaskSpec, int], Running | None],
        per_slot: int = 1,
    ) -> None:
        """Start ``tasks`` (the next call's) on the ``idle`` slots, ``per_slot`` a slot (what
        its worker runs at once), in order, with ``start(task, slot)`` (None: that slot's
        worker cannot take it). A task whose parent checkpoint is still being written goes
        only to the slot of the worker writing it."""
        room = dict.fromkeys(idle, per_slot)
        writing = {results[r.task.task_id].checkpoint: r for r in running if not r.ended}
        for task in tasks:
            message = TaskMessage.peek(Path(task.task_dir) / TASK_FILE)
            if message is None:
                continue
            writer, candidates = None, list(room)
            if message.parent_checkpoint and message.parent_digest is None:
                writer = writing.get(message.parent_checkpoint)
                if writer is None or task.nproc != 1:
                    continue
                candidates = [writer.slot]
            for slot in [s for s in candidates if room.get(s, 0) > 0]:
                item = start(task, slot)
                if item is not None:
                    room[slot] -= 1
                    written_by = None if writer is None else Path(writer.task.task_dir)
                    self._handed[task.task_id] = Handed(item, message, written_by)
                    break

    def adopt(self, tasks: list[TaskSpec], discard: Callable[[Running], None]) -> list[Running]:
        """The tasks of this call handed ahead unchanged, on a worker still alive (their index
        set); every other task handed ahead is ``discard``-ed. (A worker whose background write
        failed ended with it, and a retry may have written the same checkpoint since.)"""
        handed, self._handed = self._handed, {}
        kept = []
        for index, task in enumerate(tasks):
            found = handed.get(task.task_id)
            if (
                found is not None
                and found.item.task == task
                and found.item.proc.poll() is None
                and _unchanged(found)
            ):
                del handed[task.task_id]
                found.item.index = index
                kept.append(found.item)
        for found in handed.values():
            discard(found.item)
        self.kept = [item.task.task_id for item in kept]
        return kept


def _unchanged(handed: Handed) -> bool:
    """Whether a handed task's ``task.json`` is still the one it was handed: the same, or, when
    it was handed while its parent was being written, the same but for the digest that write
    gave (the state the worker loaded is the one it wrote)."""
    now = TaskMessage.peek(Path(handed.item.task.task_dir) / TASK_FILE)
    if now is None:
        return False
    if now == handed.message:
        return True
    if handed.parent_written_by is None:
        return False
    written = ResultMessage.peek(handed.parent_written_by / RESULT_FILE)
    return (
        written is not None
        and written.digest is not None
        and written.checkpoint == now.parent_checkpoint
        and now.parent_digest == written.digest
        and dataclasses.replace(now, parent_digest=None) == handed.message
    )
