"""Process groups, FSDP2 sharding and gathered state for a member's torchrun group.

Imported as ``pbt.distributed``; it knows nothing of GRPO, and of ``pbt`` only the torch-free
config floor. ``FSDPConfig`` is re-exported here, where users of FSDP look for it.
"""

from pbt.config.fsdp import FSDPConfig
from pbt.distributed.process_group import (
    CollectiveError,
    WorldInfo,
    all_gather_objects,
    all_reduce,
    barrier,
    before_shutdown,
    init_process_group,
    is_distributed,
    pick_device,
    shutdown,
    world_info,
)

__all__ = [
    "CollectiveError",
    "FSDPConfig",
    "WorldInfo",
    "all_gather_objects",
    "all_reduce",
    "barrier",
    "before_shutdown",
    "init_process_group",
    "is_distributed",
    "pick_device",
    "shutdown",
    "world_info",
]
