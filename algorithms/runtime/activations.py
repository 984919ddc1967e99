"""Activation memory of the training forward: checkpointing per transformer block, and
offloading the tensors saved for backward to host memory (``training.activation_checkpointing``
and ``training.activation_offloading``).

Both act only while gradients are recorded. A forward under ``torch.no_grad()`` (rollouts,
evaluation, the reference and old-policy passes) runs every block as it is and saves nothing,
so decoding never recomputes or copies anything, whichever engine runs it.

**Checkpointing** replaces each block's ``forward`` by a non-reentrant ``torch.utils.checkpoint``
of it. It is an instance attribute, so parameter names, the state dict and checkpoints are
unchanged. FSDP2's hooks sit on the module's ``__call__``, outside the checkpointed function:
a sharded block is gathered for the forward and, by FSDP's pre-backward hook, for the recompute
and its backward (the arrangement torchtitan uses). The block gets no KV cache in a training
forward: the recompute would append to it twice. Transformers' ``gradient_checkpointing_enable``
is not used: it checkpoints whenever the model is in training mode, gradients or not, and then
drops the KV cache, which a decode in training mode needs.

**Offloading** pushes ``torch.autograd.graph.saved_tensors_hooks`` around every forward of the
model that records gradients. A saved tensor that covers its whole storage and is at least
:data:`MIN_OFFLOAD_BYTES` is copied to host memory, and the device memory is freed as soon as
the forward drops its own reference. Parameters (and views of them) stay where they are: they
live on anyway. On CUDA the host memory is pinned and the copies run on a side stream, so the
forward does not wait for them; in backward each tensor is copied back when autograd asks for
it, and the next ones (in reverse order of saving, the order backward needs them) are
prefetched on the side stream up to :data:`PREFETCH_BYTES`. A storage saved several times in
one forward (the input of every adapted projection, its 2-D view for the matmul) is copied
once. On the CPU the same mechanism copies host memory to host memory: pointless for training,
so :class:`~pbt.algorithms.runtime.member.Host` does not install it there, but it is how the tests
check the mechanism on any machine.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from pbt.distributed.fsdp import transformer_blocks

MIN_OFFLOAD_BYTES = 2**16
"""Smaller saved tensors stay on the device: a copy costs more than the memory it frees."""
PREFETCH_BYTES = 2**28
"""Offloaded bytes brought back ahead of the backward pass's need, at most."""


def checkpoint_blocks(model: nn.Module) -> int:
    """Checkpoint every transformer block of ``model`` (see :func:`~pbt.distributed.fsdp.
    transformer_blocks`) in place, before any sharding; returns how many blocks.

    A block recomputes its forward in the backward pass only when the forward recorded
    gradients; otherwise it runs as before.
    """
    blocks = transformer_blocks(model)
    for block in blocks:
        if not getattr(block, "pbt_checkpointed", False):
            block.forward = _checkpointed(block.forward)
            block.pbt_checkpointed = True
    return len(blocks)


CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")
"""A block's KV-cache argument (transformers' names for it: ``cache`` from 5.25, before that
``past_key_values`` and, earlier still, ``past_key_value``)."""


def _checkpointed(forward):
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # A training forward has no use for the KV cache, and the recompute would append the
        # block's keys and values to it a second time.
        for name in CACHE_ARGUMENTS:
            if name in kwargs:
                kwargs[name] = None
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


@dataclass(eq=False)
class _Saved:
    """One offloaded storage: its bytes in host memory and, while prefetched or in use, on
    the device again."""

    host: Tensor
    """``[nbytes]`` uint8, pinned on CUDA."""
    version: int
    """The storage's version counter when it was saved: an in-place change makes a new copy."""
    copied: torch.cuda.Event | None = None
    """Recorded on the side stream after the copy to the host (CUDA)."""
    prefetched: Tensor | None = None
    """The device bytes of a prefetch not yet consumed."""
    ready: torch.cuda.Event | None = None
    """Recorded on the side stream after the prefetch copy (CUDA)."""
    restored: Any = None
    """A weak reference to the tensor last handed to autograd: its storage is reused while it
    lives (several saved views of one storage in one backward node)."""
    neighbours: list[weakref.ref] = field(default_factory=list)
    """Every storage offloaded by the same forward, in saving order (shared list)."""
    index: int = 0
    """This one's place in ``neighbours``."""


class ActivationOffload:
    """The hooks that move a model's saved activations to host memory while it trains.

    Args:
        device: the device whose saved tensors move (CUDA in training; the CPU in tests).
        min_bytes: smaller tensors stay where they are.
        prefetch_bytes: how many offloaded bytes backward brings back ahead of need.
    """

    def __init__(
        self,
        device: torch.device,
        min_bytes: int = MIN_OFFLOAD_BYTES,
        prefetch_bytes: int = PREFETCH_BYTES,
    ) -> None:
        self.device = torch.device(device)
        self.min_bytes, self.prefetch_bytes = min_bytes, prefetch_bytes
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.offloaded_bytes = 0
        """Bytes copied to host memory by the last forward (each storage once)."""
        self._order: list[weakref.ref] = []
        self._storages: dict[int, tuple[StorageWeakRef, _Saved]] = {}
        self._open: list[torch.autograd.graph.saved_tensors_hooks | None] = []

    # -- around a forward ------------------------------------------------------------------

    def install(self, model: nn.Module) -> None:
        """Offload during every forward of ``model`` that records gradients."""
        model.register_forward_pre_hook(lambda module, args: self._begin())
        model.register_forward_hook(lambda module, args, out: self._end(), always_call=True)

    def _begin(self) -> None:
        if not torch.is_grad_enabled():
            self._open.append(None)
            return
        self._order, self._storages, self.offloaded_bytes = [], {}, 0
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._open.append(hooks)

    def _end(self) -> None:
        hooks = self._open.pop() if self._open else None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        self._storages = {}  # the items live on in the autograd graph, not here

    def __enter__(self) -> ActivationOffload:
        self._begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end()

    # -- saving ----------------------------------------------------------------------------

    def _pack(self, tensor: Tensor) -> Any:
        if not self._offloadable(tensor):
            return tensor
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)
        known = self._storages.get(ref.cdata)
        if known is not None and not known[0].expired() and known[1].version == tensor._version:
            item = known[1]
        else:
            item = self._offload(storage, tensor._version)
            self._storages[ref.cdata] = (ref, item)
        return item, tensor.dtype, tuple(tensor.shape), tensor.stride()

    def _offloadable(self, tensor: Tensor) -> bool:
        """A plain tensor on the device, covering all of its storage (so copying it frees
        memory), big enough to be worth a copy, and not a parameter or a view of one."""
        if type(tensor) is not torch.Tensor or tensor.device.type != self.device.type:
            return False
        base = tensor._base
        if base is not None and type(base) is not torch.Tensor:
            return False
        if tensor.layout != torch.strided or tensor.storage_offset() != 0:
            return False
        nbytes = tensor.untyped_storage().nbytes()
        return nbytes >= self.min_bytes and tensor.numel() * tensor.element_size() == nbytes

    def _offload(self, storage: torch.UntypedStorage, version: int) -> _Saved:
        source = _bytes(storage)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host = torch.empty(source.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(source, non_blocking=True)
                copied = self.stream.record_event()
            # the device memory is not reused before the copy has read it
            source.record_stream(self.stream)
        else:
            host, copied = source.clone(), None
        item = _Saved(host, version, copied, neighbours=self._order, index=len(self._order))
        self._order.append(weakref.ref(item))
        self.offloaded_bytes += host.numel()
        return item

    # -- restoring -------------------------------------------------------------------------

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        item, dtype, shape, stride = packed
        storage = self._restore(item)
        self._prefetch_before(item)
        out = torch.empty(0, dtype=dtype, device=self.device).set_(storage, 0, shape, stride)
        item.restored = weakref.ref(out)
        return out

    def _restore(self, item: _Saved) -> torch.UntypedStorage:
        """The item's bytes on the device: those of a view still in use, the prefetched copy,
        or a new copy."""
        alive = item.restored() if item.restored is not None else None
        if alive is not None:
            return alive.untyped_storage()
        if item.prefetched is not None:
            raw, item.prefetched = item.prefetched, None
            if self.cuda:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(item.ready)
                raw.record_stream(current)
        else:
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(item.copied)
            raw = torch.empty(item.host.shape, dtype=torch.uint8, device=self.device)
            raw.copy_(item.host, non_blocking=self.cuda)
        return raw.untyped_storage()

    def _prefetch_before(self, item: _Saved) -> None:
        """Copy back, on the side stream, the storages saved just before ``item`` (backward
        needs them next), while fewer than ``prefetch_bytes`` wait prefetched."""
        if not self.cuda:
            return
        waiting = [
            s for r in item.neighbours if (s := r()) is not None and s.prefetched is not None
        ]
        budget = self.prefetch_bytes - sum(s.prefetched.numel() for s in waiting)
        for index in range(item.index - 1, -1, -1):
            earlier = item.neighbours[index]()
            if earlier is None or earlier.prefetched is not None or earlier.restored is not None:
                continue
            if budget < earlier.host.numel():
                return
            budget -= earlier.host.numel()
            current = torch.cuda.current_stream(self.device)
            raw = torch.empty(earlier.host.shape, dtype=torch.uint8, device=self.device)
            self.stream.wait_stream(current)  # the allocation is ordered before the copy
            with torch.cuda.stream(self.stream):
                raw.copy_(earlier.host, non_blocking=True)
                earlier.ready = self.stream.record_event()
            raw.record_stream(self.stream)
            earlier.prefetched = raw


def _bytes(storage: torch.UntypedStorage) -> Tensor:
    """``[nbytes]`` uint8 over ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def offload_activations(model: nn.Module, device: torch.device) -> ActivationOffload | None:
    """Install :class:`ActivationOffload` on ``model`` when it trains on CUDA; on the CPU,
    where the activations already are in host memory, install nothing and return None."""
    if torch.device(device).type != "cuda":
        return None
    offload = ActivationOffload(device)
    offload.install(model)
    return offload
