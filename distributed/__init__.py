"""Process groups and devices for a member's torchrun group (imported as ``pbt.distributed``)."""

from pbt.distributed.process_group import WorldInfo, pick_device, world_info

__all__ = ["WorldInfo", "pick_device", "world_info"]
