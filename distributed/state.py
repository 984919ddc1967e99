"""Gathered state: full tensors out of any world size, and back into any other.

Sharded parameters (FSDP2 DTensors) are gathered with ``full_tensor()`` (a collective: every
rank calls these functions) and scattered back by each rank keeping its own shard of the full
tensor, with no communication. Plain tensors (data parallel, or one rank) pass through. The
result is keyed by parameter name, so it does not depend on how many ranks saved it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor, as a fresh copy on the CPU (gathered when sharded)."""
    (host,) = full_tensors([t])
    return host


@torch.no_grad()  # instead of a detach per tensor
def full_tensors(tensors: list[Tensor]) -> list[Tensor]:
    """Each whole tensor as a fresh copy on the CPU (gathered when sharded), in order.

    Tensors on a device travel in one copy per dtype, not one each: a copy to the host costs
    a fixed latency (about 1-2 ms on the GPU hosts measured, where an adapter and its Adam
    moments are a thousand tensors), so they are packed into one buffer on the device first.
    Packing and unpacking run in C++ (per-tensor Python costs microseconds a tensor, a
    thousand times over); CPU tensors are cloned one by one, which costs no kernel launch.
    """
    full = [t.full_tensor() if isinstance(t, DTensor) else t for t in tensors]
    out: list[Tensor | None] = [t.clone() if t.device.type == "cpu" else None for t in full]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(full):
        if out[i] is None:
            groups.setdefault((t.device, t.dtype), []).append(i)
    pending = _PENDING.get()
    for (device, _), indices in groups.items():
        members = [full[i] for i in indices]
        flat = _flatten(members)
        if pending is not None and device.type == "cuda":
            pieces = _unflatten(pending.copy(flat), members)  # filled in the background
        else:  # each its own storage, as a saved file needs
            pieces = [piece.clone() for piece in _unflatten(flat.to("cpu"), members)]
        for i, piece in zip(indices, pieces, strict=True):
            out[i] = piece
    return out  # type: ignore[return-value]


def _flatten(tensors: list[Tensor]) -> Tensor:
    """The tensors' values end to end in one new 1-D buffer (always a copy: a lone tensor's
    flat view would let training change it before a background copy reads it)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1).clone()
    return torch._utils._flatten_dense_tensors(tensors)


def _unflatten(flat: Tensor, like_these: list[Tensor]) -> list[Tensor]:
    """Views of ``flat`` shaped like each of ``like_these``, in order (contiguous)."""
    return list(torch._utils._unflatten_dense_tensors(flat, like_these))


def moved(tensors: list[Tensor], devices: list[torch.device]) -> list[Tensor]:
    """Each tensor on its device, values and dtype kept. Those not there yet travel in one
    copy per device and dtype, arriving as views of one buffer there: a copy per tensor
    costs a kernel launch each, and from pageable host memory a synchronisation each. Those
    there already pass through."""
    out = list(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (t, device) in enumerate(zip(tensors, devices, strict=True)):
        if t.device != device:
            groups.setdefault((device, t.dtype), []).append(i)
    for (device, _), indices in groups.items():
        members = [tensors[i] for i in indices]
        for i, piece in zip(
            indices, _unflatten(_flatten(members).to(device), members), strict=True
        ):
            out[i] = piece
    return out


class HostCopies:
    """Device-to-host copies in flight on a side stream, into pinned buffers: the caller goes
    on (the next member trains on the default stream) while the bytes travel; :meth:`settle`
    waits for them. The packed device buffers are copies already, so training may change the
    parameters they came from at once."""

    def __init__(self) -> None:
        self._copies: list[tuple[torch.cuda.Event, Tensor, Tensor]] = []

    def copy(self, flat: Tensor) -> Tensor:
        """A pinned host tensor that will hold ``flat``'s values once settled."""
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        stream = _side_stream(flat.device)
        stream.wait_stream(torch.cuda.current_stream(flat.device))
        with torch.cuda.stream(stream):
            host.copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._copies.append((done, flat, host))  # ``flat`` lives until its copy is done
        return host

    def wait(self) -> None:
        """Wait for the copies to arrive (the host tensors may then be read, not changed)."""
        for done, _, _ in list(self._copies):
            done.synchronize()

    def device_views(self, tree: Any) -> Any:
        """``tree`` with each view of a pinned buffer replaced by the same view of the packed
        device buffer it is copied from (another copy of the state, on the device: a child
        loads it in one copy a buffer, without the host). Call before :meth:`settle`."""
        flats = {host.untyped_storage().data_ptr(): flat for _, flat, host in self._copies}

        def twin(t: Tensor) -> Tensor:
            flat = flats.get(t.untyped_storage().data_ptr())
            return t if flat is None else flat.as_strided(t.size(), t.stride(), t.storage_offset())

        return torch.utils._pytree.tree_map_only(Tensor, twin, tree)

    def settle(self, tree: Any) -> Any:
        """Wait for the copies to arrive; ``tree`` with each view of a pinned buffer replaced
        by a pageable copy with its own storage (as a saved file needs); the pinned buffers go
        back to torch's pinned-memory cache, for the next snapshot."""
        if not self._copies:
            return tree
        for done, _, _ in self._copies:
            done.synchronize()
        pinned = {host.untyped_storage().data_ptr() for _, _, host in self._copies}
        self._copies.clear()

        def own(t: Tensor) -> Tensor:
            if t.untyped_storage().data_ptr() not in pinned:
                return t
            return torch.empty(t.shape, dtype=t.dtype).copy_(t)  # a clone would stay pinned

        return torch.utils._pytree.tree_map_only(Tensor, own, tree)


def device_nbytes(tree: Any) -> int:
    """Bytes of the device storages ``tree``'s tensors view (each storage once)."""
    storages = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for t in torch.utils._pytree.tree_leaves(tree)
        if isinstance(t, Tensor) and t.device.type != "cpu"
    }
    return sum(storages.values())


def fresh_device_copies(tree: Any, made: list[Tensor] | None = None) -> Any:
    """``tree`` with its device tensors copied, one copy per storage they view (a state held
    on the device as views of packed buffers comes back in a copy a buffer, each view keeping
    its place); host tensors pass through. The copies may be taken over by an optimizer, and
    the source is only read. ``made``, if given, receives each storage's copy."""
    leaves = torch.utils._pytree.tree_leaves(tree)
    storages: dict[int, Tensor] = {}
    for t in leaves:
        if isinstance(t, Tensor) and t.device.type != "cpu":
            storage = t.untyped_storage()
            if storage._cdata not in storages:  # one key a storage, however many views
                whole = torch.empty(0, dtype=torch.uint8, device=t.device)
                storages[storage._cdata] = whole.set_(storage, 0, (storage.nbytes(),), (1,)).clone()
    if made is not None:
        made.extend(storages.values())

    def copied(t: Tensor) -> Tensor:
        if t.device.type == "cpu":
            return t
        whole = storages[t.untyped_storage()._cdata]
        out = torch.empty(0, dtype=t.dtype, device=t.device)
        return out.set_(whole.untyped_storage(), t.storage_offset(), t.size(), t.stride())

    return torch.utils._pytree.tree_map_only(Tensor, copied, tree)


class DeviceCopies:
    """A state's tensors copied to ``device`` by a background thread while the device works on
    something else: on CUDA on a side stream (floating tensors of one dimension or more: an
    adapter's weights and the optimizer's moments; the RNG states and step counts stay on the
    host, where they are restored from; a state held on the device already comes in a device
    copy a buffer, :func:`fresh_device_copies`); on the CPU as clones of every tensor.
    :meth:`wait` returns the copied tree, ready for the current stream. The source is only
    read, and kept alive until then."""

    def __init__(self, tree: Any, device: torch.device) -> None:
        self.device = torch.device(device)
        self.held_on_device = False
        """Whether the source was (partly) on the device: a state held there."""
        self._source: Any = tree
        self._tree: Any = tree
        self._made: list[Tensor] = []
        self._error: BaseException | None = None
        self._done: torch.cuda.Event | None = None
        self._thread = threading.Thread(target=self._copy, name="pbt-prefetch", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        try:
            if self.device.type != "cuda":
                self._tree = torch.utils._pytree.tree_map_only(Tensor, torch.clone, self._tree)
                return
            stream = _side_stream(self.device, "prefetch")
            with torch.cuda.stream(stream):
                tree = fresh_device_copies(self._tree, self._made)
                self.held_on_device = bool(self._made)
                self._tree = torch.utils._pytree.tree_map_only(Tensor, self._move, tree)
                self._done = torch.cuda.Event()
                self._done.record(stream)
        except BaseException as err:  # raised again by wait(), in the caller's thread
            self._error = err

    def _move(self, t: Tensor) -> Tensor:
        if t.device.type != "cpu" or t.dim() == 0 or not t.is_floating_point():
            return t
        moved = t.to(self.device, non_blocking=True)
        self._made.append(moved)
        return moved

    def wait(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self._done)
            for t in self._made:  # not reused by the side stream while in use here
                t.record_stream(current)
            self._done = None
        self._source = None
        return self._tree


_PENDING: contextvars.ContextVar[HostCopies | None] = contextvars.ContextVar(
    "pbt_host_copies", default=None
)
_STREAMS: dict[tuple[torch.device, str], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, use: str = "snapshot") -> torch.cuda.Stream:
    if (device, use) not in _STREAMS:
        _STREAMS[device, use] = torch.cuda.Stream(device)
    return _STREAMS[device, use]


@contextlib.contextmanager
def copies_in_background() -> Iterator[HostCopies]:
    """Within it, :func:`full_tensors` returns a GPU tensor's host copy before its bytes have
    arrived (a pinned buffer filled on a side stream); nothing may read those host tensors
    before the yielded :class:`HostCopies` settles them. No effect on CPU tensors."""
    copies = HostCopies()
    token = _PENDING.set(copies)
    try:
        yield copies
    finally:
        _PENDING.reset(token)


def like(reference: Tensor, full: Tensor) -> Tensor:
    """``full`` laid out like ``reference``: this rank's shard of it when ``reference`` is sharded."""
    if isinstance(reference, DTensor):
        local = full.to(device=reference.to_local().device, dtype=reference.dtype)
        return distribute_tensor(
            local, reference.device_mesh, reference.placements, src_data_rank=None
        )
    return full.to(device=reference.device, dtype=reference.dtype)


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every trainable parameter, in a fixed order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def gather_parameters(named: list[tuple[str, nn.Parameter]]) -> dict[str, Tensor]:
    """Full CPU copies of the given parameters, by name."""
    return dict(zip([n for n, _ in named], full_tensors([p for _, p in named]), strict=True))


@torch.no_grad()
def load_parameters(named: list[tuple[str, nn.Parameter]], full: dict[str, Tensor]) -> None:
    """Copy full tensors into the given parameters (each rank keeps its shard).

    One batched copy into the local tensors (a copy per parameter costs a kernel launch each
    on a GPU), from saved tensors brought to the device by :func:`moved`.

    Raises:
        KeyError: a parameter has no saved value, or a saved value has the wrong shape.
    """
    targets, sources = [], []
    for name, p in named:
        if name not in full:
            raise KeyError(f"no saved value for {name}")
        saved = full[name]
        if tuple(saved.shape) != tuple(p.shape):
            raise KeyError(f"{name}: saved shape {tuple(saved.shape)} != {tuple(p.shape)}")
        if isinstance(p, DTensor):
            targets.append(p.to_local())
            sources.append(like(p, saved).to_local())
        else:
            targets.append(p)
            sources.append(saved)
    if targets:
        torch._foreach_copy_(targets, moved(sources, [t.device for t in targets]))


def gather_optimizer(
    named: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The optimizer's per-parameter state (full tensors, by name) and its group settings."""
    state = {name: dict(optimizer.state.get(p, {})) for name, p in named}
    where = [
        (name, k) for name, entry in state.items() for k, v in entry.items() if torch.is_tensor(v)
    ]
    for (name, k), host in zip(where, full_tensors([state[n][k] for n, k in where]), strict=True):
        state[name][k] = host
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    for g in groups:
        g["betas"] = list(g["betas"]) if "betas" in g else None
    return {"state": state, "param_groups": groups}


def load_optimizer(
    named: list[tuple[str, nn.Parameter]], optimizer: torch.optim.Optimizer, saved: dict[str, Any]
) -> None:
    """Restore what :func:`gather_optimizer` returned into an optimizer over ``named``.

    Tensors already laid out like their parameter are taken over, not copied (a prefetch's
    copies on the device); the step counts are always copied, since the optimizer counts in
    place and ``saved`` may be a state held in memory and loaded again."""
    for name, p in named:
        entry = saved["state"].get(name)
        if not entry:
            continue
        optimizer.state[p] = {
            k: (v.to("cpu", copy=True) if k == "step" else like(p, v)) if torch.is_tensor(v) else v
            for k, v in entry.items()
        }
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        for key, value in saved_group.items():
            if value is not None:
                group[key] = tuple(value) if key == "betas" else value


class OptimizerOffload:
    """Keeps an optimizer's tensor state (Adam's moments) in pinned host memory between steps.

    Copies are asynchronous on the current stream, so the step that follows a reload and the
    offload that follows a step are ordered without a host synchronisation. A sharded state
    tensor moves its local shard only: the DTensor is rebuilt around the moved shard with no
    collective (DTensor ops cannot run on a CPU shard of a GPU mesh).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.device = device
        self._host: dict[tuple[int, str], Tensor] = {}

    def to_host(self) -> None:
        """Move the state to pinned host buffers (reused from step to step)."""
        for p, state in self.optimizer.state.items():
            for key, value in _tensor_state(state):
                local = value.to_local() if isinstance(value, DTensor) else value
                if local.device.type == "cpu":
                    continue
                buf = self._host.get((id(p), key))
                if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                    buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
                    self._host[(id(p), key)] = buf
                buf.copy_(local, non_blocking=True)
                state[key] = _rewrap(value, buf)

    def to_device(self) -> None:
        """Bring the state back to the compute device."""
        for _, state in self.optimizer.state.items():
            for key, value in _tensor_state(state):
                local = value.to_local() if isinstance(value, DTensor) else value
                if local.device != self.device:
                    state[key] = _rewrap(value, local.to(self.device, non_blocking=True))


def _tensor_state(state: dict[str, Any]) -> list[tuple[str, Tensor]]:
    return [(k, v) for k, v in state.items() if torch.is_tensor(v) and k != "step"]


def _rewrap(like_this: Tensor, local: Tensor) -> Tensor:
    if isinstance(like_this, DTensor):
        return DTensor.from_local(
            local,
            like_this.device_mesh,
            like_this.placements,
            run_check=False,
            shape=like_this.shape,
            stride=like_this.stride(),
        )
    return local
