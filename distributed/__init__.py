"""Process groups, FSDP2 sharding and gathered state for a member's torchrun group.

Imported as ``pbt.distributed``; it knows nothing of GRPO, and of ``pbt`` only the torch-free
config floor. ``FSDPConfig`` is re-exported here, where users of FSDP look for it (AgileRL:
``from agilerl.distributed import FSDPConfig``), and importing it loads no torch: the process
group's names come from :mod:`pbt.distributed.process_group` on first use.
"""

from pbt.config.sections.fsdp import FSDPConfig

_PROCESS_GROUP = (
    "CollectiveError", "WorldInfo", "all_gather_objects", "all_reduce", "barrier",
    "before_shutdown", "init_process_group", "is_distributed", "pick_device", "shutdown",
    "world_info",
)  # fmt: skip
"""The names of :mod:`pbt.distributed.process_group` this package re-exports (they import
torch)."""


def __getattr__(name: str):
    """The process group's names, imported on first use: ``FSDPConfig`` alone stays torch-free."""
    if name not in _PROCESS_GROUP:
        raise AttributeError(f"module 'pbt.distributed' has no attribute {name!r}")
    from pbt.distributed import process_group

    return getattr(process_group, name)


__all__ = ["FSDPConfig", *_PROCESS_GROUP]
