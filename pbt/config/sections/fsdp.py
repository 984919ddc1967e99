"""FSDP2 settings of a member: a plain dataclass and its rules, checked without torch.

``distributed.fsdp`` in a manifest (or ``INIT_HP["FSDP"]``) is ``True`` or a dict of these
fields; :func:`fsdp_problems` is the one place their rules are stated, for the manifest and for
an :class:`FSDPConfig` built in code alike. Sharding itself is :func:`pbt.distributed.fsdp.
shard_model`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pbt.config.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class FSDPConfig:
    """How a member's model is sharded across its ranks with FSDP2.

    Raises:
        ConfigError: a field that breaks a rule of :func:`fsdp_problems`.
    """

    reshard_after_forward: bool = True
    """Free gathered parameters after each module's forward (less memory, one more all-gather
    in backward)."""
    optim_cpu_offload: bool = True
    """Keep Adam's moments on the CPU except during ``step()``."""
    cpu_offload: bool = False
    """Offload sharded parameters and gradients to the CPU; needs a vLLM rollout, because HF
    ``generate`` needs the weights on the compute device."""
    defer_grad_sync: bool = True
    """Skip the gradient reduce-scatter until the last micro-batch of an optimizer step."""

    def __post_init__(self) -> None:
        problems = fsdp_problems(dataclasses.asdict(self), "FSDPConfig")
        if problems:
            raise ConfigError(problems)

    @classmethod
    def from_value(cls, value: bool | Mapping[str, Any] | None) -> FSDPConfig | None:
        """``INIT_HP["FSDP"]``: True means the defaults, a dict sets fields, None/False is off."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        return cls(**value)


FSDP_FIELDS: dict[str, bool] = {f.name: f.default for f in dataclasses.fields(FSDPConfig)}
"""The fields of :class:`FSDPConfig` and their defaults."""


def fsdp_problems(values: Mapping[str, object], prefix: str) -> list[str]:
    """Every problem of FSDP fields given as a mapping, each naming ``prefix.<field>``."""
    problems: list[str] = []
    for key, value in values.items():
        if key not in FSDP_FIELDS:
            problems.append(
                f"{prefix}.{key} is not an FSDPConfig field; valid: {', '.join(FSDP_FIELDS)}"
            )
        elif not isinstance(value, bool):
            problems.append(f"{prefix}.{key} ({value!r}) must be true or false")
    if values.get("cpu_offload") is True and values.get("optim_cpu_offload", True) is True:
        problems.append(
            f"{prefix}.cpu_offload and optim_cpu_offload are both on: cpu_offload already "
            "keeps optimizer state on the CPU; set optim_cpu_offload: false"
        )
    return problems
