"""The algorithms by name, as library mode offers them: ``GRPO.population(4, lr=1e-4)``.

Each is a handle on one algorithm: its ``name``, the hyperparameters that mutate for it, and
``population()``, which builds a library-mode population of it. The learners themselves (what
trains) are :mod:`pbt.algorithms`' and are chosen by ``algorithm.name``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, ClassVar

from pbt.config import MUTABLE_BY_ALGORITHM, FSDPConfig
from pbt.library.create import create_population
from pbt.library.population import Population


class Algorithm:
    """One algorithm of the family; subclasses set ``name``."""

    name: ClassVar[str]

    @classmethod
    def mutable(cls) -> tuple[str, ...]:
        """The hyperparameters a mutation may change for this algorithm."""
        return MUTABLE_BY_ALGORITHM[cls.name]

    @classmethod
    def population(
        cls,
        size: int,
        *,
        model_name: str | None = None,
        pad_token_id: int | None = None,
        pad_token: str | None = None,
        fsdp_config: FSDPConfig | dict[str, Any] | bool | None = None,
        hp_config: dict[str, dict[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
        device: str | None = None,
        **init_hp: Any,
    ) -> Population:
        """A library-mode population of ``size`` members of this algorithm on one shared base.

        ``init_hp`` takes AgileRL's ``INIT_HP`` keys in either case (``lr=1e-4`` or
        ``LR=1e-4``, ``group_size=8``, ``beta=0.01``); ``fsdp_config`` is an ``FSDPConfig``,
        a dict of its fields, or True; ``config`` holds any other manifest sections. Nothing
        is loaded until an agent is first used. See :func:`pbt.create_population`.
        """
        sections = {name: dict(values) for name, values in (config or {}).items()}
        model = sections.setdefault("model", {})
        for key, value in (("pad_token_id", pad_token_id), ("pad_token", pad_token)):
            if value is not None:
                model[key] = value
        if fsdp_config is not None:
            fsdp = asdict(fsdp_config) if isinstance(fsdp_config, FSDPConfig) else fsdp_config
            sections.setdefault("distributed", {})["fsdp"] = fsdp
        return create_population(
            {key.upper(): value for key, value in init_hp.items()},
            algo=cls.name,
            config=sections,
            population_size=size,
            hp_config=hp_config,
            model_name=model_name,
            device=device,
        )


class GRPO(Algorithm):
    """GRPO and its family of losses (``algorithm.loss``: grpo, dr_grpo, dapo, cispo, gspo)."""

    name = "GRPO"


class REINFORCE(Algorithm):
    """REINFORCE with a group-mean or leave-one-out baseline."""

    name = "REINFORCE"


class PPO(Algorithm):
    """LLM PPO with a critic on the same frozen base."""

    name = "PPO"


class SFT(Algorithm):
    """Supervised fine-tuning on prompt/response pairs."""

    name = "SFT"


class DPO(Algorithm):
    """Direct preference optimisation on chosen/rejected pairs."""

    name = "DPO"
