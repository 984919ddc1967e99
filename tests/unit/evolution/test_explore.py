"""The explore options (perturb every hyperparameter, resample, survivors explored) and
multi-frequency selection: real code and seeded generators, then fake-member campaigns that
are killed and resumed."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from support import EXPLORE_CAMPAIGN, FAKE, killed_and_resumed, members, write_manifest

from pbt.config.errors import ConfigError
from pbt.config.ranges import HPRange
from pbt.controller.campaign import Campaign
from pbt.evolution.breeding import breed, selection_events
from pbt.evolution.multi_frequency import MultiFrequencySelection
from pbt.evolution.mutation import Mutations
from pbt.evolution.selection import Selected, TruncationSelection
from pbt.protocol.records import MemberRecord

RANGES = {
    "lr": HPRange(min=1e-6, max=1e-2, log=True, grow_factor=1.25),
    "beta": HPRange(min=0.0, max=0.5, grow_factor=1.25),
    "temperature": HPRange(min=0.3, max=1.5, grow_factor=1.25),
}
VALUES = {"lr": 1e-4, "beta": 0.1, "temperature": 1.0}


def member(slot: int, fitness: float, generation: int = 0, **values: float) -> MemberRecord:
    return MemberRecord(
        member_id=f"g{generation:03d}-m{slot:02d}",
        generation=generation,
        hyperparameters={**VALUES, **values},
        fitness_history=[fitness],
    )


# --- perturb: all, resample_probability, perturb_survivors ---------------------------------


def test_perturb_all_moves_every_searched_hyperparameter_by_the_factors() -> None:
    explore = Mutations(RANGES, no_mutation=0.0, rl_hp=1.0, perturb="all")
    for seed in range(30):
        child, how = explore.mutate(VALUES, random.Random(seed))
        for name, old in VALUES.items():
            assert child[name] / old in (pytest.approx(0.8), pytest.approx(1.25))
        assert how.count(";") == 2 and all(n in how for n in VALUES)
    one = Mutations(RANGES, no_mutation=0.0, rl_hp=1.0)  # AgileRL's: one at a time
    child, _ = one.mutate(VALUES, random.Random(0))
    assert sum(child[n] != VALUES[n] for n in VALUES) == 1


def test_resample_probability_draws_each_perturbed_value_from_its_range() -> None:
    explore = Mutations(
        RANGES, no_mutation=0.0, rl_hp=1.0, perturb="all", resample_probability=0.25
    )
    parts = [
        part
        for seed in range(400)
        for part in explore.mutate(VALUES, random.Random(seed))[1].split("; ")
    ]
    share = sum("resampled" in p for p in parts) / len(parts)
    assert 0.2 < share < 0.3  # per hyperparameter, not per child
    child, _ = Mutations(
        RANGES, no_mutation=0.0, rl_hp=1.0, perturb="all", resample_probability=1.0
    ).mutate(VALUES, random.Random(3))
    assert all(RANGES[n].min <= child[n] <= RANGES[n].max for n in RANGES)
    assert all(child[n] / VALUES[n] not in (0.8, 1.25) for n in RANGES)


def test_survivors_are_explored_only_when_asked() -> None:
    population = [member(i, f) for i, f in enumerate([4.0, 3.0, 2.0, 1.0])]
    selected = TruncationSelection(0.25, 4).select(population, random.Random(0))
    assert [s.survivor for s in selected] == [True, True, True, False]
    plain = Mutations(RANGES, no_mutation=0.0, rl_hp=1.0, perturb="all")
    assert [h for _, h in plain.mutate_population(selected, random.Random(1))][:3] == [
        "none (survivor)"
    ] * 3
    both = Mutations(RANGES, no_mutation=0.0, rl_hp=1.0, perturb="all", perturb_survivors=True)
    done = both.mutate_population(selected, random.Random(1))
    assert all(h.endswith(" (survivor)") and h.count(";") == 2 for _, h in done[:3])
    assert all(v != VALUES for v, _ in done)
    children = breed(selected, 1, both, random.Random(1))
    # a perturbed survivor continues its own lineage, with the new values
    assert [c.parent_id for c in children[:3]] == [m.member_id for m in population[:3]]
    assert [e["kind"] for e in selection_events(selected, children)] == ["mutate"] * 4


def test_explore_draws_are_reproducible() -> None:
    explore = Mutations(
        RANGES, no_mutation=0.0, rl_hp=1.0, perturb="all", resample_probability=0.25
    )
    first = [explore.mutate(VALUES, random.Random(7)) for _ in range(3)]
    assert first[0] == first[1] == first[2]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"perturb": "some"}, "mutation.perturb ('some') must be 'one' or 'all'"),
        ({"perturb_survivors": "yes"}, "mutation.perturb_survivors ('yes') must be true"),
        ({"resample_probability": 1.5}, "mutation.resample_probability (1.5) must be"),
    ],
)
def test_bad_explore_values_are_one_line_each(kwargs, words) -> None:
    with pytest.raises(ConfigError) as caught:
        Mutations(RANGES, **kwargs)
    assert len(caught.value.problems) == 1 and caught.value.problems[0].startswith(words)


# --- multi-frequency selection -------------------------------------------------------------


def test_groups_evolve_at_their_frequencies() -> None:
    mf = MultiFrequencySelection(8, 2, [1, 3])
    assert [mf.evolving(g) for g in range(6)] == [[0], [0], [0, 1], [0], [0], [0, 1]]
    assert [mf.group_of(s) for s in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert mf.brackets == [1, 0, 1, 2]  # a quarter winners, a quarter open, the rest losers


def test_losers_copy_winners_and_open_slots_take_fitter_outsiders() -> None:
    # group 0 (slots 0-3, every generation): fitness 1, 2, 3, 4; group 1 (every 3rd): 10..13
    population = [member(i, float(i + 1)) for i in range(4)]
    population += [member(4 + i, 10.0 + i, lr=1e-3) for i in range(4)]
    mf = MultiFrequencySelection(8, 2, [1, 3])
    chosen = mf.select(population, random.Random(0))  # after generation 0: group 0 only
    assert all(c.survivor for c in chosen[4:])
    # group 1 does not evolve: its members keep their values even when survivors are explored
    explore = Mutations(RANGES, no_mutation=0.0, rl_hp=1.0, perturb="all", perturb_survivors=True)
    done = explore.mutate_population(chosen, random.Random(0))
    assert [h for _, h in done[4:]] == ["none (survivor)"] * 4
    assert done[3][1].endswith(" (survivor)") and done[3][0] != population[3].hyperparameters
    # group 0 ranked 3, 2, 1, 0: winner slot 3, open slot 2, losers slots 1 and 0
    assert chosen[3].survivor and chosen[0].parent is chosen[1].parent is population[3]
    assert not chosen[0].survivor and chosen[0].hyperparameters is None  # a copy, explored
    # open slot 2 takes group 1's best, whole: group 1 evolves less often than group 0
    assert chosen[2].parent is population[7] and chosen[2].hyperparameters["lr"] == 1e-3
    assert chosen[2].how == "none (migrated whole from g000-m07)"


def test_a_migrant_from_a_faster_group_takes_the_destinations_best_values() -> None:
    population = [member(i, 10.0 + i, generation=2, lr=1e-3) for i in range(4)]  # fast, fitter
    population += [member(4 + i, float(i + 1), generation=2) for i in range(4)]
    mf = MultiFrequencySelection(8, 2, [1, 3])
    chosen = mf.select(population, random.Random(0))  # after generation 2: both groups
    # group 1 ranked 7, 6, 5, 4: open slot 6 takes the fast group's best weights with the
    # values of its own best, slot 7
    assert chosen[6].parent is population[3]
    assert chosen[6].hyperparameters == population[7].hyperparameters
    assert chosen[6].how == "migrated from g002-m03 (weights; values of g002-m07)"
    # the fast group's open slot (2) meets no fitter outsider: it keeps its member
    assert chosen[2].survivor and chosen[2].parent is population[2]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"population_size": 8, "subpopulations": 1}, "population.subpopulations (1) must be"),
        ({"population_size": 7, "subpopulations": 2}, "population.size (7) must be a multiple"),
        ({"population_size": 8, "frequencies": [3, 1]}, "population.frequencies ([3, 1]) must"),
        ({"population_size": 8, "brackets": [1, 1, 1, 0]}, "population.brackets ([1, 1, 1, 0])"),
    ],
)
def test_bad_multi_frequency_values_are_one_line_each(kwargs, words) -> None:
    with pytest.raises(ConfigError) as caught:
        MultiFrequencySelection(**kwargs)
    assert len(caught.value.problems) == 1 and caught.value.problems[0].startswith(words)


# --- campaigns on the fake member ----------------------------------------------------------

MANIFEST = EXPLORE_CAMPAIGN
_members = members


def _decisions(directory: Path) -> list[tuple]:
    return [(m.member_id, m.parent_id, m.hyperparameters, m.mutation) for m in _members(directory)]


def _straight_and_resumed(tmp_path: Path, **changes) -> tuple[Path, Path]:
    path = write_manifest(tmp_path / "straight.yaml", MANIFEST, **changes)
    straight = Campaign.start(path, tmp_path / "straight", member_command=FAKE)
    straight.say = lambda *_: None
    straight.run()
    straight.close()
    killed = write_manifest(tmp_path / "killed.yaml", MANIFEST, **changes)
    return tmp_path / "straight", killed_and_resumed(killed, tmp_path / "killed")


@pytest.mark.integration
def test_canonical_explore_campaign_and_its_resume(tmp_path) -> None:
    straight, resumed = _straight_and_resumed(tmp_path, mutation={"perturb_survivors": True})
    later = [m for m in _members(straight) if m.generation > 0]
    for m in later:  # every child is explored, copies and survivors, each value at once
        parts = m.mutation.split("; ")
        assert len(parts) == 2 and parts[0].startswith("lr ") and "temperature " in parts[1]
    assert sum(m.mutation.endswith("(survivor)") for m in later) == 4 * 4  # 4 of 6 survive
    assert any("resampled" in m.mutation for m in later)
    assert _decisions(resumed) == _decisions(straight)


@pytest.mark.integration
def test_multi_frequency_campaign_and_its_resume(tmp_path) -> None:
    changes = {"population": {"selection": "multi_frequency", "frequencies": [1, 2]}}
    straight, resumed = _straight_and_resumed(tmp_path, **changes)
    members = _members(straight)
    for m in members:
        if m.generation == 0:
            continue
        slot = int(m.member_id[-2:])
        changed = not (m.mutation or "").startswith("none (survivor)")
        if slot >= 3 and m.generation % 2 == 1:  # the slow group evolves after 1 and 3 only
            assert not changed, m
    slow = [m for m in members if int(m.member_id[-2:]) >= 3 and m.generation in (2, 4)]
    assert any(not m.mutation.startswith("none (survivor)") for m in slow)
    fast = [m for m in members if int(m.member_id[-2:]) < 3 and m.generation > 0]
    assert all(math.isfinite(m.fitness_history[-1]) for m in fast)
    assert sum(" x" in (m.mutation or "") or "resampled" in m.mutation for m in fast) >= 4
    assert _decisions(resumed) == _decisions(straight)


def test_selected_defaults_keep_old_behaviour() -> None:
    s = Selected(parent=member(0, 1.0), is_elite=False)
    assert s.hyperparameters is None and s.how is None and not s.survivor
