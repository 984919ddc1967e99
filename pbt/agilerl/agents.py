"""The algorithms by name, as AgileRL's LLM classes: ``GRPO(model_name=...)`` is one agent,
``GRPO.population(4, lr=1e-4)`` a population of them.

Each class is an :class:`~pbt.library.population.Agent` of one algorithm: its constructor takes
AgileRL's keywords (:mod:`pbt.agilerl.keywords`, :mod:`pbt.agilerl.arguments`) and builds a
library-mode population of one behind the agent, so the agent has AgileRL's methods
(``get_action``, ``learn``, ``test``, ``save_checkpoint``, ``load_checkpoint``, ``clone``) and
loads nothing until first used. ``population()`` builds many on one shared base, each an
instance of the same class. The learners themselves (what trains) are :mod:`pbt.algorithms`'
and are chosen by ``algorithm.name``.

AgileRL's names are here too: ``CISPO`` and ``GSPO`` are GRPO with that ``algorithm.loss``,
``LLMPPO`` is PPO, ``LLMReinforce`` (and ``LLMREINFORCE``) is REINFORCE. ``VLLMConfig`` is
AgileRL's (:mod:`pbt.agilerl.vllm_config`). Users import them from ``pbt.algorithms``, whose
package re-exports this module's names on first use.

Under torchrun every rank builds the same agent and makes the same calls: without
``fsdp_config`` the agent is data parallel (each rank samples its own prompts; the adapter's
gradients are averaged over the ranks at each optimizer step), with it the model is sharded
with FSDP2. A sharded agent used in a process that torchrun did not start fails at first use
with one line saying so.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, ClassVar

from pbt.agilerl.arguments import EXTRAS, agilerl_sections
from pbt.agilerl.keywords import read_keywords
from pbt.agilerl.vllm_config import VLLMConfig
from pbt.config import MUTABLE_BY_ALGORITHM, FSDPConfig
from pbt.config.errors import ConfigError
from pbt.library.create import create_population
from pbt.library.population import Agent, Population

__all__ = [
    "CISPO", "DPO", "GRPO", "GSPO", "LLMPPO", "LLMREINFORCE", "PPO", "REINFORCE", "SFT",
    "Algorithm", "LLMReinforce", "VLLMConfig",
]  # fmt: skip


class Algorithm(Agent):
    """One agent of an algorithm of the family; subclasses set ``name`` (and ``loss``).

    Args:
        pad_token_id, pad_token: the tokenizer's padding (checked against the model's
            tokenizer; default its own), in AgileRL's positional order.
        model_name: the base model: a local folder, a hub id, ``builtin:tiny`` or a GGUF file.
        fsdp_config: an ``FSDPConfig``, a dict of its fields, or True: FSDP2 under torchrun.
        hp_config: the mutation ranges (a dict or AgileRL's ``HyperparameterConfig``).
        device: ``cpu``, ``cuda`` (``cuda:0`` reads as ``cuda``: each rank takes its own GPU)
            or ``auto``.
        config: any other manifest sections (``{"task": {...}}``).
        **kwargs: AgileRL's other keywords (``lora_config``, ``vllm_config``, ``seed``, ...)
            and hyperparameters in either case (``lr`` or ``LR``, ``group_size``, ``beta``,
            ``batch_size``, ``max_output_tokens``, ``temperature``, ...).

    Raises:
        ConfigError: every refused or unknown keyword and bad value, together.
    """

    name: ClassVar[str]
    loss: ClassVar[str | None] = None
    """The ``algorithm.loss`` this class stands for (CISPO, GSPO); None leaves it to config."""
    defaults: ClassVar[dict[str, Any]] = {}
    """AgileRL's defaults kept where the manifest's would not do, by dotted path (DPO's beta,
    which must be above 0); a value the call gives wins."""

    def __init__(
        self,
        pad_token_id: int | None = None,
        pad_token: str | None = None,
        model_name: str | None = None,
        *,
        fsdp_config: FSDPConfig | dict[str, Any] | bool | None = None,
        hp_config: Any = None,
        device: Any = None,
        config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        population = type(self)._build(
            1,
            type(self).__name__,
            dict(model_name=model_name, pad_token_id=pad_token_id, pad_token=pad_token),
            dict(fsdp_config=fsdp_config, hp_config=hp_config, device=device, config=config),
            kwargs,
        )
        Agent.__init__(self, population, population.agents[0].record())
        population.agents[0] = self

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
        hp_config: Any = None,
        config: dict[str, Any] | None = None,
        device: Any = None,
        **kwargs: Any,
    ) -> Population:
        """A library-mode population of ``size`` agents of this class on one shared base.

        Takes the constructor's keywords (AgileRL's ``population(size, ..., **kwargs)`` passes
        them to each agent). Nothing is loaded until an agent is first used. See
        :func:`pbt.create_population`.
        """
        model = dict(model_name=model_name, pad_token_id=pad_token_id, pad_token=pad_token)
        own = dict(fsdp_config=fsdp_config, hp_config=hp_config, device=device, config=config)
        return cls._build(size, f"{cls.__name__}.population", model, own, kwargs)

    @classmethod
    def _build(
        cls,
        size: int,
        where: str,
        model: dict[str, Any],
        own: dict[str, Any],
        kwargs: dict[str, Any],
    ) -> Population:
        """The population behind ``size`` agents of this class, from a call's arguments."""
        extras = {key: kwargs.pop(key) for key in list(kwargs) if key in EXTRAS}
        try:
            agilerl, init_hp = agilerl_sections(extras, where)
            problems = []
        except ConfigError as err:  # reported with the rest below
            agilerl, init_hp, problems = {}, {}, list(err.problems)
        more, keyword_hp, refused = read_keywords(kwargs, where)
        problems += refused
        sections = {name: dict(values) for name, values in (own["config"] or {}).items()}
        for extra in (agilerl, more):
            _merge(sections, extra)
        if cls.loss is not None:
            cls._set_loss(sections.setdefault("algorithm", {}))
        hp = init_hp | keyword_hp
        for path, value in cls.defaults.items():
            section, key = path.split(".")
            if key.upper() not in hp and key not in sections.get(section, {}):
                sections.setdefault(section, {})[key] = value
        if size == 1 and not {"TOURN_SIZE", "TOURNAMENT_SIZE"} & set(hp):
            sections.setdefault("population", {}).setdefault("tournament_size", 1)
        model_section = sections.setdefault("model", {})
        for key in ("pad_token_id", "pad_token"):
            if model[key] is not None:
                model_section[key] = model[key]
        fsdp = own["fsdp_config"]
        if fsdp is not None:
            fsdp = asdict(fsdp) if isinstance(fsdp, FSDPConfig) else fsdp
            sections.setdefault("distributed", {})["fsdp"] = fsdp
        device = own["device"]
        try:
            population = create_population(
                hp,
                algo=cls.name,
                config=sections,
                population_size=size,
                hp_config=own["hp_config"],
                model_name=model["model_name"],
                device=None if device is None else str(device).split(":")[0],
                agent_class=cls,
            )
        except ConfigError as err:  # the keywords' problems and the manifest's, together
            raise ConfigError(problems + err.problems, where) from None
        if problems:
            raise ConfigError(problems, where)
        return population

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


def _merge(into: dict[str, Any], more: dict[str, Any]) -> None:
    """Merge nested sections ``more`` into ``into`` in place, key by key."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            into[key] = dict(into[key])
            _merge(into[key], value)
        else:
            into[key] = value


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
    defaults: ClassVar[dict[str, Any]] = {"algorithm.beta": 0.1}


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
