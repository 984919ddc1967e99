"""FSDP2 for a member: the sharding policy and data-parallel gradient sync (the settings are
:class:`pbt.config.FSDPConfig`).

The policy applies ``fully_shard`` to each transformer block (the classes the model names in
``_no_split_modules``, so no architecture is hard-coded), then the input embeddings and an
untied output head, then the root. Tied embeddings stay in the root's group. On CUDA parameters are computed in bfloat16 and gradients
reduced in float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from pbt.config.errors import ConfigError
from pbt.config.sections.fsdp import FSDPConfig


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: modules whose class the model lists as unsplittable."""
    names: set[str] = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no transformer blocks (_no_split_modules)")
    return blocks


def shard_model(
    model: nn.Module, base: nn.Module, cfg: FSDPConfig, device: torch.device
) -> nn.Module:
    """Shard ``model`` (the peft wrapper) in place and return it.

    Args:
        model: the root to shard last (it owns ``generate``).
        base: the underlying transformers model, whose blocks, embeddings and head are found.
        cfg: the sharding options.
        device: the compute device of this rank.

    Raises:
        ConfigError: no process group (the member was not started by torchrun).
    """
    if not dist.is_initialized():
        raise ConfigError(
            [
                "FSDP sharding needs an initialised process group: launch the member with "
                "torchrun (e.g. torchrun --nproc_per_node=2 -m pbt.worker.train manifest.yaml)"
            ]
        )
    mesh = dist.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
    if device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in transformer_blocks(base):
        fully_shard(block, **kwargs)
    embeddings, head = base.get_input_embeddings(), base.get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight
    # A tied embedding is used first and last: in its own group it would be resharded by the
    # time the head needs it, so it stays with the root, which is gathered throughout.
    if not tied:
        fully_shard(embeddings, **kwargs)
        if head is not None:
            fully_shard(head, **kwargs)
    fully_shard(model, **kwargs)
    register_fsdp_forward_method(model, "generate")
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn FSDP's reduce-scatter on or off for the coming backward passes."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def average_gradients(params: list[nn.Parameter]) -> None:
    """Data parallel: average the gradients of ``params`` across ranks, as one flat buffer."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(
        flat, op=dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM
    )
    if dist.get_backend() != "nccl":
        flat /= dist.get_world_size()
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).clone()
        offset += n


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded with FSDP2."""
    return isinstance(model, FSDPModule)
