"""PB2's explore step (``search.strategy: pb2``): the GP bandit's data, its choices, and a toy
landscape where it must beat random perturbation; real selection, breeding and seeded RNGs."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import pytest

from pbt.config.errors import ConfigError
from pbt.config.ranges import HPRange
from pbt.config.read.loader import manifest_from_dict
from pbt.evolution.breeding import breed, build_pb2
from pbt.evolution.mutation import Mutations
from pbt.evolution.pb2 import PB2Explore, observations
from pbt.evolution.selection import Selected, TruncationSelection
from pbt.protocol.records import MemberRecord, member_id

LR = {"lr": HPRange(min=1e-5, max=1e-1, log=True)}
PEAK = 3e-3


def gain(lr: float) -> float:
    """A generation's fitness gain: 1 at lr 3e-3, one less per decade away."""
    return 1.0 - abs(math.log10(lr) - math.log10(PEAK))


def member(generation: int, slot: int, lr: float, history: list[float]) -> MemberRecord:
    return MemberRecord(
        member_id=member_id(generation, slot),
        generation=generation,
        hyperparameters={"lr": lr, "beta": 0.1},
        fitness_history=history,
        status="done",
        checkpoint=f"ckpt/{member_id(generation, slot)}",
    )


def test_the_data_are_each_generations_change_of_fitness() -> None:
    first = [member(0, 0, 1e-3, [0.4]), member(0, 1, 1e-2, [0.2])]
    assert [(o.generation, o.change) for o in observations(first, 0)] == [(0, 0.4), (0, 0.2)]
    later = [
        *first,
        member(1, 0, 1e-3, [0.4, 0.7]),
        member(1, 1, 2e-3, [0.4, float("nan")]),  # diverged: no datum
        replace(member(1, 2, 5e-3, [0.4, 0.9]), status="failed"),
        replace(member(1, 3, 5e-3, [0.4, 0.9]), mutation="replaced by a clone of g001-m02 after 2"),
    ]
    data = observations(later, 1)
    assert [(o.generation, round(o.change, 6)) for o in data] == [(1, 0.3)]  # generation 0 out
    assert observations(later, 0) == observations(first, 0)  # later generations unseen


def test_copies_go_where_the_gains_were_and_spread_out() -> None:
    rng = random.Random(0)
    trained = [
        member(g, i, lr, [0.0, gain(lr)])
        for g in (1, 2)
        for i, lr in enumerate(
            math.exp(rng.uniform(math.log(1e-5), math.log(1e-1))) for _ in range(8)
        )
    ]
    parent = member(2, 0, 1e-5, [0.0, gain(1e-5)])  # the worst region: copies must leave it
    selected = [Selected(parent=parent, is_elite=False)] * 2
    selected += [Selected(parent=trained[-1], is_elite=False, survivor=True)]
    chosen = PB2Explore(LR, observations(trained, 2), 2).mutate_population(selected, rng)
    first, second, kept = chosen
    assert kept == (trained[-1].hyperparameters, "none (survivor)")
    for values, how in (first, second):
        assert abs(math.log10(values["lr"]) - math.log10(PEAK)) < 0.6, values
        assert how.startswith("pb2 (lr 1e-05 -> ") and "ucb" in how
        assert values["beta"] == 0.1  # only the searched hyperparameters change
    assert first[0]["lr"] != second[0]["lr"]  # the second saw the first as taken (GP-BUCB)


def test_whole_numbers_keep_the_batch_rule() -> None:
    ranges = {"group_size": HPRange(min=2, max=16, dtype="int")}
    data = observations([member(1, i, 1e-3, [0.0, 0.1 * i]) for i in range(4)], 1)
    data = [replace(o, hyperparameters={"group_size": 2 + 4 * i}) for i, o in enumerate(data)]
    parent = replace(member(1, 0, 1e-3, [0.0]), hyperparameters={"group_size": 4})
    rule = lambda values: [] if values["group_size"] % 4 == 0 else ["group_size % 4"]  # noqa: E731
    explore = PB2Explore(ranges, data, 1, rule)
    for seed in range(5):
        ((values, _),) = explore.mutate_population(
            [Selected(parent=parent, is_elite=False)], random.Random(seed)
        )
        assert isinstance(values["group_size"], int) and values["group_size"] % 4 == 0


def _toy_campaign(seed: int, strategy: str, generations: int = 8, size: int = 8) -> float:
    """Truncation selection on a noisy landscape (fitness gains :func:`gain` a generation, read
    with noise 0.3); returns the true fitness of the last generation's best member."""
    rng, noise, draw = random.Random(seed), random.Random(seed + 1000), random.Random(seed + 2000)
    members = [member(0, i, LR["lr"].resample(draw), []) for i in range(size)]
    selection, perturb = TruncationSelection(0.25, size), Mutations(LR, 0.2, 0.8)
    truth: dict[str, float] = {}
    every: list[MemberRecord] = []
    for g in range(generations):
        for m in members:
            truth[m.member_id] = truth.get(m.parent_id or "", 0.0) + gain(m.hyperparameters["lr"])
            m.fitness_history = [*m.fitness_history, truth[m.member_id] + noise.gauss(0, 0.3)]
            m.status, m.checkpoint = "done", f"ckpt/{m.member_id}"
        every += members
        explore = PB2Explore(LR, observations(every, g), g) if strategy == "pb2" else perturb
        members = breed(selection.select(members, rng), g + 1, explore, rng)
    return max(truth[m.member_id] for m in every if m.generation == generations - 1)


def test_pb2_beats_random_perturbation_on_a_noisy_landscape() -> None:
    """40 seeds, paired: PB2's explore ends above x0.8 / x1.2 perturbation (on these seeds
    by 0.55 of a best possible 8.0, ahead on 26 of 40; a broken bandit is level or behind)."""
    pb2 = [_toy_campaign(seed, "pb2") for seed in range(40)]
    perturbed = [_toy_campaign(seed, "perturb") for seed in range(40)]
    differences = [a - b for a, b in zip(pb2, perturbed, strict=True)]
    assert statistics.mean(differences) > 0.3
    assert sum(d > 0 for d in differences) >= 22


def test_pb2_needs_truncation_selection() -> None:
    raw = {"search": {"strategy": "pb2"}, "population": {"size": 4}}
    with pytest.raises(ConfigError) as err:
        manifest_from_dict(raw, ".")
    assert "population.selection is 'tournament'; set population.selection: truncation" in str(
        err.value
    )
    good = manifest_from_dict({**raw, "population": {"size": 4, "selection": "truncation"}}, ".")
    explore = build_pb2(good, [member(0, i, 1e-3 * (i + 1), [0.1 * i]) for i in range(4)], 0)
    assert [o.change for o in explore.data] == [0.0, 0.1, 0.2, 0.30000000000000004]
