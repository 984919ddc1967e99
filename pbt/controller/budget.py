"""A campaign's budget: what it has spent, which limit ends it, and a budget changed on resume.

``pbt resume DIR --generations N`` (and ``--total-steps``, ``--wall-time-s``, ``--gpu-hours``,
``--target-fitness``: one flag per :class:`~pbt.config.sections.campaign.BudgetConfig` field) changes the
budget of a campaign that ended or was interrupted; values are totals for the whole campaign,
as in the manifest. The new budget is written into the manifest sections the store keeps, so a
later plain resume keeps it. A campaign so extended makes the decisions of one given that budget
from the start: its stop is decided from the same figures, and a campaign that had ended selects
its next generation from the RNG state the longer campaign had at that point.

Two things cannot be extended that way, and are refused with the reason:

- The members' learning-rate schedule spans the whole campaign, ``budget.generations x
  evo_steps`` steps. Under a decaying ``optim.schedule`` (``linear``, ``cosine``) every step
  already trained decayed toward the old end, so changing ``generations`` would not give the
  longer campaign's members. The other keys leave the schedule's length alone, and under
  ``constant`` (warmup included) the length changes nothing: the members after the change train
  exactly as the longer campaign's.
- The ``optuna`` strategy completes its running trials when the campaign ends, and a completed
  trial cannot continue: a finished search is not extended (an interrupted one is).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any

from pbt.config import Manifest
from pbt.config.agilerl import TRAINING_RULES
from pbt.config.sections.campaign import BudgetConfig
from pbt.protocol.records import MemberRecord

FLAGS = {f.name: "--" + f.name.replace("_", "-") for f in fields(BudgetConfig)}
"""The ``pbt resume`` flag of each budget key."""


@dataclass(frozen=True, slots=True)
class Spent:
    """What a campaign has used once a generation is done."""

    generations: int
    """Generations done (committed), the one just done included."""
    total_steps: int
    """Training steps of the members that trained (replaced members' clones excluded)."""
    wall_time_s: float
    gpu_hours: float
    best_fitness: float
    """The best fitness of the generation just done (``population.fitness_window``)."""


def exhausted(budget: BudgetConfig, spent: Spent) -> list[tuple[str, str]]:
    """Each budget key that ``spent`` has reached, with the stop reason in words, in the order
    a campaign names its stop."""
    checks = [
        ("generations", spent.generations >= budget.generations),
        ("target_fitness", _reached(budget.target_fitness, spent.best_fitness)),
        ("total_steps", _reached(budget.total_steps, spent.total_steps)),
        ("wall_time_s", _reached(budget.wall_time_s, spent.wall_time_s)),
        ("gpu_hours", _reached(budget.gpu_hours, spent.gpu_hours)),
    ]
    reasons = {
        "generations": f"{budget.generations} generations done",
        "target_fitness": f"target fitness {budget.target_fitness} reached",
        "total_steps": f"{budget.total_steps} total steps done",
        "wall_time_s": f"wall time {budget.wall_time_s} s spent",
        "gpu_hours": f"{budget.gpu_hours} GPU-hours spent",
    }
    return [(key, reasons[key]) for key, hit in checks if hit]


def _reached(limit: float | None, used: float) -> bool:
    return limit is not None and used >= limit


def spent_problems(budget: BudgetConfig, spent: Spent) -> list[str]:
    """Why ``budget`` cannot continue a campaign that has used ``spent``: one line for each key
    already reached, with its value, the rule and the flag that fixes it."""
    problems = []
    for key, _ in exhausted(budget, spent):
        value, flag = getattr(budget, key), FLAGS[key]
        if key == "generations":
            problems.append(
                f"budget.generations ({value}) must be more than the {spent.generations} "
                f"generations already done; give {flag} {spent.generations + 1} or more"
            )
        elif key == "target_fitness":
            problems.append(
                f"budget.target_fitness ({value}) is already reached (best fitness "
                f"{spent.best_fitness:.4g}); give {flag} above {spent.best_fitness:.4g}"
            )
        else:
            used = {
                "total_steps": f"{spent.total_steps} steps trained",
                "wall_time_s": f"{spent.wall_time_s:.1f} s",
                "gpu_hours": f"{spent.gpu_hours:.4g} GPU-hours",
            }[key]
            problems.append(
                f"budget.{key} ({value}) must be more than the campaign has used ({used}); "
                f"give {flag} above it"
            )
    return problems


def change_problems(
    before: Manifest, after: Manifest, changes: dict[str, Any], ended: bool
) -> list[str]:
    """Why ``changes`` to the budget (``before`` -> ``after``) cannot give the decisions of a
    campaign planned with them from the start (see the module's docstring); ``ended``: the
    campaign had finished."""
    problems = []
    schedule = after.optim.schedule
    if after.budget.generations != before.budget.generations and schedule != "constant":
        problems.append(
            f"{FLAGS['generations']} {after.budget.generations}: optim.schedule is "
            f"{schedule!r}, which decays the learning rate over the campaign's planned steps "
            f"(budget.generations {before.budget.generations} x evo_steps); the members so far "
            "decayed toward that end, so this campaign cannot become one planned longer: start "
            "a new campaign with the larger budget (--total-steps, --wall-time-s and "
            "--gpu-hours leave the schedule alone, up to the planned generations)"
        )
    if ended and changes and after.search.strategy == "optuna":
        problems.append(
            "search.strategy optuna: the campaign completed its running trials when it ended, "
            "and a completed Optuna trial cannot continue; start a new campaign (its "
            "population.warm_start may name this one)"
        )
    return problems


def with_budget(sections: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A copy of a manifest's ``sections`` (as written) with the budget keys of ``changes`` set
    in its ``budget`` section, and AgileRL's spellings of the same keys (``training.max_steps``,
    ...) dropped, so that the two never disagree."""
    out = copy.deepcopy(sections)
    training = out.get("training")
    for key, value in changes.items():
        if isinstance(training, dict):
            for name in [n for n in training if _aliases(str(n), key)]:
                del training[name]
        if not isinstance(out.get("budget"), dict):
            out["budget"] = {}
        out["budget"][key] = value
    return out


def _aliases(name: str, key: str) -> bool:
    rule = TRAINING_RULES.get(name.upper())
    return rule is not None and f"budget.{key}" in rule.targets


__all__ = ["FLAGS", "Spent", "change_problems", "exhausted", "spent_problems", "with_budget"]


def spent_by(
    manifest: Manifest,
    members: list[MemberRecord],
    generation: int,
    finished: list[MemberRecord],
    elapsed: float,
    gpu_seconds: float,
) -> Spent:
    """What a campaign has used once ``generation`` (its members ``finished``) is done, from
    the records of every member (``members``), ``elapsed`` seconds and ``gpu_seconds``."""
    # each member that trained (not one replaced by a clone) trained evo_steps steps, or
    # fewer when it collapsed; its own step count is its lineage's, parents' steps included
    evo_steps = manifest.population.evo_steps
    total_steps = sum(
        int(m.metrics.get("trained_steps", evo_steps))
        for m in members
        if m.status == "done"
        and m.generation <= generation
        and not (m.mutation or "").startswith("replaced")
    )
    window = manifest.population.fitness_window
    return Spent(
        generations=generation + 1,
        total_steps=total_steps,
        wall_time_s=elapsed,
        gpu_hours=gpu_seconds / 3600,
        best_fitness=max(m.fitness(window) for m in finished),
    )
