"""The ``optuna`` search strategy's side of a campaign, and the studies every campaign keeps.

Under ``search.strategy: optuna`` each slot trains one Optuna trial from scratch and reports its
fitness after every generation; when the pruner stops it, or it has trained
``trial_generations`` generations, the slot starts a new trial. A PBT campaign records its
generation-0 draws and every trained member in studies of its own (for ``warm_start`` and
optuna-dashboard). Everything lives in the campaign directory's ``optuna.db``; the decisions
are made from the store, so a resumed campaign asks the same trials.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pbt.config import Manifest
from pbt.config.ranges import base_hyperparameters, batch_rule, hp_ranges, keep_batch_rule
from pbt.evolution.breeding import INIT_STUDY, child_record, lineage_event
from pbt.evolution.search import (
    OptunaSearch,
    record_initial_fitness,
    record_members,
    study_storage,
)
from pbt.protocol.records import MemberRecord, member_id

SEARCH_STUDY = "search"
"""The Optuna study of the ``optuna`` strategy: one trial per member trained from scratch."""
POPULATION_STUDY = "population"
"""Every trained PBT member as a completed trial, for optuna-dashboard."""


class MemberLookup(Protocol):
    """Where a member's record is read by id: the campaign's store
    (:class:`pbt.controller.store.CampaignStore`) in practice."""

    def member(self, member_id: str) -> MemberRecord: ...


@dataclass(slots=True)
class Trials:
    """The trials of one campaign: what each slot trains next, and the fitness recorded."""

    manifest: Manifest
    store: MemberLookup
    directory: Path

    def search(self) -> OptunaSearch:
        cfg = self.manifest.search
        return OptunaSearch(
            hp_ranges(self.manifest),
            base_hyperparameters(self.manifest),
            storage=study_storage(self.directory),
            study_name=SEARCH_STUDY,
            sampler=cfg.sampler,
            pruner=cfg.pruner,
            seed=self.manifest.training.seed,
            max_generations=cfg.trial_generations,
            startup_trials=cfg.startup_trials,
        )

    def first_trials(self) -> list[MemberRecord]:
        """Generation 0: a new trial in every slot."""
        search = self.search()
        members = []
        for i in range(self.manifest.population.size):
            number, hyperparameters = self._trial_for(search, member_id(0, i))
            members.append(
                MemberRecord(
                    member_id=member_id(0, i),
                    generation=0,
                    hyperparameters=hyperparameters,
                    mutation=f"trial {number}",
                )
            )
        return members

    def next_trials(
        self, generation: int, finished: list[MemberRecord]
    ) -> tuple[list[MemberRecord], list[dict]]:
        """Each slot continues its trial, or starts a new one when the pruner stopped it or it
        trained ``trial_generations`` generations."""
        search = self.search()
        members, events = [], []
        for slot, m in enumerate(finished):
            root = self._trial_root(m)
            child_id = member_id(generation + 1, slot)
            fitness = m.fitness_history[-1] if m.fitness_history else math.nan
            if m.collapsed:  # its trial ends, and a new one takes the slot
                search.finish(root.member_id, fitness, "pruned")
            if search.report(root.member_id, fitness, m.generation - root.generation):
                number, hyperparameters = self._trial_for(search, child_id)
                child = MemberRecord(
                    member_id=child_id,
                    generation=generation + 1,
                    hyperparameters=hyperparameters,
                    mutation=f"trial {number}",
                )
                detail = f"trial {number} replaces the trial of {root.member_id}"
                event = lineage_event(child, "create", detail)
            else:
                continues = f"trial of {root.member_id} continues"
                child = child_record(m, child_id, generation + 1, mutation=continues)
                event = lineage_event(child, "clone")
            members.append(child)
            events.append(event)
        return members, events

    def record(self, generation: int, finished: list[MemberRecord], final: bool) -> None:
        """Fitness into the Optuna studies (idempotent): generation 0's draws complete their
        trials (a later campaign can warm-start from them), PBT members become trials of the
        ``population`` study, and a search's unfinished trials complete when the campaign ends."""
        done = [m for m in finished if m.status == "done" and m.fitness_history]
        storage = study_storage(self.directory)
        ranges = hp_ranges(self.manifest)
        if self.manifest.search.strategy == "optuna":
            if final:  # the budget ends the trials still running, after their last report
                search = self.search()
                for m in done:
                    root = self._trial_root(m)
                    fitness = m.fitness_history[-1]
                    if not search.report(root.member_id, fitness, m.generation - root.generation):
                        search.finish(root.member_id, fitness)
            return
        if not ranges:
            return
        if generation == 0 and self.manifest.population.init_sampler != "none":
            fitness = {m.member_id: m.fitness_history[-1] for m in done}
            record_initial_fitness(storage, INIT_STUDY, fitness)
        record_members(
            storage,
            POPULATION_STUDY,
            ranges,
            [(m.member_id, m.hyperparameters, m.fitness_history[-1], m.generation) for m in done],
        )

    def _trial_for(self, search: OptunaSearch, member: str) -> tuple[int, dict[str, float]]:
        """The trial ``member`` runs and its hyperparameters, a drawn group size or prompts per
        step moved to the nearest value that keeps the batch rules."""
        number, drawn = search.trial_for(member)
        ranges = hp_ranges(self.manifest)
        return number, keep_batch_rule(drawn, ranges, batch_rule(self.manifest))

    def _trial_root(self, m: MemberRecord) -> MemberRecord:
        """The member that started ``m``'s trial (trained from scratch)."""
        while m.parent_id is not None:
            m = self.store.member(m.parent_id)
        return m
