"""Where a member's dedicated rollout engine runs, and how ``pbt status`` sees it.

The launcher decides the placement (:mod:`pbt.launch.placement`) and names it in the member's
environment (:data:`~pbt.protocol.engines.PLACEMENT_ENV`); :func:`engine_placement` reads it
back and :func:`engine_device` turns it into the engine's device. While the member trains,
:class:`EngineReporter` rewrites the engine's status file (:mod:`pbt.protocol.engines`).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from pbt.config import Manifest
from pbt.config.sections.rollout import engine_count
from pbt.protocol.engines import EnginePlacement, EngineStatus, write_status


def engine_placement(manifest: Manifest, device: torch.device) -> EnginePlacement:
    """Where this process's engine runs and how many engines a member has: the launcher's word
    (:data:`~pbt.protocol.engines.PLACEMENT_ENV`, ``auto`` resolved there); for a process
    started otherwise (library mode, a test) beside its trainer, ``auto`` meaning one engine
    per rank with async rollouts and none with sync."""
    engines = manifest.launch.rollout_gpus_per_member
    if engines == 0:
        return EnginePlacement("colocated", 0)
    given = EnginePlacement.from_env()
    if given is not None:
        return given
    engines = engine_count(engines, manifest.launch.ranks, manifest.rollout.mode)
    if engines == 0:
        return EnginePlacement("colocated", 0)
    return EnginePlacement("cpu" if device.type == "cpu" else "shared", engines)


def engine_device(placement: EnginePlacement, trainer: torch.device) -> str:
    """The engine's device: on ``dedicated`` GPUs, the one of this local rank after the node's
    trainer GPUs (the launcher lists them in that order); else its trainer's own."""
    if placement.kind != "dedicated" or trainer.type != "cuda":
        return str(trainer)
    local = int(os.environ.get("LOCAL_RANK", 0))
    return f"cuda:{int(os.environ.get('LOCAL_WORLD_SIZE', 1)) + local}"


def device_label(device: str) -> str:
    """``device`` with the GPU ``CUDA_VISIBLE_DEVICES`` maps it to: ``cuda:1 (GPU 5)``."""
    kind, _, index = device.partition(":")
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if kind != "cuda" or not index.isdigit() or int(index) >= len(visible):
        return device
    return f"{device} (GPU {visible[int(index)]})"


class EngineReporter:
    """Rewrites the engine's status file (:mod:`pbt.protocol.engines`) about once a second
    from a daemon thread while the member trains, and once more at the end; ``pbt status``
    reads it. Nothing without a folder. A failed write never fails the member.

    Args:
        session: the member's :class:`~pbt.algorithms.rollout.dedicated.DedicatedRollouts`.
        member_id, rank: whose engine it is.
        placement: one of :data:`~pbt.protocol.engines.PLACEMENTS`.
        folder: the task's folder (``<campaign>/tasks/<member>``), or None.
    """

    def __init__(
        self, session: Any, member_id: str, rank: int, placement: str,
        folder: Path | None, interval_s: float = 1.0,
    ) -> None:  # fmt: skip
        self.session, self.member_id, self.rank = session, member_id, rank
        self.placement, self.folder, self.interval_s = placement, folder, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Report now, then every ``interval_s`` until :meth:`stop`."""
        if self.folder is None:
            return
        self.write("serving")
        self._thread = threading.Thread(target=self._loop, daemon=True, name="pbt-engine-status")
        self._thread.start()

    def stop(self, state: str) -> None:
        """Stop reporting, after a last report in ``state`` (``drained``, ``failed``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.folder is not None:
            self.write(state)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write("serving")

    def write(self, state: str) -> None:
        """One report of the engine in ``state``."""
        engine, session = self.session.engine, self.session
        try:
            alive = engine.process is not None
            status = EngineStatus(
                self.member_id, self.rank, engine.pid if alive else None, os.getpid(),
                device_label(engine.device), self.placement, state, max(0, session.served),
                float(engine.beat.value) if alive else None, engine.restarts,
                session.stale_dropped, time.time(),
            )  # fmt: skip
        except (AttributeError, ValueError):  # the engine restarting under this thread
            return
        write_status(self.folder, status)
