"""A member's torchrun group: rank, world size, device, and the few collectives it needs.

A process started without torchrun is a group of one (rank 0 of world size 1): every
collective here is then a no-op, so callers never branch on the world size.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pbt.config.errors import ConfigError, PbtError

DEFAULT_TIMEOUT_S = 600.0
_timeout_s = DEFAULT_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class WorldInfo:
    """Rank, local rank and world size, from torchrun's environment."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1


def world_info() -> WorldInfo:
    """Read torchrun's ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` (defaults: a group of one)."""
    return WorldInfo(
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    """The device for ``choice`` (auto, cpu, cuda); CUDA ranks take their local GPU.

    Raises:
        ConfigError: ``cuda`` was asked for on a machine without a GPU.
    """
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(["training.device ('cuda') but no CUDA GPU is visible; use cpu or auto"])
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_process_group(device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> WorldInfo:
    """Join torchrun's group (``nccl`` on CUDA, ``gloo`` on CPU); a no-op without torchrun.

    Under torchrun the group is made even for one rank, so FSDP2 works at any world size.

    ``timeout_s`` bounds every collective: a rank stuck waiting for a dead peer fails with an
    error after that long instead of hanging the member forever.
    """
    global _timeout_s
    _timeout_s = timeout_s
    world = world_info()
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return world


_BEFORE_SHUTDOWN: list[Callable[[], None]] = []


def before_shutdown(callback: Callable[[], None]) -> None:
    """Run ``callback`` in :func:`shutdown` before the group is destroyed (e.g. an engine that
    made process groups of its own tears them down first)."""
    _BEFORE_SHUTDOWN.append(callback)


def shutdown() -> None:
    """Leave the group cleanly (all ranks must call it)."""
    while _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.pop()()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def is_distributed() -> bool:
    """Whether this process is one rank of a group larger than one."""
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce(
    values: list[float], op: str = "sum", device: torch.device | None = None
) -> list[float]:
    """Reduce a few floats across ranks (``sum`` or ``max``); identity for a group of one."""
    if not is_distributed():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device or _comm_device())
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    try:
        dist.all_reduce(tensor, op=reduce_op)
    except (RuntimeError, dist.DistBackendError) as err:
        raise CollectiveError(
            f"another rank of this member did not reach a collective within distributed.timeout_s "
            f"({_timeout_s:.0f} s): it died or hung; see that rank's log ({str(err).splitlines()[0]})"
        ) from err
    return tensor.tolist()


def all_gather_objects(obj: object) -> list[object]:
    """Every rank's ``obj``, in rank order; ``[obj]`` for a group of one."""
    if not is_distributed():
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for every rank; a no-op for a group of one."""
    if is_distributed():
        dist.barrier()


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class CollectiveError(PbtError):
    """A collective failed or timed out: another rank of the member died or hung."""
