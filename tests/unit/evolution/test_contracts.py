"""The contracts every selection and every explore step keeps, one parametrized suite per
family (each strategy the manifest can name runs through the same assertions): built from a
manifest as campaigns and library mode build them, on real records and seeded generators."""

from __future__ import annotations

import copy
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import pytest

from pbt.config.ranges import HPRange, hp_ranges
from pbt.config.read.loader import manifest_from_dict
from pbt.evolution.breeding import build_mutations, build_pb2, build_selection
from pbt.evolution.mutation import Mutations
from pbt.evolution.pb2 import PB2Explore
from pbt.evolution.selection import Selected, TournamentSelection, TruncationSelection
from pbt.protocol.records import MemberRecord, member_id

SIZE = 8
RANGES = {
    "lr": {"min": 1e-5, "max": 1e-1, "log": True},
    "beta": {"min": 0.0, "max": 0.5},
}

SELECTIONS = {
    "tournament": {"tournament_size": 2, "elitism": False},
    "tournament-elitist": {"tournament_size": 2, "elitism": True},
    "tournament-windowed": {"tournament_size": 3, "elitism": True, "fitness_window": 2},
    "truncation": {"selection": "truncation"},
    "truncation-gap": {"selection": "truncation", "truncation_fraction": 0.5, "exploit_gap": 0.05},
    "multi-frequency": {
        "selection": "multi_frequency",
        "subpopulations": 2,
        "brackets": [2, 0, 1, 1],
    },
}
"""Every selection the manifest can name, in the settings that change what it does."""


def _manifest(population: dict, **sections):
    raw = {
        "population": {"size": SIZE, **population},
        "mutation": {"no_mutation": 0.2, "rl_hp": 0.8, "ranges": RANGES},
        **sections,
    }
    return manifest_from_dict(raw, ".")


def _population(fitness: list[list[float]], generation: int = 0) -> list[MemberRecord]:
    return [
        MemberRecord(
            member_id=member_id(generation, slot),
            generation=generation,
            hyperparameters={"lr": 1e-3 * (slot + 1), "beta": 0.1, "group_size": 4},
            fitness_history=list(history),
            status="done",
            checkpoint=f"ckpt/{member_id(generation, slot)}",
        )
        for slot, history in enumerate(fitness)
    ]


def _graded() -> list[MemberRecord]:
    """Eight members, fitness 0.0 .. 0.7 in a shuffled slot order, two evaluations each."""
    order = [3, 7, 0, 5, 1, 6, 2, 4]
    return _population([[0.1 * rank, 0.1 * rank] for rank in order])


@pytest.fixture(params=sorted(SELECTIONS))
def selection(request) -> TournamentSelection | TruncationSelection:
    return build_selection(_manifest(SELECTIONS[request.param]))


def _parents(chosen: list[Selected]) -> list[str]:
    return [s.parent.member_id for s in chosen]


def test_one_parent_per_slot_drawn_from_the_population(selection) -> None:
    population = _graded()
    chosen = selection.select(population, random.Random(0))
    assert len(chosen) == SIZE
    assert all(any(s.parent is m for m in population) for s in chosen)
    assert all(isinstance(s, Selected) for s in chosen)


def test_selection_leaves_the_records_untouched(selection) -> None:
    population = _graded()
    before = copy.deepcopy(population)
    selection.select(population, random.Random(1))
    assert population == before


def test_selection_is_reproducible_from_the_seed(selection) -> None:
    population = _graded()
    first = _parents(selection.select(population, random.Random(123)))
    assert _parents(selection.select(population, random.Random(123))) == first
    others = {tuple(_parents(selection.select(population, random.Random(s)))) for s in range(20)}
    assert len(others) > 1  # the seed matters


def _counts(selection, population: list[MemberRecord], seeds: int = 200) -> Counter:
    counts: Counter = Counter()
    for seed in range(seeds):
        counts.update(_parents(selection.select(population, random.Random(seed))))
    return counts


def test_the_fitter_member_is_a_parent_more_often(selection) -> None:
    population = _graded()
    counts = _counts(selection, population)
    by_rank = sorted(population, key=lambda m: m.fitness_history[-1])
    worst, best = by_rank[0].member_id, by_rank[-1].member_id
    assert counts[best] > counts[worst], counts


def test_collapsed_and_unevaluated_members_rank_below_every_evaluated_one(selection) -> None:
    population = _graded()
    population[2] = replace(population[2], collapsed=True)  # was the worst: rank 0
    population[4] = replace(population[4], fitness_history=[])  # was rank 1
    population[1] = replace(population[1], fitness_history=[0.8, math.nan])  # diverged, was best
    counts = _counts(selection, population)
    weakest_evaluated = min(
        (m for m in population if m.fitness_history and not m.collapsed and m is not population[1]),
        key=lambda m: m.fitness_history[-1],
    )
    for loser in (population[1], population[2], population[4]):
        assert counts[loser.member_id] <= counts[weakest_evaluated.member_id], counts


# -- explore ---------------------------------------------------------------------------------

EXPLORES: dict[str, Callable[[list[MemberRecord]], Mutations | PB2Explore]] = {
    "perturb": lambda done: build_mutations(_manifest({})),
    "perturb-resample": lambda done: build_mutations(
        _manifest({}, mutation={"ranges": RANGES, "resample_probability": 0.5})
    ),
    "perturb-elite": lambda done: build_mutations(
        _manifest({}, mutation={"ranges": RANGES, "mutate_elite": True, "no_mutation": 0.0})
    ),
    "perturb-all": lambda done: build_mutations(
        _manifest({}, mutation={"ranges": RANGES, "perturb": "all", "resample_probability": 0.25})
    ),
    "pb2": lambda done: build_pb2(
        _manifest({"selection": "truncation"}, search={"strategy": "pb2"}), done, 1
    ),
}
"""Every explore step: perturbation as the mutation section sets it, and PB2's bandit."""


def _trained() -> list[MemberRecord]:
    """Two generations of eight members, each with the fitness its generation added."""
    first = _population([[0.1 * i] for i in range(SIZE)])
    second = [
        replace(m, member_id=member_id(1, i), generation=1, fitness_history=[0.1 * i, 0.15 * i])
        for i, m in enumerate(first)
    ]
    return first + second


def _selected() -> list[Selected]:
    """An elite, two survivors and five copies, as selection hands them on."""
    parents = _trained()[SIZE:]
    return [
        Selected(parent=parents[7], is_elite=True),
        Selected(parent=parents[6], is_elite=False, survivor=True),
        Selected(parent=parents[5], is_elite=False, survivor=True),
        *(Selected(parent=parents[i], is_elite=False) for i in (7, 6, 6, 5, 7)),
    ]


@pytest.fixture(params=sorted(EXPLORES))
def explore(request) -> tuple[str, Mutations | PB2Explore]:
    return request.param, EXPLORES[request.param](_trained())


def test_one_child_per_parent_with_the_parents_names_in_range(explore) -> None:
    _, step = explore
    selected = _selected()
    children = step.mutate_population(selected, random.Random(0))
    assert len(children) == len(selected)
    ranges = {name: HPRange(**spec) for name, spec in RANGES.items()}
    for choice, (values, how) in zip(selected, children, strict=True):
        assert set(values) == set(choice.parent.hyperparameters)
        assert isinstance(how, str) and how
        for name, value in values.items():
            if name in ranges:
                assert ranges[name].min <= value <= ranges[name].max, (name, value)
            else:
                assert value == choice.parent.hyperparameters[name]  # not searched: kept


def test_survivors_keep_their_values_and_copies_explore(explore) -> None:
    name, step = explore
    selected = _selected()
    children = [step.mutate_population(selected, random.Random(seed)) for seed in range(10)]
    for run in children:
        for choice, (values, how) in zip(selected, run, strict=True):
            if choice.survivor:
                assert (values, how) == (choice.parent.hyperparameters, "none (survivor)")
    elite = {run[0][1] for run in children}
    assert elite != {"none (elite)"} if name == "perturb-elite" else elite == {"none (elite)"}
    copies = [values for run in children for values, _ in run[3:]]
    parents = [s.parent.hyperparameters for _ in children for s in selected[3:]]
    assert any(c != p for c, p in zip(copies, parents, strict=True))  # some child explored


def test_explore_leaves_the_parents_untouched(explore) -> None:
    _, step = explore
    selected = _selected()
    before = copy.deepcopy([s.parent for s in selected])
    step.mutate_population(selected, random.Random(2))
    assert [s.parent for s in selected] == before


def test_explore_is_reproducible_from_the_seed(explore) -> None:
    _, step = explore
    selected = _selected()
    first = step.mutate_population(selected, random.Random(9))
    assert step.mutate_population(selected, random.Random(9)) == first
    others = [step.mutate_population(selected, random.Random(s)) for s in range(10, 20)]
    assert any(o != first for o in others)  # the seed matters


def test_every_search_strategy_has_an_explore_here() -> None:
    """The suite covers what the manifest offers: a new selection or explore must join it."""
    from typing import get_args, get_type_hints

    from pbt.config.sections.campaign import PopulationConfig, SearchConfig

    selections = get_args(get_type_hints(PopulationConfig)["selection"])
    assert {raw.get("selection", "tournament") for raw in SELECTIONS.values()} == set(selections)
    strategies = set(get_args(get_type_hints(SearchConfig)["strategy"])) - {"optuna"}
    assert {"pbt", "pb2"} == strategies  # pbt explores by perturbation, pb2 by its bandit
    assert set(hp_ranges(_manifest({}))) == set(RANGES)
