"""AgileRL's LLM training loop call (``finetune_llm_reasoning``, formerly ``finetune_llm``)
over :func:`~pbt.library.loop.train_population`::

    pop, fitnesses = finetune_llm(pop, init_hp=INIT_HP, max_steps=400, evo_steps=10,
                                  evaluation_interval=5, tournament=tournament,
                                  mutation=mutations, save_elite=True, elite_path="elite")

What each AgileRL argument becomes:

- ``evo_steps``, ``evaluation_interval``: steps per member between evolutions and between
  evaluations (AgileRL's loop iterations: every member takes one step per iteration).
- ``max_steps``: prompts in all, as AgileRL counts them (each iteration uses
  ``prompts_per_step`` prompts per member), so ``ceil(max_steps / (prompts_per_step *
  members))`` steps per member; ``num_epochs``: that many passes over the task's training
  rows; neither: one pass, as AgileRL. ``steps`` (this package's) counts steps directly.
- ``tournament`` / ``selection_strategy`` and ``mutation``: the evolution; given neither, the
  population's own (``population`` and ``mutation`` sections); ``eval_loop`` sets the fitness
  window of that own tournament.
- ``checkpoint_path``: where the loop keeps its checkpoints and state (``output_dir``); it
  saves at every evolution and at the end, and resumes from there when called again.
  ``checkpoint_steps`` other than ``evo_steps`` is ignored with a warning.
- ``save_elite`` / ``elite_path``: the best member's checkpoint (a PEFT adapter folder too)
  written to ``elite_path`` at the end.
- ``max_reward``: AgileRL logs the share of rewards equal to it; here it is not logged
  (a warning says so). ``target_fitness`` stops early on held-out fitness instead.
- ``env``/``env_fn`` are refused: the task is the population's ``task`` section.
  :func:`finetune_llm_multiturn` takes AgileRL's ``env_factory``, ``env_config`` and
  ``max_turns`` for a multi-turn environment (docs/environments.md). ``wb``,
  ``tensorboard`` and ``accelerator`` have no effect (warned): metrics go to MLflow and
  members run under torchrun.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pbt.config.errors import ConfigError
from pbt.config.read.canonical import canonical_sections
from pbt.evolution.breeding import build_selection
from pbt.library.loop import train_population
from pbt.library.population import Population


def finetune_llm(
    pop: Population,
    env: Any = None,
    env_fn: Any = None,
    init_hp: dict[str, Any] | None = None,
    save_elite: bool | None = None,
    elite_path: str | Path | None = None,
    wb: bool = False,
    tensorboard: bool = False,
    evo_steps: int | None = None,
    checkpoint_steps: int | None = None,
    checkpoint_path: str | Path | None = None,
    selection_strategy: Any = None,
    tournament: Any = None,
    mutation: Any = None,
    evaluation_interval: int = 10,
    max_reward: float | None = None,
    verbose: bool = True,
    accelerator: Any = None,
    max_steps: int | None = None,
    num_epochs: int | None = None,
    *,
    eval_loop: int | None = None,
    steps: int | None = None,
    target_fitness: float | None = None,
    tracking: bool | str = True,
) -> tuple[Population, list[float]]:
    """Train ``pop`` as AgileRL's ``finetune_llm_reasoning`` would; see the module docstring.

    Args:
        pop: A library population (``create_population`` or ``GRPO.population``).
        init_hp: Read for ``EVO_STEPS`` when ``evo_steps`` is not given.
        eval_loop: Evaluations averaged into the fitness that selection ranks.
        steps: Steps per member in all (overrides ``max_steps`` and ``num_epochs``).
        target_fitness: Stop once the best held-out fitness reaches it.
        tracking: True for the embedded MLflow store, a URI for a server, False off.
        (the rest): as AgileRL's, mapped as the module docstring says.

    Returns:
        ``(pop, fitnesses)``: the population and each member's last fitness.

    Raises:
        ConfigError: ``env``/``env_fn`` given, two selections that disagree, or bad intervals.
    """
    _refuse_and_warn(env, env_fn, wb, tensorboard, accelerator, max_reward)
    tournament = _selection(pop, selection_strategy, tournament, eval_loop)
    evo_steps = evo_steps or (init_hp or {}).get("EVO_STEPS") or pop.manifest.population.evo_steps
    if checkpoint_steps not in (None, evo_steps):
        warnings.warn(
            f"finetune_llm(checkpoint_steps={checkpoint_steps}) is not used: checkpoints are "
            f"written at every evolution (evo_steps={evo_steps}) and at the end",
            stacklevel=2,
        )
    pop = train_population(
        pop,
        steps=steps or _steps(pop, max_steps, num_epochs),
        evo_steps=evo_steps,
        eval_every=evaluation_interval,
        output_dir=checkpoint_path,
        tracking=tracking,
        target_fitness=target_fitness,
        progress=verbose,
        tournament=tournament,
        mutations=mutation,
    )
    if save_elite and elite_path is not None:
        max(pop, key=lambda a: a.fitness[-1] if a.fitness else -math.inf).save_checkpoint(
            elite_path
        )
    return pop, [agent.fitness[-1] if agent.fitness else -math.inf for agent in pop]


def _refuse_and_warn(env, env_fn, wb, tensorboard, accelerator, max_reward) -> None:
    if env is not None or env_fn is not None:
        raise ConfigError(
            [
                "finetune_llm(env=...) is not supported: a population trains on its task "
                "section; pass the rows and reward as config={'task': {...}} when creating it"
            ]
        )
    ignored = {
        "wb": (wb, "metrics go to MLflow (tracking=)"),
        "tensorboard": (tensorboard, "metrics go to MLflow (tracking=)"),
        "accelerator": (accelerator is not None, "members run under torchrun"),
        "max_reward": (
            max_reward is not None,
            "the share of rewards equal to it is not logged; target_fitness stops on fitness",
        ),
    }
    for key, (given, why) in ignored.items():
        if given:
            warnings.warn(f"finetune_llm({key}=...) has no effect: {why}", stacklevel=3)


def _selection(pop: Population, strategy: Any, tournament: Any, eval_loop: int | None) -> Any:
    if strategy is not None and tournament is not None and strategy is not tournament:
        raise ConfigError(
            [
                "finetune_llm got both selection_strategy and tournament, and they differ; "
                "pass one of them"
            ]
        )
    chosen = strategy or tournament
    if eval_loop is None:
        return chosen
    if chosen is not None:
        if chosen.fitness_window != eval_loop:
            raise ConfigError(
                [
                    f"finetune_llm(eval_loop={eval_loop}) contradicts the tournament's "
                    f"fitness window ({chosen.fitness_window}); set it on the tournament"
                ]
            )
        return chosen
    population = dataclasses.replace(
        pop.manifest.population, fitness_window=eval_loop, size=len(pop)
    )
    return build_selection(dataclasses.replace(pop.manifest, population=population))


def _steps(pop: Population, max_steps: int | None, num_epochs: int | None) -> int:
    """Steps per member for AgileRL's ``max_steps`` (prompts in all) or ``num_epochs``."""
    prompts = pop.manifest.algorithm.prompts_per_step
    if max_steps is None:
        member = pop[0]._activate()
        max_steps = (num_epochs or 1) * len(member.task.train)
    return max(1, math.ceil(max_steps / (prompts * len(pop))))


finetune_llm_reasoning = finetune_llm
"""AgileRL's current name for the same loop."""


def finetune_llm_multiturn(
    pop: Population,
    max_turns: int,
    env_factory: Callable[..., Any],
    env_config: dict[str, Any] | None = None,
    init_hp: dict[str, Any] | None = None,
    max_steps: int | None = None,
    save_elite: bool | None = None,
    elite_path: str | Path | None = None,
    wb: bool = False,
    tensorboard: bool = False,
    tensorboard_log_dir: str | None = None,
    evo_steps: int | None = None,
    checkpoint_steps: int | None = None,
    checkpoint_path: str | Path | None = None,
    selection_strategy: Any = None,
    tournament: Any = None,
    mutation: Any = None,
    evaluation_interval: int = 10,
    max_reward: float | None = None,
    verbose: bool = True,
    accelerator: Any = None,
    *,
    max_episode_tokens: int | None = None,
    steps: int | None = None,
    target_fitness: float | None = None,
    tracking: bool | str = True,
) -> tuple[Population, list[float]]:
    """Train ``pop`` on a multi-turn environment, in AgileRL's call shape.

    ``env_factory`` is a class (or function) defined at the top level of a ``.py`` file: every
    member process makes its environments from that file (as ``task.env: {file, class}``), so
    a lambda or a nested class is refused. ``env_config`` are its keyword arguments,
    ``max_turns`` the replies per episode. The population's other task keys (``eval_size``,
    ``train_size``, ``env_timeout_s``) are kept; the rest is :func:`finetune_llm`'s.

    Raises:
        ConfigError: ``env_factory`` is not importable from a file, or a bad argument.
    """
    task = {
        key: value
        for key, value in canonical_sections(pop.manifest)["task"].items()
        if key in ("eval_size", "train_size", "env_timeout_s")
    }
    env = {"file": _factory_file(env_factory), "class": env_factory.__name__}
    env |= {"kwargs": dict(env_config or {}), "max_turns": max_turns}
    if max_episode_tokens is not None:
        env["max_episode_tokens"] = max_episode_tokens
    pop.use_task({**task, "env": env})
    if tensorboard_log_dir is not None:
        tensorboard = True
    return finetune_llm(
        pop, init_hp=init_hp, save_elite=save_elite, elite_path=elite_path, wb=wb,
        tensorboard=tensorboard, evo_steps=evo_steps, checkpoint_steps=checkpoint_steps,
        checkpoint_path=checkpoint_path, selection_strategy=selection_strategy,
        tournament=tournament, mutation=mutation, evaluation_interval=evaluation_interval,
        max_reward=max_reward, verbose=verbose, accelerator=accelerator, max_steps=max_steps,
        steps=steps, target_fitness=target_fitness, tracking=tracking,
    )  # fmt: skip


def _factory_file(factory: Callable[..., Any]) -> str:
    """The file that defines ``factory`` at its top level, where members import it from."""
    name = getattr(factory, "__name__", "")
    module = inspect.getmodule(factory)
    source = inspect.getsourcefile(factory) if module is not None else None
    if not name.isidentifier() or getattr(module, name, None) is not factory or source is None:
        raise ConfigError(
            [
                f"finetune_llm_multiturn(env_factory={factory!r}) must be a class or function "
                "defined at the top level of a .py file: members make their environments "
                "from that file; move it there"
            ]
        )
    return str(Path(source).resolve())
