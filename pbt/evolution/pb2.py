"""PB2's explore step (Parker-Holder et al., 2020, "Provably Efficient Online Hyperparameter
Optimization with Population-Based Bandits"): a copied member's new hyperparameters come from a
Gaussian-process bandit over what every member's hyperparameters did, instead of a random
x0.8 / x1.2.

The data are one point per trained member: its hyperparameters (each mapped to [0, 1], on a
log scale where the range says ``log``), the generation it trained in, and the change of its
fitness over that generation (its evaluation minus its parent's; generation 0, which has no
parent's, counts only while nothing later exists). The GP's kernel is PB2's time-varying one,
``(1 - eps) ** (|t - t'| / 2) * exp(-|x - x'|^2 / (2 l^2))``, so old generations weigh less as
training moves on; the length scale, ``eps`` and the noise are those of a small grid that
maximise the marginal likelihood of the standardised changes. Each copy takes the candidate of
highest upper confidence bound ``mean + kappa * sd`` at the latest generation, among 256 points
drawn uniformly from the campaign's RNG and its parent's own; copies chosen in the same
generation see the earlier ones as observed at the GP's mean (GP-BUCB, Desautels et al. 2014),
so they spread out instead of all taking the same point.

Everything random comes from the campaign's ``random.Random``, and the data from the store, so
a resumed campaign chooses what it would have. Controller code: numpy, no torch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from pbt.config.ranges import BatchRule, HPRange, keep_batch_rule, typed_range
from pbt.evolution.selection import Selected
from pbt.protocol.records import MemberRecord

CANDIDATES = 256
"""Uniform draws scored by the bandit for each copy (besides the parent's own point)."""
KAPPA = 2.0
"""Weight of the GP's standard deviation in the upper confidence bound."""
LENGTH_SCALES = (0.1, 0.2, 0.4, 0.8)
TIME_DECAYS = (0.0, 0.1, 0.3, 0.6)
NOISES = (0.05, 0.2, 0.5, 1.0)
"""The grid the kernel's length scale, time decay ``eps`` and noise variance (of standardised
changes) are fitted on."""


@dataclass(frozen=True, slots=True)
class Observation:
    """What one member's hyperparameters did over one generation."""

    generation: int
    hyperparameters: dict[str, float]
    change: float
    """Its fitness after the generation minus its parent's (or its own first fitness)."""


def observations(members: Sequence[MemberRecord], upto: int) -> list[Observation]:
    """The bandit's data from the members of generations ``<= upto`` that trained and were
    evaluated (not those replaced after failing): the change of fitness over each member's
    generation; generation 0's first fitnesses only when no later generation has data (they
    share a start, so their levels are their changes up to one constant, which later changes
    do not share)."""
    points = []
    for m in members:
        history = m.fitness_history
        if m.generation > upto or m.status != "done" or not history:
            continue
        if (m.mutation or "").startswith("replaced"):  # a failed member: the history is another's
            continue
        latest = history[-1]
        if not math.isfinite(latest):
            continue
        if m.generation == 0:
            points.append(Observation(0, dict(m.hyperparameters), latest))
        elif len(history) >= 2 and math.isfinite(history[-2]):
            points.append(Observation(m.generation, dict(m.hyperparameters), latest - history[-2]))
    later = [p for p in points if p.generation > 0]
    return later or points


class PB2Explore:
    """Chooses the hyperparameters of truncation selection's copies with a GP bandit.

    Args:
        ranges: The hyperparameters searched and where each may go.
        data: What the members did so far (:func:`observations`).
        generation: The generation just trained; the bandit scores candidates at it.
        rule: The batch rules a child's whole-number hyperparameters must keep; None checks
            none.
    """

    def __init__(
        self,
        ranges: dict[str, HPRange],
        data: Sequence[Observation],
        generation: int,
        rule: BatchRule | None = None,
    ) -> None:
        self.ranges = {name: typed_range(name, spec) for name, spec in sorted(ranges.items())}
        self.data = list(data)
        self.generation = generation
        self.rule = rule

    def mutate_population(
        self, selected: list[Selected], rng: random.Random
    ) -> list[tuple[dict[str, float], str]]:
        """Each selected parent's child's hyperparameters and what was done, in slot order: a
        survivor keeps its values; a copy takes the bandit's choice, its ranges' names all set."""
        names = [n for n in self.ranges if all(n in s.parent.hyperparameters for s in selected)]
        data = [p for p in self.data if all(n in p.hyperparameters for n in names)]
        gp = _Bandit(
            [self._unit(p.hyperparameters, names) for p in data],
            [p.generation for p in data],
            [p.change for p in data],
            len(names),
        )
        out = []
        for s in selected:
            parent = s.parent.hyperparameters
            if s.survivor or s.is_elite or not names:
                out.append((dict(parent), "none (elite)" if s.is_elite else "none (survivor)"))
                continue
            candidates = [self._unit(parent, names)]
            candidates += [[rng.random() for _ in names] for _ in range(CANDIDATES)]
            point, bound = gp.choose(candidates, self.generation)
            child = dict(parent)
            for name, u in zip(names, point, strict=True):
                child[name] = self.ranges[name].clip_cast(self._value(name, u))
            if self.rule is not None:
                child = keep_batch_rule(child, self.ranges, self.rule)
            changes = ", ".join(f"{n} {parent[n]:.6g} -> {child[n]:.6g}" for n in names)
            out.append((child, f"pb2 ({changes}; ucb {bound:.3g})"))
        return out

    def _unit(self, values: dict[str, float], names: list[str]) -> list[float]:
        return [self._to_unit(name, values[name]) for name in names]

    def _to_unit(self, name: str, value: float) -> float:
        spec = self.ranges[name]
        low, high, v = spec.min, spec.max, min(max(value, spec.min), spec.max)
        if spec.log:
            low, high, v = math.log(low), math.log(high), math.log(v)
        return (v - low) / (high - low)

    def _value(self, name: str, u: float) -> float:
        spec = self.ranges[name]
        if spec.log:
            return math.exp(math.log(spec.min) + u * (math.log(spec.max) - math.log(spec.min)))
        return spec.min + u * (spec.max - spec.min)


class _Bandit:
    """A GP on (generation, unit hyperparameters) -> standardised fitness change."""

    def __init__(self, x: list[list[float]], t: list[int], y: list[float], dims: int) -> None:
        import numpy as np

        self.np = np
        self.x = np.asarray(x, dtype=np.float64).reshape(len(x), dims)
        self.t = np.asarray(t, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        spread = float(y.std()) if len(y) > 1 else 0.0
        self.y = (y - y.mean()) / spread if spread > 0 else y - (y.mean() if len(y) else 0.0)
        self.length, self.decay, self.noise = self._fit()

    def _kernel(self, xa, ta, xb, tb, length: float, decay: float):
        np = self.np
        squared = ((xa[:, None, :] - xb[None, :, :]) ** 2).sum(-1)
        lag = np.abs(ta[:, None] - tb[None, :])
        return (1.0 - decay) ** (lag / 2.0) * np.exp(-squared / (2.0 * length**2))

    def _fit(self) -> tuple[float, float, float]:
        """The grid point of highest log marginal likelihood (ties: the first)."""
        np = self.np
        best, best_ll = (LENGTH_SCALES[1], TIME_DECAYS[1], NOISES[1]), -math.inf
        if len(self.y) < 2:
            return best
        for length in LENGTH_SCALES:
            for decay in TIME_DECAYS:
                k = self._kernel(self.x, self.t, self.x, self.t, length, decay)
                for noise in NOISES:
                    chol = np.linalg.cholesky(k + noise * np.eye(len(self.y)))
                    alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, self.y))
                    ll = -0.5 * float(self.y @ alpha) - float(np.log(np.diag(chol)).sum())
                    if ll > best_ll + 1e-12:
                        best, best_ll = (length, decay, noise), ll
        return best

    def choose(self, candidates: list[list[float]], generation: int) -> tuple[list[float], float]:
        """The candidate of highest UCB at ``generation``, and that bound; the choice then
        counts as observed at the GP's mean there (so the next choice looks elsewhere)."""
        np = self.np
        c = np.asarray(candidates, dtype=np.float64).reshape(len(candidates), self.x.shape[1])
        tc = np.full(len(c), float(generation))
        if len(self.y) == 0:
            mean, sd = np.zeros(len(c)), np.ones(len(c))
        else:
            k = self._kernel(self.x, self.t, self.x, self.t, self.length, self.decay)
            chol = np.linalg.cholesky(k + self.noise * np.eye(len(self.y)))
            cross = self._kernel(self.x, self.t, c, tc, self.length, self.decay)
            alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, self.y))
            mean = cross.T @ alpha
            v = np.linalg.solve(chol, cross)
            sd = np.sqrt(np.clip(1.0 - (v * v).sum(0), 1e-12, None))
        ucb = mean + KAPPA * sd
        pick = int(np.argmax(ucb))  # the first of equals: the parent's point
        self.x = np.vstack([self.x, c[pick : pick + 1]])
        self.t = np.append(self.t, float(generation))
        self.y = np.append(self.y, mean[pick])
        return [float(u) for u in c[pick]], float(ucb[pick])
