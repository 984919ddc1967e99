"""The algorithms by name, as library mode offers them: ``GRPO.population(4, lr=1e-4)``.

Each is a handle on one algorithm: its ``name``, the hyperparameters that mutate for it, and
``population()``, which builds a library-mode population of it. The learners themselves (what
trains) are :mod:`pbt.algorithms`' and are chosen by ``algorithm.name``.

AgileRL's names are here too: ``CISPO`` and ``GSPO`` are GRPO with that ``algorithm.loss``,
``LLMPPO`` is PPO, ``LLMReinforce`` (and ``LLMREINFORCE``) is REINFORCE. Users import them
from ``pbt.algorithms``, whose package re-exports this module's names on first use.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, ClassVar

from pbt.config import MUTABLE_BY_ALGORITHM, FSDPConfig
from pbt.config.errors import ConfigError
from pbt.library.agilerl import EXTRAS, agilerl_sections
from pbt.library.create import create_population
from pbt.library.population import Population


class Algorithm:
    """One algorithm of the family; subclasses set ``name``."""

    name: ClassVar[str]
    loss: ClassVar[str | None] = None
    """The ``algorithm.loss`` this handle stands for (CISPO, GSPO); None leaves it to config."""

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
        hp_config: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        device: str | None = None,
        **init_hp: Any,
    ) -> Population:
        """A library-mode population of ``size`` members of this algorithm on one shared base.

        ``init_hp`` takes AgileRL's ``INIT_HP`` keys in either case (``lr=1e-4`` or
        ``LR=1e-4``, ``group_size=8``, ``beta=0.01``), and AgileRL's other arguments
        (``tokenizer``, ``lora_config``, ``use_vllm``, ``vllm_config``, ``accelerator``, ...,
        as :mod:`pbt.library.agilerl` reads them); ``fsdp_config`` is an ``FSDPConfig``, a
        dict of its fields, or True; ``hp_config`` a dict of ranges or a
        ``HyperparameterConfig``; ``config`` holds any other manifest sections. Nothing is
        loaded until an agent is first used. See :func:`pbt.create_population`.
        """
        extras = {key: init_hp.pop(key) for key in list(init_hp) if key in EXTRAS}
        agilerl, more_hp = agilerl_sections(extras, f"{cls.__name__}.population")
        init_hp |= more_hp
        sections = {name: dict(values) for name, values in (config or {}).items()}
        for name, values in agilerl.items():
            sections[name] = {**sections.get(name, {}), **values}
        if cls.loss is not None:
            cls._set_loss(sections.setdefault("algorithm", {}))
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

    @classmethod
    def _set_loss(cls, algorithm: dict[str, Any]) -> None:
        given = algorithm.setdefault("loss", cls.loss)
        if given != cls.loss:
            raise ConfigError(
                [
                    f"algorithm.loss ({given!r}) contradicts {cls.__name__}, which is GRPO with "
                    f"loss {cls.loss!r}; drop algorithm.loss or use GRPO"
                ]
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


class CISPO(GRPO):
    """GRPO with the CISPO objective (``algorithm.loss: cispo``): clipped importance weights,
    gradients through every token."""

    loss = "cispo"


class GSPO(GRPO):
    """GRPO with the GSPO objective (``algorithm.loss: gspo``): sequence-level ratios."""

    loss = "gspo"


LLMPPO = PPO
"""AgileRL's name for PPO on an LLM."""
LLMReinforce = REINFORCE
"""AgileRL's name for REINFORCE on an LLM."""
LLMREINFORCE = REINFORCE
"""AgileRL's other spelling of it."""
