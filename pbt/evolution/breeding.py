"""A population's members from its manifest: generation 0, the selection and mutation rules,
and each next generation's children, built the same way for campaigns and library mode."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pbt.config import Manifest
from pbt.config.ranges import base_hyperparameters, batch_rule, hp_ranges, keep_batch_rule
from pbt.evolution.multi_frequency import MultiFrequencySelection
from pbt.evolution.mutation import Mutations
from pbt.evolution.pb2 import PB2Explore, observations
from pbt.evolution.search import sample_initial
from pbt.evolution.selection import Selected, TournamentSelection, TruncationSelection
from pbt.protocol.records import MemberRecord, member_id


def build_selection(
    manifest: Manifest,
) -> TournamentSelection | TruncationSelection | MultiFrequencySelection:
    """Tournament, truncation or multi-frequency selection as the manifest's population
    section says."""
    pop = manifest.population
    if pop.selection == "multi_frequency":
        return MultiFrequencySelection(
            pop.size, pop.subpopulations, pop.frequencies, pop.brackets, pop.fitness_window
        )
    if pop.selection == "truncation":
        return TruncationSelection(
            pop.truncation_fraction,
            pop.size,
            pop.fitness_window,
            pop.exploit_gap,
            pop.ready_generations,
        )
    return TournamentSelection(pop.tournament_size, pop.elitism, pop.size, pop.fitness_window)


def build_mutations(manifest: Manifest, ranks: int | None = None) -> Mutations:
    """Mutations as the manifest's mutation section says, keeping the batch rules of members
    of ``ranks`` ranks (default: the manifest's launch ranks)."""
    mut = manifest.mutation
    return Mutations(
        hp_ranges(manifest), mut.no_mutation, mut.rl_hp, mut.mutate_elite,
        mut.resample_probability, rule=batch_rule(manifest, ranks), perturb=mut.perturb,
        perturb_survivors=mut.perturb_survivors,
    )  # fmt: skip


def build_pb2(manifest: Manifest, members: Sequence[MemberRecord], generation: int) -> PB2Explore:
    """``search.strategy: pb2``'s explore step after ``generation``, its data from ``members``
    (every generation's, as the store holds them)."""
    data = observations(members, generation)
    return PB2Explore(hp_ranges(manifest), data, generation, batch_rule(manifest))


INIT_STUDY = "initial-population"
"""The Optuna study that holds a campaign's generation-0 draws and their fitness."""


def initial_hyperparameters(manifest: Manifest, storage: str | None) -> list[dict[str, float]]:
    """Generation 0's hyperparameters, one dict per member, as ``population.init_sampler`` says."""
    base = base_hyperparameters(manifest)
    pop = manifest.population
    ranges = hp_ranges(manifest)
    if pop.init_sampler == "none" or not ranges:
        return [dict(base) for _ in range(pop.size)]
    rule = batch_rule(manifest)
    warm_start = None
    if pop.warm_start is not None:
        is_url = "://" in pop.warm_start
        warm_start = pop.warm_start if is_url else str(Path(manifest.base_dir) / pop.warm_start)
    drawn = sample_initial(
        ranges,
        base,
        pop.size,
        sampler=pop.init_sampler,
        seed=manifest.training.seed,
        storage=storage,
        study_name=INIT_STUDY,
        warm_start=warm_start,
    )
    return [keep_batch_rule(values, ranges, rule) for values in drawn]


def initial_records(manifest: Manifest, storage: str | None) -> list[MemberRecord]:
    """Generation 0's members, their hyperparameters drawn as :func:`initial_hyperparameters`
    says (``storage``: the Optuna storage that keeps the draws)."""
    return [
        MemberRecord(member_id=member_id(0, i), generation=0, hyperparameters=values)
        for i, values in enumerate(initial_hyperparameters(manifest, storage))
    ]


def child_record(
    parent: MemberRecord,
    child_id: str,
    generation: int,
    hyperparameters: dict[str, float] | None = None,
    mutation: str = "none",
) -> MemberRecord:
    """A child of ``parent``: it starts from the parent's checkpoint, fitness history and step
    count, with ``hyperparameters`` (default: the parent's) applied after loading."""
    return MemberRecord(
        member_id=child_id,
        generation=generation,
        parent_id=parent.member_id,
        parent_checkpoint=parent.checkpoint,
        hyperparameters=dict(
            parent.hyperparameters if hyperparameters is None else hyperparameters
        ),
        mutation=mutation,
        fitness_history=list(parent.fitness_history),
        steps=parent.steps,
    )


def breed(
    selected: Sequence[Selected],
    generation: int,
    mutations: Mutations | PB2Explore | None = None,
    rng: random.Random | None = None,
) -> list[MemberRecord]:
    """Generation ``generation``'s members, one per selected parent in slot order, named
    :func:`~pbt.protocol.records.member_id` ``(generation, slot)``.

    With ``mutations`` each child is mutated as :meth:`Mutations.mutate_population` says,
    drawing from ``rng`` in slot order; without, every child keeps its parent's
    hyperparameters (``"none"``, ``"none (elite)"``), as AgileRL's selection leaves them.
    """
    if mutations is None:
        mutated = [
            (dict(s.hyperparameters), s.how or "none")
            if s.hyperparameters is not None
            else (
                dict(s.parent.hyperparameters),
                "none (elite)" if s.is_elite else ("none (survivor)" if s.survivor else "none"),
            )
            for s in selected
        ]
    else:
        if rng is None:
            raise TypeError("breed(selected, generation, mutations, rng): mutations need the rng")
        mutated = mutations.mutate_population(list(selected), rng)
    return [
        child_record(choice.parent, member_id(generation, slot), generation, values, how)
        for slot, (choice, (values, how)) in enumerate(zip(selected, mutated, strict=True))
    ]


def lineage_event(child: MemberRecord, kind: str, detail: str | None = None) -> dict[str, Any]:
    """The store's lineage entry for ``child``: how it came from its parent (``kind``: elite,
    clone, mutate, create) and, in words, what was done (default: its mutation)."""
    return {
        "generation": child.generation,
        "member_id": child.member_id,
        "parent_id": child.parent_id,
        "kind": kind,
        "detail": child.mutation if detail is None else detail,
    }


def selection_events(
    selected: Sequence[Selected], children: Sequence[MemberRecord]
) -> list[dict[str, Any]]:
    """The lineage entries of :func:`breed`'s ``children`` of ``selected``."""
    events = []
    for choice, child in zip(selected, children, strict=True):
        unchanged = (child.mutation or "").startswith("none")
        kind = "elite" if choice.is_elite else ("clone" if unchanged else "mutate")
        events.append(lineage_event(child, kind))
    return events
