"""Tournament selection and hyperparameter mutation: real code, seeded generators. What every
selection and every explore step keeps (reproducible from the seed, among others) is
tests/unit/evolution/test_contracts.py's."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest

from pbt.config.errors import ConfigError
from pbt.config.ranges import HPRange
from pbt.evolution.mutation import Mutations
from pbt.evolution.selection import Selected, TournamentSelection, TruncationSelection
from pbt.protocol.records import MemberRecord


def make_population(histories: list[list[float]]) -> list[MemberRecord]:
    """One member per fitness history, named m0, m1, ..."""
    return [
        MemberRecord(
            member_id=f"m{i}",
            generation=0,
            hyperparameters={"lr": 1e-3 * (i + 1), "beta": 0.1},
            fitness_history=list(history),
        )
        for i, history in enumerate(histories)
    ]


def ids(selected: list[Selected]) -> list[str]:
    return [s.parent.member_id for s in selected]


def always_mutate(**ranges: HPRange) -> Mutations:
    return Mutations(ranges, no_mutation=0.0, rl_hp=1.0)


# --- selection -----------------------------------------------------------------------------


def test_elitism_puts_the_best_first_unchanged() -> None:
    population = make_population([[1.0], [5.0], [3.0], [2.0]])
    before = dict(population[1].hyperparameters)
    selector = TournamentSelection(tournament_size=2, elitism=True, population_size=4)
    for seed in range(20):
        chosen = selector.select(population, random.Random(seed))
        assert len(chosen) == 4
        assert chosen[0].parent is population[1]
        assert chosen[0].is_elite
        assert not any(s.is_elite for s in chosen[1:])
    assert population[1].hyperparameters == before


def test_elite_ties_go_to_the_lowest_index() -> None:
    population = make_population([[1.0], [7.0], [7.0], [7.0]])
    selector = TournamentSelection(tournament_size=1, elitism=True, population_size=4)
    assert selector.select(population, random.Random(0))[0].parent.member_id == "m1"


def test_without_elitism_there_is_no_automatic_elite() -> None:
    population = make_population([[1.0], [5.0], [3.0], [2.0]])
    selector = TournamentSelection(tournament_size=1, elitism=False, population_size=4)
    first_slots = set()
    for seed in range(50):
        chosen = selector.select(population, random.Random(seed))
        assert len(chosen) == 4
        assert not any(s.is_elite for s in chosen)
        first_slots.add(chosen[0].parent.member_id)
    assert first_slots == {"m0", "m1", "m2", "m3"}


@pytest.mark.parametrize("elitism", [True, False])
def test_full_size_tournament_always_picks_the_best(elitism: bool) -> None:
    population = make_population([[1.0], [2.0], [9.0], [4.0], [0.5]])
    selector = TournamentSelection(tournament_size=5, elitism=elitism, population_size=5)
    for seed in range(20):
        assert ids(selector.select(population, random.Random(seed))) == ["m2"] * 5


def test_each_tournament_winner_is_the_best_of_its_draw() -> None:
    fitness = [3.0, 8.0, 1.0, 6.0, 2.0, 7.0]
    population = make_population([[f] for f in fitness])
    selector = TournamentSelection(tournament_size=3, elitism=False, population_size=6)
    for seed in range(30):
        chosen = selector.select(population, random.Random(seed))
        replay = random.Random(seed)
        for slot in chosen:
            drawn = replay.sample(range(6), 3)
            assert slot.parent is population[max(drawn, key=lambda i: fitness[i])]


def test_tournament_ties_go_to_the_first_drawn() -> None:
    population = make_population([[1.0]] * 6)
    selector = TournamentSelection(tournament_size=3, elitism=False, population_size=6)
    chosen = selector.select(population, random.Random(4))
    replay = random.Random(4)
    assert [s.parent for s in chosen] == [population[replay.sample(range(6), 3)[0]] for _ in chosen]


def test_fitness_window_averaging_changes_the_winner() -> None:
    # m0: latest 0 but mean of 3 is 4; m1: steady 2.
    population = make_population([[12.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    latest = TournamentSelection(tournament_size=2, elitism=True, population_size=2)
    averaged = TournamentSelection(
        tournament_size=2, elitism=True, population_size=2, fitness_window=3
    )
    assert ids(latest.select(population, random.Random(0))) == ["m1", "m1"]
    assert ids(averaged.select(population, random.Random(0))) == ["m0", "m0"]


def test_members_without_fitness_lose_to_any_with_fitness() -> None:
    population = make_population([[], [-100.0], [], [float("nan")]])
    selector = TournamentSelection(tournament_size=4, elitism=True, population_size=4)
    assert ids(selector.select(population, random.Random(0))) == ["m1"] * 4
    pair = TournamentSelection(tournament_size=2, elitism=False, population_size=2)
    assert ids(pair.select(population[:2], random.Random(0))) == ["m1", "m1"]


def test_tournament_of_two_favours_better_members() -> None:
    # With k=2 of 4, rank r of 4 (1 = worst) wins with probability (r - 1) / 6.
    population = make_population([[1.0], [2.0], [3.0], [4.0]])
    selector = TournamentSelection(tournament_size=2, elitism=False, population_size=4)
    rng = random.Random(7)
    counts = Counter(
        s.parent.member_id for _ in range(1500) for s in selector.select(population, rng)
    )
    draws = 6000
    assert counts["m0"] == 0  # the worst can never win a pair
    # Uniform choice would give the best ~1500 ± 34; tournament gives ~3000 ± 39.
    assert counts["m3"] - counts["m0"] > 2500
    for member, p in (("m1", 1 / 6), ("m2", 2 / 6), ("m3", 3 / 6)):
        sigma = math.sqrt(draws * p * (1 - p))
        assert abs(counts[member] - draws * p) < 5 * sigma


def test_too_small_population_is_reported() -> None:
    selector = TournamentSelection(tournament_size=3, elitism=False, population_size=4)
    with pytest.raises(ConfigError, match=r"tournament_size \(3\).*\(2\); lower tournament_size"):
        selector.select(make_population([[1.0], [2.0]]), random.Random(0))


# --- mutation ------------------------------------------------------------------------------


def test_grow_and_shrink_factors_are_exact_and_both_occur() -> None:
    mutations = always_mutate(lr=HPRange(min=1e-6, max=1.0, grow_factor=1.5, shrink_factor=0.5))
    seen = set()
    for seed in range(40):
        child, description = mutations.mutate({"lr": 0.01}, random.Random(seed))
        assert child["lr"] in (0.01 * 1.5, 0.01 * 0.5)
        seen.add(child["lr"])
        factor = "x1.5" if child["lr"] == 0.01 * 1.5 else "x0.5"
        assert description == f"lr {factor} (0.01 -> {child['lr']:.6g})"
    assert seen == {0.01 * 1.5, 0.01 * 0.5}


def test_description_reads_like_the_change() -> None:
    mutations = always_mutate(lr=HPRange(min=1e-6, max=1.0))
    descriptions = {mutations.mutate({"lr": 0.001}, random.Random(s))[1] for s in range(20)}
    assert descriptions == {"lr x1.2 (0.001 -> 0.0012)", "lr x0.8 (0.001 -> 0.0008)"}


def test_mutation_clips_at_the_bounds() -> None:
    mutations = always_mutate(beta=HPRange(min=0.1, max=0.5))
    for seed in range(30):
        high, _ = mutations.mutate({"beta": 0.5}, random.Random(seed))
        low, _ = mutations.mutate({"beta": 0.1}, random.Random(seed))
        assert high["beta"] in (0.5, 0.5 * 0.8)
        assert low["beta"] in (0.1, 0.1 * 1.2)
    assert HPRange(min=0.1, max=0.5).clip_cast(9.0) == 0.5
    assert HPRange(min=0.1, max=0.5).clip_cast(-9.0) == 0.1


def test_int_ranges_round_and_cast() -> None:
    mutations = always_mutate(group_size=HPRange(min=2, max=64, dtype="int"))
    values = {
        mutations.mutate({"group_size": 8}, random.Random(s))[0]["group_size"] for s in range(30)
    }
    assert values == {10, 6}  # 8 x 1.2 = 9.6 -> 10; 8 x 0.8 = 6.4 -> 6
    assert all(type(v) is int for v in values)
    assert HPRange(min=2, max=64, dtype="int").clip_cast(100.7) == 64


def test_mutation_leaves_the_input_untouched_and_changes_one_key() -> None:
    mutations = always_mutate(lr=HPRange(min=1e-6, max=1.0), beta=HPRange(min=0.01, max=1.0))
    parent = {"lr": 0.001, "beta": 0.1, "other": 3.0}
    touched = set()
    for seed in range(40):
        child, _ = mutations.mutate(parent, random.Random(seed))
        changed = {k for k in parent if child[k] != parent[k]}
        assert len(changed) == 1
        touched |= changed
    assert parent == {"lr": 0.001, "beta": 0.1, "other": 3.0}
    assert touched == {"lr", "beta"}


def test_resampling_stays_in_range() -> None:
    spec = HPRange(min=0.2, max=0.7)
    mutations = Mutations({"x": spec}, no_mutation=0.0, rl_hp=1.0, resample_probability=1.0)
    rng = random.Random(3)
    results = [mutations.mutate({"x": 0.5}, rng) for _ in range(500)]
    values = [child["x"] for child, _ in results]
    assert all(0.2 <= v <= 0.7 for v in values)
    assert min(values) < 0.25 and max(values) > 0.65
    assert all(d.startswith("x resampled (0.5 -> ") for _, d in results)


@pytest.mark.parametrize(("log", "low", "high"), [(True, 0.45, 0.55), (False, 0.0, 0.02)])
def test_log_resampling_is_log_uniform(log: bool, low: float, high: float) -> None:
    spec = HPRange(min=1e-6, max=1e-2, log=log)
    mutations = Mutations({"lr": spec}, no_mutation=0.0, rl_hp=1.0, resample_probability=1.0)
    rng = random.Random(11)
    values = [mutations.mutate({"lr": 1e-4}, rng)[0]["lr"] for _ in range(4000)]
    geometric_mean = math.sqrt(1e-6 * 1e-2)
    below = sum(v < geometric_mean for v in values) / len(values)
    assert low < below < high  # uniform would put only ~1% below
    assert all(1e-6 <= v <= 1e-2 for v in values)


def test_elite_is_left_alone_unless_mutate_elite() -> None:
    ranges = {"lr": HPRange(min=1e-6, max=1.0)}
    keep = Mutations(ranges, no_mutation=0.0, rl_hp=1.0)
    change = Mutations(ranges, no_mutation=0.0, rl_hp=1.0, mutate_elite=True)
    for seed in range(20):
        assert keep.mutate({"lr": 0.01}, random.Random(seed), is_elite=True) == (
            {"lr": 0.01},
            "none (elite)",
        )
        assert change.mutate({"lr": 0.01}, random.Random(seed), is_elite=True)[0]["lr"] != 0.01


def test_no_mutation_one_never_mutates() -> None:
    mutations = Mutations({}, no_mutation=1.0, rl_hp=0.0)
    rng = random.Random(0)
    for _ in range(200):
        assert mutations.mutate({"lr": 0.01}, rng) == ({"lr": 0.01}, "none")


def test_mutation_odds_follow_the_weights() -> None:
    mutations = Mutations({"lr": HPRange(min=1e-6, max=1.0)}, no_mutation=0.4, rl_hp=0.6)
    rng = random.Random(5)
    mutated = sum(mutations.mutate({"lr": 0.01}, rng)[1] != "none" for _ in range(4000))
    assert abs(mutated - 2400) < 5 * math.sqrt(4000 * 0.6 * 0.4)


def test_mutate_population_respects_elite_flags() -> None:
    population = make_population([[3.0], [1.0], [2.0]])
    selected = TournamentSelection(tournament_size=2, elitism=True, population_size=3).select(
        population, random.Random(0)
    )
    mutations = always_mutate(lr=HPRange(min=1e-6, max=1.0))
    children = mutations.mutate_population(selected, random.Random(0))
    assert len(children) == 3
    assert children[0] == (population[0].hyperparameters, "none (elite)")
    for slot, (child, description) in zip(selected[1:], children[1:], strict=True):
        assert description.startswith("lr x")
        assert child["lr"] != slot.parent.hyperparameters["lr"]
        assert child["beta"] == slot.parent.hyperparameters["beta"]


def test_ranges_matching_no_hyperparameter_are_reported() -> None:
    mutations = always_mutate(lr=HPRange(min=1e-6, max=1.0))
    with pytest.raises(ConfigError, match=r"mutation.ranges \(\['lr'\]\).*rename the ranges"):
        mutations.mutate({"learning_rate": 0.01}, random.Random(0))


# --- validation ----------------------------------------------------------------------------

SELECTION_ERRORS = [
    (
        {"tournament_size": 8, "population_size": 4},
        "population.tournament_size",
        "(8)",
        "lower tournament_size",
    ),
    (
        {"tournament_size": 0},
        "population.tournament_size",
        "(0)",
        "set tournament_size to 1 or more",
    ),
    (
        {"population_size": 0, "tournament_size": 1},
        "population.population_size",
        "(0)",
        "set population_size to 1 or more",
    ),
    ({"fitness_window": 0}, "population.fitness_window", "(0)", "set fitness_window to 1 or more"),
    (
        {"fitness_window": 2.5},
        "population.fitness_window",
        "(2.5)",
        "set fitness_window to 1 or more",
    ),
    ({"elitism": "yes"}, "population.elitism", "('yes')", "set a boolean"),
]


@pytest.mark.parametrize(("overrides", "key", "value", "fix"), SELECTION_ERRORS)
def test_selection_errors_name_key_value_and_fix(
    overrides: dict[str, object], key: str, value: str, fix: str
) -> None:
    kwargs: dict = {"tournament_size": 2, "elitism": True, "population_size": 4, **overrides}
    with pytest.raises(ConfigError) as raised:
        TournamentSelection(**kwargs)
    [problem] = raised.value.problems
    assert problem.startswith(f"{key} {value} must")
    assert fix in problem


def test_selection_tournament_message_is_exact() -> None:
    with pytest.raises(ConfigError) as raised:
        TournamentSelection(tournament_size=8, elitism=True, population_size=4)
    assert raised.value.problems == [
        "population.tournament_size (8) must be <= population_size (4); lower tournament_size"
    ]


MUTATION_ERRORS = [
    ({"no_mutation": 1.5}, "mutation.no_mutation", "(1.5)", "set no_mutation in [0, 1]"),
    ({"rl_hp": -0.1}, "mutation.rl_hp", "(-0.1)", "set rl_hp in [0, 1]"),
    ({"resample_probability": 2}, "mutation.resample_probability", "(2)", "in [0, 1]"),
    ({"no_mutation": 0.0, "rl_hp": 0.0}, "mutation.no_mutation", "(0.0)", "raise one of them"),
    ({"ranges": {}}, "mutation.ranges", "({})", "add a range or set rl_hp: 0"),
    (
        {"ranges": {"lr": HPRange(min=1.0, max=0.1)}},
        "mutation.ranges.lr.min",
        "(1.0)",
        "lower min or raise max",
    ),
    (
        {"ranges": {"lr": HPRange(min=0.0, max=1.0, log=True)}},
        "mutation.ranges.lr.min",
        "(0.0)",
        "set log: false",
    ),
    (
        {"ranges": {"lr": HPRange(min=0.1, max=1.0, shrink_factor=1.1)}},
        "mutation.ranges.lr.shrink_factor",
        "(1.1)",
        "use e.g. 0.8",
    ),
    (
        {"ranges": {"lr": HPRange(min=0.1, max=1.0, grow_factor=0.9)}},
        "mutation.ranges.lr.grow_factor",
        "(0.9)",
        "use e.g. 1.2",
    ),
    (
        {"ranges": {"lr": HPRange(min=0.1, max=1.0, dtype="str")}},
        "mutation.ranges.lr.dtype",
        "('str')",
        "'float' or 'int'",
    ),  # type: ignore[arg-type]
    (
        {"ranges": {"lr": HPRange(min=0.1, max=math.inf)}},
        "mutation.ranges.lr",
        "(min=0.1, max=inf",
        "finite numbers",
    ),
]


@pytest.mark.parametrize(("overrides", "key", "value", "fix"), MUTATION_ERRORS)
def test_mutation_errors_name_key_value_and_fix(
    overrides: dict[str, object], key: str, value: str, fix: str
) -> None:
    kwargs: dict = {"ranges": {"lr": HPRange(min=1e-6, max=1.0)}, **overrides}
    with pytest.raises(ConfigError) as raised:
        Mutations(**kwargs)
    [problem] = raised.value.problems
    assert problem.startswith(f"{key} {value}")
    assert fix in problem


def test_all_mutation_problems_are_reported_together() -> None:
    with pytest.raises(ConfigError) as raised:
        Mutations(
            {"lr": HPRange(min=1.0, max=0.1), "beta": HPRange(min=0.1, max=1.0, grow_factor=1.0)},
            no_mutation=3.0,
        )
    keys = [p.split(" ")[0] for p in raised.value.problems]
    assert keys == [
        "mutation.no_mutation",
        "mutation.ranges.beta.grow_factor",
        "mutation.ranges.lr.min",
    ]


def test_controller_modules_do_not_import_torch() -> None:
    code = "import sys, pbt.evolution.selection, pbt.evolution.mutation; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- truncation selection ------------------------------------------------------------------


def test_truncation_replaces_the_bottom_quarter_with_top_quarter_copies() -> None:
    pop = make_population([[f] for f in (0.5, 0.9, 0.1, 0.7, 0.3, 0.8, 0.2, 0.6)])
    selected = TruncationSelection(0.25, 8).select(pop, random.Random(0))
    # bottom two: m2 (0.1), m6 (0.2); top two: m1 (0.9), m5 (0.8)
    for slot, choice in enumerate(selected):
        if slot in (2, 6):
            assert choice.parent.member_id in ("m1", "m5") and not choice.survivor
        else:
            assert choice.parent.member_id == f"m{slot}" and choice.survivor
    assert not any(s.is_elite for s in selected)


def test_truncation_survivors_are_not_mutated_and_copies_are() -> None:
    pop = make_population([[f] for f in (0.5, 0.9, 0.1, 0.7)])
    selected = TruncationSelection(0.25, 4).select(pop, random.Random(1))
    mutated = always_mutate(lr=HPRange(min=1e-5, max=1.0)).mutate_population(
        selected, random.Random(2)
    )
    assert [how for _, how in mutated].count("none (survivor)") == 3
    assert mutated[2][1].startswith("lr ")  # m2, the worst, copied m1 and perturbed its lr


def test_exploit_gap_keeps_a_bottom_member_that_is_close_enough() -> None:
    pop = make_population([[0.50], [0.52], [0.30], [0.51]])
    near = TruncationSelection(0.25, 4, min_gap=0.05).select(pop, random.Random(0))
    # bottom m2 (0.30) is 0.22 below m1: replaced; raise the gap past it and m2 survives
    assert near[2].parent.member_id == "m1"
    far = TruncationSelection(0.25, 4, min_gap=0.3).select(pop, random.Random(0))
    assert far[2].parent.member_id == "m2" and far[2].survivor


def test_truncation_replaces_a_collapsed_or_unevaluated_member_whatever_the_gap() -> None:
    pop = make_population([[0.5], [0.6], [], [0.4]])
    selected = TruncationSelection(0.25, 4, min_gap=10.0).select(pop, random.Random(0))
    assert selected[2].parent.member_id == "m1"


@pytest.mark.parametrize(
    ("fraction", "gap", "needle"),
    [
        (0.0, 0.0, "population.truncation_fraction (0.0) must be in (0, 0.5]"),
        (0.75, 0.0, "population.truncation_fraction (0.75) must be in (0, 0.5]"),
        (0.25, -1.0, "population.exploit_gap (-1.0) must be a number >= 0"),
    ],
)
def test_truncation_errors_name_key_value_and_fix(fraction: float, gap: float, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        TruncationSelection(fraction, 4, min_gap=gap)
    assert needle in str(err.value)


def test_truncation_from_the_manifest() -> None:
    from pbt.config.read.loader import manifest_from_dict
    from pbt.evolution.breeding import build_selection

    raw = {"population": {"size": 8, "selection": "truncation", "exploit_gap": 0.02}}
    selection = build_selection(manifest_from_dict(raw, "."))
    assert isinstance(selection, TruncationSelection)
    assert (selection.fraction, selection.min_gap) == (0.25, 0.02)
    bad = {"population": {"size": 8, "selection": "truncation", "truncation_fraction": 0.9}}
    with pytest.raises(ConfigError, match=r"truncation_fraction \(0.9\)"):
        manifest_from_dict(bad, ".")


def test_ready_generations_keeps_every_lineage_until_the_burn_in_ends() -> None:
    def population(generation: int, histories: list[list[float]]) -> list[MemberRecord]:
        return [replace(m, generation=generation) for m in make_population(histories)]

    selection = TruncationSelection(0.25, 4, ready_generations=3)
    early = selection.select(population(1, [[0.5], [0.9], [0.1], [0.7]]), random.Random(0))
    assert all(s.survivor for s in early)  # two generations trained: nobody replaced
    collapsed = selection.select(population(1, [[0.5], [0.9], [], [0.7]]), random.Random(0))
    assert collapsed[2].parent.member_id == "m1"  # an unevaluated member still is
    ready = selection.select(population(2, [[0.5], [0.9], [0.1], [0.7]]), random.Random(0))
    assert ready[2].parent.member_id == "m1" and not ready[2].survivor
    with pytest.raises(ConfigError, match=r"population.ready_generations \(-1\)"):
        TruncationSelection(0.25, 4, ready_generations=-1)
