"""A campaign's population from its manifest: generation 0's hyperparameters, and the
selection and mutation rules."""

from __future__ import annotations

from pathlib import Path

from pbt.config import Manifest
from pbt.config.ranges import base_hyperparameters, hp_ranges
from pbt.controller.mutation import Mutations
from pbt.controller.search import sample_initial
from pbt.controller.selection import TournamentSelection
from pbt.protocol.records import MemberRecord, member_id


def build_selection(manifest: Manifest) -> TournamentSelection:
    """Tournament selection as the manifest's population section says."""
    pop = manifest.population
    return TournamentSelection(pop.tournament_size, pop.elitism, pop.size, pop.fitness_window)


def build_mutations(manifest: Manifest) -> Mutations:
    """Mutations as the manifest's mutation section says."""
    mut = manifest.mutation
    return Mutations(
        hp_ranges(manifest), mut.no_mutation, mut.rl_hp, mut.mutate_elite, mut.resample_probability
    )


INIT_STUDY = "initial-population"
"""The Optuna study that holds a campaign's generation-0 draws and their fitness."""


def initial_hyperparameters(manifest: Manifest, storage: str | None) -> list[dict[str, float]]:
    """Generation 0's hyperparameters, one dict per member, as ``population.init_sampler`` says."""
    base = base_hyperparameters(manifest)
    pop = manifest.population
    ranges = hp_ranges(manifest)
    if pop.init_sampler == "none" or not ranges:
        return [dict(base) for _ in range(pop.size)]
    warm_start = None
    if pop.warm_start is not None:
        is_url = "://" in pop.warm_start
        warm_start = pop.warm_start if is_url else str(Path(manifest.base_dir) / pop.warm_start)
    return sample_initial(
        ranges,
        base,
        pop.size,
        sampler=pop.init_sampler,
        seed=manifest.training.seed,
        storage=storage,
        study_name=INIT_STUDY,
        warm_start=warm_start,
    )


def initial_records(manifest: Manifest, storage: str | None) -> list[MemberRecord]:
    """Generation 0's members, their hyperparameters drawn as :func:`initial_hyperparameters`
    says (``storage``: the Optuna storage that keeps the draws)."""
    return [
        MemberRecord(member_id=member_id(0, i), generation=0, hyperparameters=values)
        for i, values in enumerate(initial_hyperparameters(manifest, storage))
    ]
