"""Where this process sits in its torchrun group, and which device it uses.

A process started without torchrun is a group of one (rank 0 of world size 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pbt.errors import ConfigError


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
