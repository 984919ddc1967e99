"""Optuna, in its two roles: sampler of the initial population, and the baseline PBT must beat.

``sample_initial`` draws generation 0 from the mutation ranges (random, scrambled Sobol, or TPE
warm-started from an earlier campaign's study) and records each draw as a trial of the
campaign's study, so ``record_initial_fitness`` can complete it and a later campaign can learn
from it. ``OptunaSearch`` is plain Optuna HPO over the same ranges: each trial is one member
trained from scratch, reported once per generation, stopped by a pruner.

Both keep their whole state in the Optuna storage and key every trial by the ``member_id`` user
attribute, so a controller that crashes and resumes asks the same questions and gets the same
answers. Two details of that:

- A trial is enqueued with its ``member_id`` before it is asked, so no trial ever exists
  without one (an ask interrupted half-way leaves a WAITING trial that the next ask picks up).
- The sampler is reseeded before every ask from ``(seed, trial number)``: a resumed campaign
  does not replay the random stream of its first trials, and a trial's draw depends only on
  the seed, its number and the study's history. QMC keeps one seed, since its position in the
  Sobol sequence lives in the study.

Deviation from a pure Sobol population: Optuna's ``QMCSampler`` learns the search space from
the first trial, which it draws at random; members 1.. are the scrambled Sobol points.

This is the only module of the package that imports Optuna, and it does so lazily. The ``gp``
sampler makes Optuna import torch (CPU is enough) when it first fits; nothing else here does.
"""

from __future__ import annotations

import importlib.util
import math
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pbt.config.errors import ConfigError
from pbt.config.ranges import HPRange
from pbt.protocol.records import member_id as record_id

if TYPE_CHECKING:
    from optuna import Study
    from optuna.distributions import BaseDistribution
    from optuna.samplers import BaseSampler
    from optuna.storages import BaseStorage
    from optuna.trial import FrozenTrial

INITIAL_SAMPLERS = ("random", "qmc", "tpe")
SEARCH_SAMPLERS = ("tpe", "gp", "random", "qmc")
PRUNERS = ("median", "hyperband", "successive_halving", "none")
FINISH_STATES = ("complete", "pruned", "fail")
MEMBER_ATTR = "member_id"

SamplerFactory = Callable[[int], "BaseSampler"]


def study_storage(directory: str | Path) -> str:
    """``'sqlite:///<abs directory>/optuna.db'``: the campaign's Optuna store."""
    return f"sqlite:///{(Path(directory).resolve() / 'optuna.db').as_posix()}"


def sample_initial(
    ranges: dict[str, HPRange],
    base: dict[str, float],
    size: int,
    *,
    sampler: str,
    seed: int,
    storage: str | None,
    study_name: str,
    warm_start: str | None = None,
) -> list[dict[str, float]]:
    """The hyperparameters of generation 0, each drawn as one trial of the campaign's study.

    Args:
        ranges: The hyperparameters to draw and where each may go (log-uniform where ``log``).
        base: Every member's starting values; the names in ``ranges`` are replaced.
        size: How many members.
        sampler: ``random``, ``qmc`` (scrambled Sobol: well spread) or ``tpe``.
        seed: The campaign's seed; same seed and inputs give the same values.
        storage: An Optuna storage URL (see :func:`study_storage`), or None for in memory.
        study_name: The study to record the draws in, created when missing.
        warm_start: For ``tpe``: an earlier campaign's directory or storage URL. Its study
            (``study_name``, or the only study there) lends its complete trials as history.

    Returns:
        ``size`` dicts, member ``i`` being trial ``g000-m{i:02d}``; a study that already holds
        those members (a resume) returns their recorded values without asking again.

    Raises:
        ConfigError: an unknown sampler, or a warm start that is missing or holds no study.
    """
    problems = _check_choice("sampler", sampler, INITIAL_SAMPLERS)
    if warm_start is not None and sampler != "tpe":
        problems.append(
            f"warm_start ({warm_start!r}) needs sampler 'tpe' (got {sampler!r}); "
            "set sampler: tpe or drop warm_start"
        )
    if problems:
        raise ConfigError(problems)
    if not ranges:
        return [dict(base) for _ in range(size)]
    study = _maximising_study(storage, study_name)
    if warm_start is not None and "warm_start" not in study.user_attrs:
        _copy_history(study, warm_start, study_name, ranges)
    space = _distributions(ranges)
    factory = _sampler_factory(sampler, seed, startup_trials=None)
    trials = _trials_by_member(study)
    members = []
    for i in range(size):
        member_id = record_id(0, i)
        trial = trials.get(member_id)
        params = _ask(study, space, member_id, factory) if _unasked(trial) else trial.params
        members.append(_hyperparameters(base, ranges, params))
    return members


def record_initial_fitness(storage: str, study_name: str, fitness: dict[str, float]) -> None:
    """Tell the study each initial member's fitness (member_id -> value).

    Completes each member's trial (a non-finite value fails it) so a later campaign can
    warm-start from it. Finished trials are left alone, so a repeat call does nothing. A study
    that does not exist (``sample_initial`` had no ranges to draw) has nothing to record.

    Raises:
        ValueError: a member id has no trial in the study.
    """
    optuna = _optuna()
    store = _open_storage(storage)
    if study_name not in optuna.study.get_all_study_names(store):
        return
    study = optuna.load_study(
        study_name=study_name, storage=store, sampler=optuna.samplers.RandomSampler()
    )
    trials = _trials_by_member(study)
    missing = sorted(set(fitness) - set(trials))
    if missing:
        raise ValueError(f"study {study_name!r} in {storage} has no trial for members {missing}")
    for member_id, value in sorted(fitness.items()):
        _tell(study, trials[member_id], value, "complete")


def record_members(
    storage: str,
    study_name: str,
    ranges: dict[str, HPRange],
    members: list[tuple[str, dict[str, float], float, int]],
) -> None:
    """Add trained members as completed trials: ``(member_id, hyperparameters, fitness,
    generation)`` each, so a PBT campaign's members show in ``optuna-dashboard`` beside a
    search's trials. Members already recorded are skipped, so a repeat call does nothing."""
    optuna = _optuna()
    study = _maximising_study(storage, study_name)
    space = _distributions(ranges)
    known = _trials_by_member(study)
    for member_id, hyperparameters, fitness, generation in members:
        if member_id in known:
            continue
        params = {
            name: hyperparameters[name]
            for name in space
            if name in hyperparameters and _within(space[name], hyperparameters[name])
        }
        finite = fitness is not None and math.isfinite(fitness)
        trial = optuna.trial.create_trial(
            params=params,
            distributions={name: space[name] for name in params},
            value=fitness if finite else None,
            state=optuna.trial.TrialState.COMPLETE if finite else optuna.trial.TrialState.FAIL,
            user_attrs={MEMBER_ATTR: member_id, "generation": generation},
        )
        study.add_trial(trial)


class OptunaSearch:
    """Plain Optuna HPO, run a generation at a time: the baseline PBT must beat.

    Each trial is one member trained from scratch for up to ``max_generations`` generations;
    after each the controller calls :meth:`report`, and a pruned or finished trial's slot gets
    a fresh member (a fresh trial). Every call is keyed by member id and idempotent, and all
    state lives in ``storage``, so a new ``OptunaSearch`` on the same storage resumes.

    Args:
        ranges: The hyperparameters to search and where each may go.
        base: Every trial's other hyperparameters.
        storage: An Optuna storage URL, or None for in memory.
        study_name: The study, created when missing (direction: maximize).
        sampler: ``tpe`` (multivariate, constant liar), ``gp`` (needs torch and scipy),
            ``random`` or ``qmc``.
        pruner: ``median``, ``hyperband`` (resource = generations), ``successive_halving``
            (keeps the top third of the trials at 2, 4, 10, ... generations; decides from the
            second generation on, with no complete trial needed) or ``none``.
        seed: Seed of the sampler.
        max_generations: A trial's length in generations; hyperband's ``max_resource``.
        startup_trials: Complete trials before the median pruner prunes and TPE or GP model.

    Raises:
        ConfigError: Listing every argument that breaks a rule.
    """

    def __init__(
        self,
        ranges: dict[str, HPRange],
        base: dict[str, float],
        *,
        storage: str | None,
        study_name: str,
        sampler: str = "tpe",
        pruner: str = "median",
        seed: int = 0,
        max_generations: int = 4,
        startup_trials: int = 4,
    ) -> None:
        problems = _search_problems(ranges, sampler, pruner, max_generations, startup_trials)
        if problems:
            raise ConfigError(problems)
        optuna = _optuna()
        self.ranges = dict(ranges)
        self.base = dict(base)
        self.max_generations = max_generations
        self._factory = _sampler_factory(sampler, seed, startup_trials)
        self._storage = _open_storage(storage)
        self._study = optuna.create_study(
            storage=self._storage,
            study_name=study_name,
            direction="maximize",
            pruner=_pruner(pruner, max_generations, startup_trials),
            load_if_exists=True,
        )
        self._study_id = self._storage.get_study_id_from_name(study_name)
        self._space = _distributions(self.ranges)

    @property
    def study(self) -> Study:
        """The Optuna study, for inspection."""
        return self._study

    def trial_for(self, member_id: str) -> tuple[int, dict[str, float]]:
        """The trial of ``member_id``: its number and hyperparameters.

        Asked of the sampler on the first call; every later call (from any ``OptunaSearch``
        on the same storage) returns the same answer.
        """
        trial = _trials_by_member(self._study).get(member_id)
        if _unasked(trial):
            _ask(self._study, self._space, member_id, self._factory)
            trial = _trials_by_member(self._study)[member_id]
        return trial.number, _hyperparameters(self.base, self.ranges, trial.params)

    def report(self, member_id: str, fitness: float, generation: int) -> bool:
        """Record ``fitness`` after the trial's generation ``generation`` (0-based step).

        Returns:
            True when the trial should stop: pruned (marked PRUNED), at ``max_generations``
            (COMPLETE with this fitness), or given a NaN fitness (FAIL). Reporting a step
            again, after a resume, gives the same answer and keeps the first value.

        Raises:
            ValueError: ``member_id`` has no trial (call :meth:`trial_for` first).
        """
        optuna = _optuna()
        frozen = self._frozen(member_id)
        if frozen.state.is_finished():
            return True
        if math.isnan(fitness):
            _tell(self._study, frozen, None, "fail")
            return True
        if generation <= frozen.user_attrs.get("continued_through", -1):
            return False
        trial = optuna.trial.Trial(self._study, self._trial_id(frozen.number))
        if generation not in frozen.intermediate_values:
            trial.report(fitness, generation)
        if generation + 1 >= self.max_generations:
            self._study.tell(trial, frozen.intermediate_values.get(generation, fitness))
            return True
        if trial.should_prune():
            self._study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            return True
        trial.set_user_attr("continued_through", generation)
        return False

    def finish(self, member_id: str, fitness: float | None, state: str = "complete") -> None:
        """End the trial of ``member_id`` early or late, as ``complete``, ``pruned`` or ``fail``.

        A finished trial is left alone; a ``complete`` without a finite fitness fails it.

        Raises:
            ConfigError: an unknown ``state``.
            ValueError: ``member_id`` has no trial.
        """
        problems = _check_choice("state", state, FINISH_STATES)
        if problems:
            raise ConfigError(problems)
        _tell(self._study, self._frozen(member_id), fitness, state)

    def best(self) -> tuple[dict[str, float], float] | None:
        """The best complete trial's hyperparameters and fitness; None before the first."""
        optuna = _optuna()
        complete = self._study.get_trials(
            deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)
        )
        if not complete:
            return None
        top = max(complete, key=lambda t: t.value)
        return _hyperparameters(self.base, self.ranges, top.params), top.value

    def _frozen(self, member_id: str) -> FrozenTrial:
        trial = _trials_by_member(self._study).get(member_id)
        if _unasked(trial):
            raise ValueError(
                f"member {member_id!r} has no trial in study {self._study.study_name!r}; "
                "call trial_for first"
            )
        return trial

    def _trial_id(self, number: int) -> int:
        return self._storage.get_trial_id_from_study_id_trial_number(self._study_id, number)


def _optuna() -> Any:
    """Optuna, imported on first use, with its INFO logging off."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _maximising_study(storage: str | None, study_name: str) -> Study:
    """The study ``study_name`` in ``storage`` (created if missing), maximising fitness."""
    return _optuna().create_study(
        storage=_open_storage(storage),
        study_name=study_name,
        direction="maximize",
        load_if_exists=True,
    )


def _open_storage(url: str | None) -> BaseStorage:
    optuna = _optuna()
    return optuna.storages.RDBStorage(url) if url else optuna.storages.InMemoryStorage()


def _check_choice(key: str, value: str, valid: tuple[str, ...]) -> list[str]:
    if value in valid:
        return []
    return [f"{key} ({value!r}) must be one of {', '.join(valid)}; pick one"]


def _search_problems(
    ranges: dict[str, HPRange], sampler: str, pruner: str, max_generations: int, startup: int
) -> list[str]:
    problems = _check_choice("sampler", sampler, SEARCH_SAMPLERS)
    problems += _check_choice("pruner", pruner, PRUNERS)
    if not isinstance(max_generations, int) or max_generations < 1:
        problems.append(f"max_generations ({max_generations!r}) must be an int >= 1; raise it")
    if not isinstance(startup, int) or startup < 0:
        problems.append(f"startup_trials ({startup!r}) must be an int >= 0; use e.g. 4")
    if not ranges:
        problems.append("ranges ({}) must name at least one hyperparameter to search; add one")
    missing = [m for m in ("torch", "scipy") if importlib.util.find_spec(m) is None]
    if sampler == "gp" and missing:
        problems.append(
            f"sampler ('gp') needs {' and '.join(missing)}, not installed; "
            f"pip install {' '.join(missing)} or use sampler: tpe"
        )
    return problems


def _within(distribution: BaseDistribution, value: float) -> bool:
    """Whether ``value`` lies within ``distribution``'s bounds. A member's first value may lie
    outside its mutation range (AgileRL's published cispo.yaml starts ``BETA`` at 0, below
    ``MIN_BETA``), which Optuna refuses in a trial: such a value is left out of the member's
    trial, which records the rest."""
    return distribution.low <= value <= distribution.high


def _distributions(ranges: dict[str, HPRange]) -> dict[str, BaseDistribution]:
    """One Optuna distribution per range, in name order (int ranges to their whole numbers)."""
    optuna = _optuna()
    space: dict[str, BaseDistribution] = {}
    for name, r in sorted(ranges.items()):
        if r.dtype == "int":
            low, high = math.ceil(r.min), math.floor(r.max)
            space[name] = optuna.distributions.IntDistribution(low, high, log=r.log)
        else:
            space[name] = optuna.distributions.FloatDistribution(r.min, r.max, log=r.log)
    return space


def _sampler_factory(name: str, seed: int, startup_trials: int | None) -> SamplerFactory:
    """Builds the sampler that asks trial ``number``; ``startup_trials`` None: Optuna's own."""
    optuna = _optuna()
    samplers = optuna.samplers
    startup = {} if startup_trials is None else {"n_startup_trials": startup_trials}

    def make(number: int) -> BaseSampler:
        trial_seed = random.Random(f"{seed}/{number}").getrandbits(32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            if name == "qmc":
                return samplers.QMCSampler(qmc_type="sobol", scramble=True, seed=seed)
            if name == "tpe":
                return samplers.TPESampler(
                    seed=trial_seed, multivariate=True, constant_liar=True, **startup
                )
            if name == "gp":
                return samplers.GPSampler(seed=trial_seed, **startup)
            return samplers.RandomSampler(seed=trial_seed)

    return make


def _pruner(name: str, max_generations: int, startup_trials: int) -> Any:
    pruners = _optuna().pruners
    if name == "median":
        return pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=0)
    if name == "hyperband":
        return pruners.HyperbandPruner(
            min_resource=1, max_resource=max_generations, reduction_factor=3
        )
    if name == "successive_halving":
        return pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    return pruners.NopPruner()


def _trials_by_member(study: Study) -> dict[str, FrozenTrial]:
    trials = study.get_trials(deepcopy=False)
    return {t.user_attrs[MEMBER_ATTR]: t for t in trials if MEMBER_ATTR in t.user_attrs}


def _unasked(trial: FrozenTrial | None) -> bool:
    """True for no trial yet, or one enqueued but never asked (an interrupted ask)."""
    return trial is None or trial.state.name == "WAITING"


def _ask(
    study: Study, space: dict[str, BaseDistribution], member_id: str, factory: SamplerFactory
) -> dict[str, Any]:
    """Ask a trial tagged ``member_id`` and return its params.

    The trial is enqueued with its tag first, so it is never untagged; ``study.ask`` takes the
    oldest waiting trial, which is another member's only after an interrupted ask, so the loop
    finishes that one too.
    """
    optuna = _optuna()
    if member_id not in _trials_by_member(study):
        study.enqueue_trial({}, user_attrs={MEMBER_ATTR: member_id})
    while True:
        waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
        study.sampler = factory(min(t.number for t in waiting))
        trial = study.ask(space)
        if trial.user_attrs.get(MEMBER_ATTR) == member_id:
            return trial.params


def _hyperparameters(
    base: dict[str, float], ranges: dict[str, HPRange], params: dict[str, Any]
) -> dict[str, float]:
    drawn = {
        name: ranges[name].clip_cast(value) for name, value in params.items() if name in ranges
    }
    return {**base, **drawn}


def _tell(study: Study, trial: FrozenTrial, fitness: float | None, state: str) -> None:
    """Finish ``trial`` as ``state``; a complete without a finite fitness fails. Idempotent."""
    if trial.state.is_finished():
        return
    states = _optuna().trial.TrialState
    if state == "complete" and fitness is not None and math.isfinite(fitness):
        study.tell(trial.number, fitness, skip_if_finished=True)
    elif state == "pruned":
        study.tell(trial.number, state=states.PRUNED, skip_if_finished=True)
    else:
        study.tell(trial.number, state=states.FAIL, skip_if_finished=True)


def _copy_history(
    study: Study, warm_start: str, study_name: str, ranges: dict[str, HPRange]
) -> None:
    """Add the warm start's complete trials to ``study``, as the current ranges' distributions.

    Trials outside the current ranges are left out. The source's member ids are kept under
    ``source_member_id`` so they never answer for this campaign's members.
    """
    optuna = _optuna()
    source = _warm_start_study(warm_start, study_name)
    space = _distributions(ranges)
    copies = []
    for t in source.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        if not set(space) <= set(t.params):
            continue
        try:
            copy = optuna.trial.create_trial(
                params={name: t.params[name] for name in space},
                distributions=space,
                value=t.value,
                user_attrs={
                    "warm_start": warm_start,
                    "source_member_id": t.user_attrs.get(MEMBER_ATTR),
                },
            )
        except ValueError:  # a value outside the current range
            continue
        copies.append(copy)
    study.add_trials(copies)
    study.set_user_attr("warm_start", {"source": warm_start, "trials": len(copies)})


def _warm_start_study(warm_start: str, study_name: str) -> Study:
    """The study of an earlier campaign: ``study_name`` there, or the only study there."""
    optuna = _optuna()
    url = warm_start if "://" in warm_start else study_storage(warm_start)
    path = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else None
    if path is not None and not Path(path).is_file():
        raise ConfigError(
            [
                f"warm_start ({warm_start!r}) has no Optuna store ({path} does not exist); "
                "point it at an earlier campaign's directory or drop it"
            ]
        )
    store = _open_storage(url)
    names = optuna.study.get_all_study_names(store)
    name = study_name if study_name in names else (names[0] if len(names) == 1 else None)
    if not names:
        raise ConfigError(
            [f"warm_start ({warm_start!r}) holds no Optuna study; point it at an earlier campaign"]
        )
    if name is None:
        raise ConfigError(
            [
                f"warm_start ({warm_start!r}) holds studies {names}, none named {study_name!r}; "
                "point it at a campaign with one study or rename the study"
            ]
        )
    return optuna.load_study(
        study_name=name, storage=store, sampler=optuna.samplers.RandomSampler()
    )
