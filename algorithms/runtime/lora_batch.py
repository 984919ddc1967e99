"""Per-row LoRA: one forward of a batch whose rows belong to different members, each row
through its own member's adapter, on one frozen base model.

The rows of one member are contiguous (a *segment*), so a LoRA layer's delta is computed one
segment at a time: ``B_m(A_m(x[start:stop])) * scaling`` for member ``m`` over its rows, the
base layer once over all rows. That is a *segmented* matmul (S-LoRA and Punica call it SGMV),
written as a loop of ordinary matmuls over slices whose bounds are Python integers fixed per
batch layout: nothing branches on data, so a decode step that runs through it can be captured
as one CUDA graph (the graph is captured per layout, as the static decoder captures per batch
shape anyway).

Why segments rather than the alternatives (``bench/population_batch.py`` times both kernels; reasoned
below):

- each segment runs exactly the operations that peft's own ``Linear.forward`` runs for that
  member alone (``result + lora_B(lora_A(x)) * scaling`` on the same shapes), so the adapter
  adds nothing of its own to a row's rounding and its gradient comes only from its rows by
  construction (the base layers do run over more rows, and a BLAS may round a row
  differently with more rows: about 1e-6 relative, seen on the CPU at 10 against 30 rows);
- a gathered matmul (per-row ``A``/``B`` gathered by member index, then ``bmm``) moves
  ``rows x in x r`` weights per layer per step: at 512 decode rows of the 0.5B shape that is
  gigabytes a token, more than the base model's weights;
- peft's mixed-adapter batches (``adapter_names=`` per row) compute the same segments but
  rebuild their row indices from Python lists in every layer of every forward, index with
  them (a gather and a scatter per layer) and need every member as a named peft adapter,
  where the shared base holds one adapter slot and members by value.

The ``stacked`` kernel is the other candidate for decoding on a GPU: all members' ``A`` as
one ``[M r, in]`` matrix, a per-row mask that keeps only the row's own member's ``r``
columns, and all ``B`` as one ``[out, M r]`` matrix: two matmuls per layer whatever ``M``,
but a different summation order than the solo forward (equal within floating-point
tolerance), so the exactness tests use ``segmented``. One member's non-finite adapter would
reach every row through the shared products (``0 x NaN`` is NaN), so a batch that holds one
runs ``segmented``, where a member's fault stays its own rows' (:meth:`RowAdapters.kernel`);
and a backward pass through the stacked products sums over every row, so a pass whose
log-probs are not finite for some member is run again segmented
(:func:`~pbt.algorithms.runtime.population_train.logprobs_together`).

Adapters live in :class:`RowAdapters`: per LoRA layer one ``[M, r, in]`` and one
``[M, out, r]`` tensor, member ``m``'s at index ``m`` (a contiguous view, so a segment's
matmul is the same call as the solo one). Loading a member copies its values in place, so
captured graphs stay valid.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

KERNELS = ("segmented", "stacked")
"""The per-row LoRA kernels: see the module's docstring."""


def kernel_for(setting: str, device: torch.device) -> str:
    """The kernel ``launch.lora_kernel`` names on ``device``: ``auto`` is ``stacked`` on a GPU
    (two matrix products a layer: 2.2x the segmented decode of 8 members on an H200), and
    ``segmented`` elsewhere (exact, and on a CPU the loop costs little)."""
    if setting == "auto":
        return "stacked" if device.type == "cuda" else "segmented"
    return setting


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows ``[start, stop)`` of a batch, all of member slot ``slot``."""

    start: int
    stop: int
    slot: int


def segments_of(sizes: Sequence[int]) -> tuple[Segment, ...]:
    """Consecutive segments of ``sizes[m]`` rows for slots ``0, 1, ...`` (empty ones left out)."""
    out, start = [], 0
    for slot, size in enumerate(sizes):
        if size:
            out.append(Segment(start, start + size, slot))
        start += size
    return tuple(out)


def lora_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every peft LoRA linear layer of ``model`` with the default adapter."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {})
    ]


class RowAdapters:
    """``slots`` members' LoRA weights for every LoRA layer of ``model``, stacked by slot.

    Args:
        model: a peft model with one LoRA adapter (``default``), as the shared base holds it.
        slots: how many members a batch may hold.
    """

    def __init__(self, model, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots ({slots}) must be at least 1")
        self.slots = slots
        self.layers = lora_layers(model)
        if not self.layers:
            raise ValueError("the model has no LoRA layers: per-row adapters need a peft model")
        self.a: list[Tensor] = []
        self.b: list[Tensor] = []
        for _, layer in self.layers:
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            self.a.append(a.new_zeros((slots, *a.shape)).requires_grad_(False))
            self.b.append(b.new_zeros((slots, *b.shape)).requires_grad_(False))
        self.finite = [True] * slots
        """Whether each slot's adapter is finite (checked as it is loaded)."""
        # a graph captured through these tensors reads them by address: the batched decoder
        # keys its graphs by this count, so a set made after them captures its own
        model.pbt_row_adapters_made = getattr(model, "pbt_row_adapters_made", 0) + 1
        self._kept: dict[tuple, Tensor] = {}
        self._masks = self._kept

    def load_from_model(self, slot: int) -> None:
        """Copy the adapter now in the model's slot into ``slot``."""
        weights = [layer.lora_A["default"].weight for _, layer in self.layers]
        weights += [layer.lora_B["default"].weight for _, layer in self.layers]
        self._copy_in(slot, weights)

    def load(self, slot: int, named: dict[str, Tensor]) -> None:
        """Copy an adapter given by the model's parameter names (``...lora_A.default.weight``)
        into ``slot``; every LoRA layer's two matrices must be there."""
        weights = [named[f"{name}.lora_A.default.weight"] for name, _ in self.layers]
        weights += [named[f"{name}.lora_B.default.weight"] for name, _ in self.layers]
        self._copy_in(slot, weights)

    def slot_views(self, slot: int) -> list[Tensor]:
        """``slot``'s matrices: every layer's ``A``, then every layer's ``B``."""
        return [t[slot] for t in self.a + self.b]

    def _copy_in(self, slot: int, weights: list[Tensor]) -> None:
        """Copy ``weights`` (:meth:`slot_views`' order) into ``slot`` in one fused copy, and
        record whether they are finite (one fused norm, one sync)."""
        views = self.slot_views(slot)
        with torch.no_grad():
            torch._foreach_copy_(views, weights)
            norms = torch._foreach_norm(views)
        self.finite[slot] = bool(torch.stack(norms).isfinite().all())

    def kernel(self, segments: tuple[Segment, ...], kernel: str) -> str:
        """The kernel a batch of ``segments`` runs: ``kernel``, but ``segmented`` while any
        slot holds a non-finite adapter (the stacked products take every slot's, and its NaN
        would reach every row)."""
        if kernel == "stacked" and not all(self.finite):
            return "segmented"
        return kernel

    def clear(self, slot: int) -> None:
        """Zero ``slot`` (an adapter left out of a batch; zeros are finite)."""
        with torch.no_grad():
            torch._foreach_zero_(self.slot_views(slot))
        self.finite[slot] = True

    def named_grads(self, slot: int) -> dict[str, Tensor]:
        """``slot``'s gradients by the model's parameter names (``...lora_A.default.weight``):
        views of the stacked gradients (zeros where a layer has none yet)."""
        out = {}
        for i, (name, _) in enumerate(self.layers):
            for key, stacked in (("A", self.a[i]), ("B", self.b[i])):
                grad = stacked.grad
                out[f"{name}.lora_{key}.default.weight"] = (
                    grad[slot] if grad is not None else stacked.new_zeros(stacked.shape[1:])
                )
        return out

    def _mask(self, segments: tuple[Segment, ...], rows: int, like: Tensor) -> Tensor:
        """``[rows, slots * r]``: 1 on each row's own slot's ``r`` columns (the stacked kernel)."""
        key = (segments, like.dtype, like.device)
        mask = self._masks.get(key)
        if mask is None:
            r = self.a[0].shape[1]
            mask = torch.zeros((rows, self.slots * r), dtype=torch.bool, device=like.device)
            for s in segments:
                mask[s.start : s.stop, s.slot * r : (s.slot + 1) * r] = True
            self._masks[key] = mask
        return mask

    @contextlib.contextmanager
    def rows(
        self, segments: tuple[Segment, ...], kernel: str = "segmented", keep_masks: bool = True
    ) -> Iterator[None]:
        """Inside the block, the model's LoRA layers send each segment's rows through its
        slot's adapter (by :meth:`kernel`); the segments must cover every row of every
        forward. ``keep_masks``: keep the stacked kernel's row mask for this layout after the
        block (a captured graph reads it); false for layouts that seldom repeat (training)."""
        if kernel not in KERNELS:
            raise ValueError(f"kernel {kernel!r} is not one of {', '.join(KERNELS)}")
        kernel = self.kernel(segments, kernel)
        for i, (_, layer) in enumerate(self.layers):
            forward = _segmented if kernel == "segmented" else _stacked
            layer.forward = _bound(forward, self, i, layer, segments)
        self._masks = self._kept if keep_masks else {}
        try:
            yield
        finally:
            self._masks = self._kept
            for _, layer in self.layers:
                del layer.forward  # the class's forward again


def _bound(forward, adapters: RowAdapters, index: int, layer, segments):
    def call(x: Tensor, *args, **kwargs) -> Tensor:
        return forward(adapters, index, layer, segments, x, *args, **kwargs)

    return call


def _lora_input(x: Tensor, a: Tensor, dropout) -> Tensor:
    """``x`` in the adapter's dtype, as peft casts it, except under autocast without dropout:
    there the matmul casts it back to the half type at once, and the round trip (half to
    float32 and back) gives the same values, so it is left out (two copies of the layer's
    activations a LoRA layer, a forward)."""
    if isinstance(dropout, torch.nn.Identity) and torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(a.dtype)


def _segmented(adapters, index, layer, segments, x: Tensor, *args, **kwargs) -> Tensor:
    """peft's ``Linear.forward`` for one adapter, applied segment by segment."""
    result = layer.base_layer(x, *args, **kwargs)
    dtype = result.dtype
    if layer.disable_adapters:
        return result
    a, b = adapters.a[index], adapters.b[index]
    dropout, scaling = layer.lora_dropout["default"], layer.scaling["default"]
    x = _lora_input(x, a, dropout)
    parts = []
    for s in segments:
        delta = torch.nn.functional.linear(
            torch.nn.functional.linear(dropout(x[s.start : s.stop]), a[s.slot]), b[s.slot]
        )
        parts.append((result[s.start : s.stop] + delta * scaling).to(dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _stacked(adapters, index, layer, segments, x: Tensor, *args, **kwargs) -> Tensor:
    """Every slot's ``A`` at once, masked to the row's own slot, then every slot's ``B``."""
    result = layer.base_layer(x, *args, **kwargs)
    dtype = result.dtype
    if layer.disable_adapters:
        return result
    a, b = adapters.a[index], adapters.b[index]  # [M, r, in], [M, out, r]
    slots, r, width = a.shape
    dropout = layer.lora_dropout["default"]
    x = dropout(_lora_input(x, a, dropout))
    hidden = torch.nn.functional.linear(x, a.reshape(slots * r, width))  # [N, ..., M r]
    mask = adapters._mask(segments, x.shape[0], hidden)
    # where, not a product: another member's inf stays out of a row (inf x 0 is NaN)
    hidden = torch.where(mask.view(x.shape[0], *([1] * (x.dim() - 2)), slots * r), hidden, 0.0)
    b_flat = b.permute(1, 0, 2).reshape(b.shape[1], slots * r)  # [out, M r]
    delta = torch.nn.functional.linear(hidden, b_flat)
    return (result + delta * layer.scaling["default"]).to(dtype)
