"""Optuna as initial-population sampler and as the HPO baseline, on real SQLite studies."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import optuna
import pytest

from pbt.config.errors import ConfigError
from pbt.config.ranges import HPRange
from pbt.evolution.search import (
    OptunaSearch,
    record_initial_fitness,
    sample_initial,
    study_storage,
)

LR = HPRange(min=1e-6, max=1e-2, log=True)
RANGES = {
    "lr": LR,
    "beta": HPRange(min=0.0, max=0.5),
    "group_size": HPRange(min=2, max=64, log=True, dtype="int"),
}
BASE = {"lr": 1e-4, "beta": 0.04, "group_size": 8, "temperature": 1.0}
States = optuna.trial.TrialState


def _ids(n: int) -> list[str]:
    return [f"g000-m{i:02d}" for i in range(n)]


def _states(study: optuna.Study) -> dict[str, str]:
    return {t.user_attrs["member_id"]: t.state.name for t in study.get_trials()}


# --- initial population ----------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["random", "qmc", "tpe"])
def test_initial_values_in_bounds_log_spread_and_typed(sampler: str) -> None:
    members = sample_initial(
        RANGES, BASE, 16, sampler=sampler, seed=0, storage=None, study_name="init"
    )
    assert len(members) == 16
    for m in members:
        assert m["temperature"] == 1.0  # not in ranges: untouched
        for name, r in RANGES.items():
            assert r.min <= m[name] <= r.max
        assert isinstance(m["group_size"], int)
        assert isinstance(m["lr"], float)
    logs = [math.log10(m["lr"]) for m in members]
    # Log-uniform over 4 decades: std ~1.15; linear-uniform would pile up in [-3, -2] (~0.1).
    assert max(logs) - min(logs) >= 3
    assert statistics.pstdev(logs) > 0.7
    assert len({math.floor(x) for x in logs}) >= 3  # at least 3 decades hold a member


@pytest.mark.parametrize("sampler", ["random", "qmc", "tpe"])
def test_initial_same_seed_same_values_other_seed_other_values(sampler: str) -> None:
    def draw(seed: int) -> list[dict[str, float]]:
        return sample_initial(
            RANGES, BASE, 8, sampler=sampler, seed=seed, storage=None, study_name="s"
        )

    assert draw(3) == draw(3)
    assert [m["lr"] for m in draw(3)] != [m["lr"] for m in draw(4)]


def test_qmc_is_better_spread_than_random() -> None:
    from scipy.stats import qmc

    ranges = {"lr": LR, "beta": RANGES["beta"]}

    def discrepancy(sampler: str, seed: int) -> float:
        members = sample_initial(
            ranges, {}, 16, sampler=sampler, seed=seed, storage=None, study_name="q"
        )
        unit = [[(math.log10(m["lr"]) + 6) / 4, m["beta"] / 0.5] for m in members]
        return float(qmc.discrepancy(unit))

    seeds = range(4)
    random_mean = statistics.mean(discrepancy("random", s) for s in seeds)
    qmc_mean = statistics.mean(discrepancy("qmc", s) for s in seeds)
    assert qmc_mean < 0.5 * random_mean


def test_initial_is_idempotent_on_resume_and_fitness_completes_trials(tmp_path: Path) -> None:
    storage = study_storage(tmp_path)
    kwargs = dict(sampler="qmc", seed=1, storage=storage, study_name="camp")
    first = sample_initial(RANGES, BASE, 6, **kwargs)
    study = optuna.load_study(study_name="camp", storage=storage)
    assert _states(study) == dict.fromkeys(_ids(6), "RUNNING")

    assert sample_initial(RANGES, BASE, 6, **kwargs) == first
    assert len(study.get_trials()) == 6

    fitness = {member_id: float(i) for i, member_id in enumerate(_ids(6))}
    record_initial_fitness(storage, "camp", fitness)
    record_initial_fitness(storage, "camp", {"g000-m00": 99.0})  # already told: ignored
    trials = {t.user_attrs["member_id"]: t for t in study.get_trials()}
    assert {m: (t.state, t.value) for m, t in trials.items()} == {
        m: (States.COMPLETE, v) for m, v in fitness.items()
    }
    assert sample_initial(RANGES, BASE, 6, **kwargs) == first  # still, after completion


def test_interrupted_initial_sampling_resumes_with_the_rest(tmp_path: Path) -> None:
    storage = study_storage(tmp_path)
    kwargs = dict(sampler="random", seed=2, storage=storage, study_name="camp")
    three = sample_initial(RANGES, BASE, 3, **kwargs)
    five = sample_initial(RANGES, BASE, 5, **kwargs)
    assert five[:3] == three
    assert len({m["lr"] for m in five}) == 5  # the resumed draws do not replay the first ones


def test_unknown_sampler_and_empty_ranges() -> None:
    with pytest.raises(ConfigError, match="random, qmc, tpe"):
        sample_initial(RANGES, BASE, 2, sampler="sobol", seed=0, storage=None, study_name="s")
    members = sample_initial({}, BASE, 3, sampler="qmc", seed=0, storage=None, study_name="s")
    assert members == [BASE] * 3


def test_tpe_warm_start_concentrates_on_the_good_region(tmp_path: Path) -> None:
    ranges = {"lr": HPRange(min=1e-6, max=1e-1, log=True)}
    earlier = tmp_path / "A"
    earlier.mkdir()
    history = sample_initial(
        ranges, {}, 20, sampler="random", seed=100, storage=study_storage(earlier), study_name="a"
    )
    fitness = {  # peak at lr = 1e-3, falling off per decade
        member_id: -((math.log10(m["lr"]) + 3) ** 2)
        for member_id, m in zip(_ids(20), history, strict=True)
    }
    record_initial_fitness(study_storage(earlier), "a", fitness)

    def distance(warm_start: str | None, seed: int) -> float:
        members = sample_initial(
            ranges, {}, 8, sampler="tpe", seed=seed, storage=None, study_name="b",
            warm_start=warm_start,
        )  # fmt: skip
        return statistics.median(abs(math.log10(m["lr"]) + 3) for m in members)

    seeds = range(4)
    warm = statistics.mean(distance(str(earlier), s) for s in seeds)
    cold = statistics.mean(distance(None, s) for s in seeds)
    assert warm < 0.8 * cold

    later = tmp_path / "B"
    later.mkdir()
    sample_initial(
        ranges, {}, 4, sampler="tpe", seed=0, storage=study_storage(later), study_name="b",
        warm_start=str(earlier),
    )  # fmt: skip
    study = optuna.load_study(study_name="b", storage=study_storage(later))
    copied = [t for t in study.get_trials() if "warm_start" in t.user_attrs]
    assert len(copied) == 20 and all(t.state == States.COMPLETE for t in copied)
    assert [t.user_attrs.get("member_id") for t in study.get_trials()][20:] == _ids(4)


def test_bad_warm_start_names_the_path(tmp_path: Path) -> None:
    kwargs = dict(sampler="tpe", seed=0, storage=None, study_name="b")
    missing = tmp_path / "no-such-campaign"
    with pytest.raises(ConfigError, match="no-such-campaign"):
        sample_initial(RANGES, BASE, 2, warm_start=str(missing), **kwargs)
    optuna.storages.RDBStorage(study_storage(tmp_path))  # a store with no study in it
    with pytest.raises(ConfigError, match="holds no Optuna study"):
        sample_initial(RANGES, BASE, 2, warm_start=str(tmp_path), **kwargs)
    with pytest.raises(ConfigError, match="needs sampler 'tpe'"):
        sample_initial(RANGES, BASE, 2, **{**kwargs, "sampler": "random"}, warm_start="x")


# --- OptunaSearch ----------------------------------------------------------------------------


def _search(tmp_path: Path, **kwargs) -> OptunaSearch:
    return OptunaSearch(RANGES, BASE, storage=study_storage(tmp_path), study_name="hpo", **kwargs)


def test_trials_are_made_once_per_member_and_survive_a_resume(tmp_path: Path) -> None:
    search = _search(tmp_path, sampler="random")
    number, values = search.trial_for("a")
    assert search.trial_for("a") == (number, values)
    assert search.trial_for("b")[0] != number
    assert set(values) == set(BASE) and values["temperature"] == 1.0

    resumed = _search(tmp_path, sampler="random")
    assert resumed.trial_for("a") == (number, values)
    assert len(resumed.study.get_trials()) == 2


def test_an_interrupted_ask_is_finished_not_duplicated(tmp_path: Path) -> None:
    search = _search(tmp_path, sampler="tpe")
    search.study.enqueue_trial({}, user_attrs={"member_id": "x"})  # crashed between the steps
    search.trial_for("y")
    assert _states(search.study) == {"x": "RUNNING", "y": "RUNNING"}
    number, values = search.trial_for("x")
    assert number == 0 and RANGES["lr"].min <= values["lr"] <= RANGES["lr"].max


def test_median_pruner_prunes_a_clearly_worse_trial_after_startup(tmp_path: Path) -> None:
    search = _search(tmp_path, pruner="median", max_generations=3, startup_trials=3)

    def train(member_id: str, curve: list[float]) -> list[bool]:
        search.trial_for(member_id)
        return [search.report(member_id, f, g) for g, f in enumerate(curve)]

    assert train("good0", [1.0, 1.1, 1.2]) == [False, False, True]
    assert train("good1", [1.0, 1.2, 1.4]) == [False, False, True]
    assert train("early-bad", [0.1]) == [False]  # 2 complete trials: still in startup
    assert train("good2", [1.1, 1.3, 1.5]) == [False, False, True]
    assert train("bad", [0.1]) == [True]
    search.finish("early-bad", 0.2)
    assert _states(search.study) == {
        "good0": "COMPLETE",
        "good1": "COMPLETE",
        "early-bad": "COMPLETE",
        "good2": "COMPLETE",
        "bad": "PRUNED",
    }
    assert search.best() == (search.trial_for("good2")[1], 1.5)


def test_hyperband_prunes_the_poor_trials(tmp_path: Path) -> None:
    search = _search(tmp_path, pruner="hyperband", max_generations=4)
    stopped_at = {}
    for i in range(12):
        member_id = f"m{i:02d}"
        search.trial_for(member_id)
        fitness = 1.0 if i % 2 == 0 else 0.1  # alternate good and poor members
        for generation in range(4):
            if search.report(member_id, fitness + 0.01 * generation, generation):
                stopped_at[member_id] = generation
                break
    states = _states(search.study)
    poor = {f"m{i:02d}" for i in range(1, 12, 2)}
    assert {m for m, s in states.items() if s == "PRUNED"} <= poor
    assert sum(states[m] == "PRUNED" for m in poor) >= 3
    assert all(s in ("COMPLETE", "PRUNED") for s in states.values())
    assert all(stopped_at[m] == 3 for m, s in states.items() if s == "COMPLETE")


def test_successive_halving_prunes_in_lockstep_without_complete_trials(tmp_path: Path) -> None:
    """Eight trials reported generation by generation in slot order, as the campaign reports
    them: the pruner decides at the second report already, with no trial complete. It is
    asynchronous successive halving: a trial is kept when it is in the top third of those that
    reached the rung before it, so here (best first) the first is kept and later ones pruned."""
    search = _search(tmp_path, pruner="successive_halving", max_generations=8)
    members = [f"m{i}" for i in range(8)]
    for m in members:
        search.trial_for(m)
    stopped = {}
    for generation in range(2):
        for i, m in enumerate(members):
            if m not in stopped and search.report(m, 1 - 0.1 * i + 0.01 * generation, generation):
                stopped[m] = generation
    states = _states(search.study)
    assert not any(s == "COMPLETE" for s in states.values())
    assert set(stopped.values()) == {1}  # none after one report, some after two
    assert states["m0"] == "RUNNING"  # the best is never pruned
    assert sum(s == "PRUNED" for s in states.values()) >= 3


def test_tpe_guides_new_trials_once_startup_trials_are_pruned(tmp_path: Path) -> None:
    """Pruned trials count toward TPE's startup: while fewer than ``startup_trials`` have
    finished, TPE draws what random search of the same seed draws; after four are pruned its
    next trial is its own."""
    (tmp_path / "tpe").mkdir()
    (tmp_path / "rnd").mkdir()
    tpe = _search(tmp_path / "tpe", sampler="tpe", pruner="successive_halving", startup_trials=4)
    rnd = _search(tmp_path / "rnd", sampler="random", pruner="none", startup_trials=4)
    for i in range(4):
        assert tpe.trial_for(f"m{i}") == rnd.trial_for(f"m{i}")
        for search in (tpe, rnd):
            search.report(f"m{i}", float(i), 0)
            search.finish(f"m{i}", None, "pruned")
    assert tpe.trial_for("m4") != rnd.trial_for("m4")


def test_max_generations_completes_and_report_is_idempotent(tmp_path: Path) -> None:
    search = _search(tmp_path, pruner="none", max_generations=2)
    search.trial_for("a")
    assert search.report("a", 0.5, 0) is False
    assert search.report("a", 0.9, 0) is False  # the same step again: same answer, first value
    assert _search(tmp_path, pruner="none", max_generations=2).report("a", 0.5, 0) is False
    assert search.report("a", 0.7, 1) is True
    assert search.report("a", 0.7, 1) is True
    (trial,) = search.study.get_trials()
    assert trial.state == States.COMPLETE and trial.value == 0.7
    assert trial.intermediate_values == {0: 0.5, 1: 0.7}


def test_nan_fails_the_trial_and_finish_is_idempotent(tmp_path: Path) -> None:
    search = _search(tmp_path, pruner="none")
    assert search.best() is None
    search.trial_for("nan")
    assert search.report("nan", float("nan"), 0) is True
    assert search.report("nan", 1.0, 1) is True  # finished: stays failed
    search.trial_for("a")
    search.finish("a", 2.0)
    search.finish("a", 5.0)
    search.trial_for("p")
    search.report("p", 9.0, 0)
    search.finish("p", None, "pruned")
    assert _states(search.study) == {"nan": "FAIL", "a": "COMPLETE", "p": "PRUNED"}
    assert search.best() == (search.trial_for("a")[1], 2.0)  # pruned trials never count
    with pytest.raises(ConfigError, match="complete, pruned, fail"):
        search.finish("a", 1.0, "done")
    with pytest.raises(ValueError, match="trial_for"):
        search.report("never-asked", 1.0, 0)


def test_search_argument_errors_are_reported_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _search(tmp_path, sampler="cmaes", pruner="asha", max_generations=0)
    assert len(err.value.problems) == 3
    assert "tpe, gp, random, qmc" in str(err.value)


def test_gp_sampler_searches(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    search = _search(tmp_path, sampler="gp", pruner="none", startup_trials=2, max_generations=1)
    for i in range(4):
        member_id = f"m{i}"
        _, values = search.trial_for(member_id)
        assert search.report(member_id, -abs(math.log10(values["lr"]) + 3), 0) is True
    assert len(search.study.get_trials(states=(States.COMPLETE,))) == 4
