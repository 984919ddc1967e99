"""A long-lived worker's state caches: members' states it snapshotted, kept in host memory (and
the most recent also on the GPU) so that a child trained on the same worker loads its parent
without reading the disk, and the prefetch that copies the next task's parent to the device
while the current task trains.

Sizes come from each task's manifest (``launch.state_cache_gib``,
``launch.device_state_cache_gib``), set by :func:`apply_sizes`, the one place that reads them.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from pathlib import Path
from typing import Any

from pbt.config import LaunchConfig
from pbt.protocol.files import read_json
from pbt.protocol.messages import TaskMessage


def apply_sizes(launch: LaunchConfig) -> None:
    """Set :data:`STATES`' limits from a task's manifest: ``launch.state_cache_gib`` of host
    memory and, of that, ``launch.device_state_cache_gib`` of GPU memory (the campaign applied
    ``PBT_STATE_CACHE_GIB`` / ``PBT_DEVICE_STATE_CACHE_GIB`` to the manifest, if set)."""
    STATES.max_bytes = int(launch.state_cache_gib * 2**30)
    STATES.max_device_bytes = int(launch.device_state_cache_gib * 2**30)


class StateCache:
    """Members' states this worker snapshotted, in host memory by checkpoint path and digest,
    the oldest dropped past ``max_bytes``: a child of a member trained here loads its parent
    from memory, not from disk (whose copy is still written, for resume and other workers).

    On a GPU the most recent states are also kept on the device, up to ``max_device_bytes``
    (the packed buffers their host copies came from; older ones lose their device copy first):
    such a parent comes to a child in one device copy a buffer, not a copy from the host."""

    def __init__(self, max_bytes: int, max_device_bytes: int = 0) -> None:
        self.max_bytes, self.max_device_bytes = max_bytes, max_device_bytes
        self._held: collections.OrderedDict[str, _Held] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(
        self,
        path: str,
        digest: str,
        attributes: dict[str, Any],
        nbytes: int,
        on_device: dict[str, Any] | None = None,
    ) -> None:
        """Hold checkpoint ``path``'s state (``nbytes`` of tensors) as written with ``digest``;
        ``on_device``: the same state on the GPU, kept while the device budget allows."""
        from pbt.distributed.state import device_nbytes

        device_bytes = device_nbytes(on_device) if on_device is not None else 0
        if on_device is None or device_bytes > self.max_device_bytes:
            on_device, device_bytes = None, 0
        with self._lock:
            self._held.pop(path, None)
            if nbytes > self.max_bytes:
                return
            self._held[path] = _Held(
                digest,
                {**attributes, "digest": digest},
                nbytes,
                None if on_device is None else {**on_device, "digest": digest},
                device_bytes,
            )
            while sum(h.nbytes for h in self._held.values()) > self.max_bytes:
                self._held.popitem(last=False)
            over = sum(h.device_bytes for h in self._held.values()) - self.max_device_bytes
            for held in self._held.values():  # the least recently used first
                if over <= 0:
                    break
                if held.on_device is not None:
                    over -= held.device_bytes
                    held.on_device, held.device_bytes = None, 0

    def get(self, path: str, digest: str | None) -> dict[str, Any] | None:
        """The attributes of checkpoint ``path`` when held with exactly ``digest``: the copy
        on the device when there is one."""
        with self._lock:
            found = self._held.get(path)
            if digest is None or found is None or found.digest != digest:
                return None
            self._held.move_to_end(path)
            return found.attributes if found.on_device is None else found.on_device


@dataclasses.dataclass
class _Held:
    digest: str
    attributes: dict[str, Any]
    nbytes: int
    on_device: dict[str, Any] | None
    device_bytes: int


STATES = StateCache(
    int(LaunchConfig().state_cache_gib * 2**30), int(LaunchConfig().device_state_cache_gib * 2**30)
)
"""The worker process's cache (its limits: :func:`apply_sizes`)."""


class ParentAhead:
    """A long-lived worker's prefetch: while it trains one task, the parent state of the task
    handed ahead to it (inbox entry :attr:`number`), when this worker holds that state in
    memory (:data:`STATES`), is copied to the device in the background
    (:class:`~pbt.distributed.state.DeviceCopies`; a state held on the device as well, in a
    device copy a buffer), so that the next task loads its parent without a copy. Looked for
    after each training step until found (the entry may be handed over, or the parent's write
    finish, while the task trains)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.number = 0
        self._key: tuple[str, str | None] | None = None
        self._copies = None
        self._looked: int | None = None  # the entry found to have no parent held here
        self.held_on_device = False

    def look(self, device: Any) -> None:
        """Start the copy of the next task's parent, once it is handed and held here."""
        if self._copies is not None or self._looked == self.number:
            return
        entry = read_json(self.folder / "inbox" / f"{self.number:06d}.json")
        task = TaskMessage.peek(Path(entry["task"])) if entry is not None else None
        if task is None:
            return
        if not task.parent_checkpoint:
            self._looked = self.number
            return
        key = (task.parent_checkpoint, task.parent_digest)
        held = STATES.get(*key)
        if held is None:  # not held here, or its write is still in flight
            return
        from pbt.distributed.state import DeviceCopies

        self._key, self._copies = key, DeviceCopies(held, device)

    def take(self, path: str, digest: str | None) -> dict[str, Any] | None:
        """The prefetched state of checkpoint ``path`` with ``digest``, or None
        (:attr:`held_on_device` says whether it was copied from a state held on the device)."""
        copies, key = self._copies, self._key
        self._copies = self._key = None
        self.held_on_device = False
        if copies is None or key != (path, digest):
            return None
        tree = copies.wait()
        self.held_on_device = copies.held_on_device
        return tree
