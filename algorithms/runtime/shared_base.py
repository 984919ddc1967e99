"""Many members on one frozen base model in one process: the engine behind library mode.

A :class:`SharedBase` holds ONE peft model (the base, frozen, plus one adapter slot) and, for
each member, only what makes that member itself: its adapter tensors, a learner with its own
optimizer state, schedule, generator, step and hyperparameters, and its global RNG streams.
Making a member active copies its adapter into the slot *by value* (the local shards under
FSDP2, where every parameter is a sharded DTensor) and its RNG streams into the generators;
the member that was active is copied out first. A switch therefore moves megabytes, and a
population of N costs one base model plus N adapters with their Adam moments.

Each member's learner owns an optimizer over the slot's parameter objects, so optimizer state
never mixes between members. The reference policy is the base (adapter disabled), the same
for every member. Every rank of a torchrun group must call the same methods in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from pbt.algorithms.data.examples import Chat
from pbt.algorithms.rollout.hf import RolloutBatch
from pbt.algorithms.runtime.lora_batch import RowAdapters
from pbt.algorithms.runtime.member import (
    Host,
    Member,
    capture_rng,
    local_shard,
    restore_rng,
    seed_everything,
)
from pbt.algorithms.runtime.population_batch import batchable, complete_together
from pbt.config import Manifest
from pbt.config.errors import PbtError


def _clone_value(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone_value(v) for v in value]
    return value


class SharedBase:
    """A frozen base model shared by any number of members held by value.

    Args:
        manifest: the population's configuration (model, LoRA, sharding, task, defaults).
        device: where the model lives.
        host: the model to share, already loaded for ``manifest`` (a long-lived worker's);
            built here when omitted.
    """

    def __init__(self, manifest: Manifest, device: torch.device, host: Host | None = None) -> None:
        self.host = host or Host(manifest, device)
        self.manifest = manifest
        self.params = self.host.trainable
        # every member starts from the adapter as initialised (B = 0: the base's outputs)
        self._initial = self.host.initial_adapter
        self.members: dict[str, Member] = {}
        self._weights: dict[str, list[Tensor]] = {}
        self._rng: dict[str, dict[str, Any]] = {}
        self.active: str | None = None

    @property
    def world(self):
        return self.host.world

    @property
    def row_adapters(self) -> RowAdapters | None:
        """The members' adapters stacked for batched rollouts (``launch.members_per_batch``):
        the host's (:func:`~pbt.algorithms.runtime.population_batch.row_adapters`)."""
        return self.host.row_adapters

    # -- membership ------------------------------------------------------------------------

    def add(self, member_id: str, seed: int) -> Member:
        """A new member on the initial adapter, with a fresh learner and RNG seeded by ``seed``."""
        if member_id in self.members:
            raise PbtError(f"member {member_id} is already in this population")
        self._store_active()
        member = Member(self.manifest, self.host.device, member_id, host=self.host)
        member.learner.generator.manual_seed(seed)
        member.learner.data.restart(seed)
        self.members[member_id] = member
        self._weights[member_id] = [t.clone() for t in self._initial]
        self._rng[member_id] = _seeded_rng(seed + self.world.rank)
        self._restore_active()
        return member

    def clone(self, source: str, member_id: str, seed: int) -> Member:
        """A copy of ``source``: adapter, optimizer and schedule state, step and fitness.

        The copy samples from its own streams (seeded by ``seed``), so it does not replay
        its parent's rollouts.
        """
        parent = self.member(source)
        self._store_active()
        child = self.add(member_id, seed)
        self._weights[member_id] = [t.clone() for t in self._weights[source]]
        _copy_learner(parent.learner, child.learner)
        child.fitness = list(parent.fitness)
        child.mutation_ranges = {k: dict(v) for k, v in parent.mutation_ranges.items()}
        return child

    def remove(self, member_id: str) -> None:
        """Forget a member and free its adapter copy and optimizer state."""
        self.member(member_id)
        if self.active == member_id:
            self.active = None
        del self.members[member_id], self._weights[member_id], self._rng[member_id]
        if self.host.engine is not None:
            self.host.engine.forget(member_id)

    def member(self, member_id: str) -> Member:
        try:
            return self.members[member_id]
        except KeyError:
            raise PbtError(
                f"member {member_id} is not in this population (removed by selection?); "
                f"members: {', '.join(self.members) or 'none'}"
            ) from None

    # -- the adapter slot ------------------------------------------------------------------

    def activate(self, member_id: str) -> Member:
        """Put ``member_id``'s adapter and RNG streams in place and return the member."""
        member = self.member(member_id)
        if self.active != member_id:
            self._store_active()
            with torch.no_grad():  # one fused copy: a member switch is a few kernels
                torch._foreach_copy_(
                    [local_shard(p) for p in self.params], self._weights[member_id]
                )
            restore_rng(self._rng[member_id])
            self.active = member_id
        return member

    @contextmanager
    def using(self, member_id: str) -> Iterator[Member]:
        """``activate`` as a context: the member's state is current inside the block."""
        yield self.activate(member_id)

    def _store_active(self) -> None:
        """Copy the active member's adapter and RNG streams out of the slot."""
        if self.active is None:
            return
        with torch.no_grad():
            torch._foreach_copy_(self._weights[self.active], [local_shard(p) for p in self.params])
        self._rng[self.active] = capture_rng()

    def store_active(self) -> None:
        """Bring the active member's saved copies (:meth:`adapter_of`, :meth:`rng_of`) up to date."""
        self._store_active()

    def restore_active(self) -> None:
        """Put the active member's saved copies back in place (after they were changed)."""
        self._restore_active()

    def adapter_of(self, member_id: str) -> list[Tensor]:
        """The member's saved adapter tensors, in the order of the host's trainable parameters
        (the slot's values for the active member only after :meth:`store_active`)."""
        self.member(member_id)
        return self._weights[member_id]

    def rng_of(self, member_id: str) -> dict[str, Any]:
        """The member's saved global RNG streams (:func:`~pbt.algorithms.runtime.member.capture_rng`),
        which the caller may update in place."""
        self.member(member_id)
        return self._rng[member_id]

    def _restore_active(self) -> None:
        active, self.active = self.active, None
        if active is not None:
            self.activate(active)

    # -- rollouts -------------------------------------------------------------------------

    def complete_all(
        self, questions: dict[str, list[Chat]], training: bool = True
    ) -> dict[str, RolloutBatch]:
        """Completions for several members at once: ``group_size`` samples per question when
        ``training``, else one greedy completion, each from its own member's adapter.

        With a vLLM rollout every member's prompts go to the engine in ONE batch (a LoRA
        request per prompt; adapters that changed since the engine last saw them are reloaded
        first, each in place). With ``launch.members_per_batch`` > 1 on the ``hf`` or ``static``
        engine, that many members at a time in one batch, each row through its own member's
        adapter (:mod:`~pbt.algorithms.runtime.population_batch`); otherwise the members take turns in
        the adapter slot. Sampling seeds come from the streams of the member active at the call.
        """
        engine = self.host.engine
        if engine is None and batchable(self):
            return complete_together(self, questions, training)
        if engine is None:
            batches = {}
            for member_id, asked in questions.items():
                batches[member_id] = self.activate(member_id).learner.complete(asked, training)
            return batches
        from pbt.algorithms.rollout.vllm import Request

        for member_id in questions:
            learner = self.activate(member_id).learner
            if learner.adapter_stale:
                engine.sync(learner)
        requests = [
            Request(
                self.member(member_id).learner,
                asked,
                # each member's own group size: it mutates between generations
                repeats=self.member(member_id).learner.algorithm.group_size if training else 1,
                greedy=not training,
            )
            for member_id, asked in questions.items()
        ]
        return dict(zip(questions, engine.complete(requests), strict=True))

    # -- accounting ------------------------------------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held on this rank: the base model, and each member's own state.

        ``members`` counts adapter copies and optimizer state; ``slot`` the adapter in place.
        """
        model = self.host.model
        trainable = {id(p) for p in self.params}
        base = sum(
            local_shard(p).numel() * local_shard(p).element_size()
            for p in model.parameters()
            if id(p) not in trainable
        )
        slot = sum(local_shard(p).numel() * local_shard(p).element_size() for p in self.params)
        per_member = {}
        for member_id, member in self.members.items():
            owned = sum(t.numel() * t.element_size() for t in self._weights[member_id])
            for state in member.learner.optimizer.state.values():
                owned += sum(
                    local_shard(v).numel() * local_shard(v).element_size()
                    for v in state.values()
                    if torch.is_tensor(v)
                )
            per_member[member_id] = owned
        return {"base": base, "slot": slot, "members": sum(per_member.values()), **per_member}


def _seeded_rng(seed: int) -> dict[str, Any]:
    saved = capture_rng()
    seed_everything(seed)
    state = capture_rng()
    restore_rng(saved)
    return state


def _copy_learner(source, target) -> None:
    """Make ``target`` (a fresh learner over the same parameters) a copy of ``source``."""
    target.apply_hyperparameters(source.hyperparameters())
    for p in source.named_params:
        param = p[1]
        if param in source.optimizer.state:
            target.optimizer.state[param] = _clone_value(source.optimizer.state[param])
    for src, dst in zip(source.optimizer.param_groups, target.optimizer.param_groups, strict=True):
        dst.update({k: _clone_value(v) for k, v in src.items() if k != "params"})
    target.scheduler.load_state_dict(source.scheduler.state_dict())
    target.step = source.step
    target.data.load_state_dict(source.data.state_dict())
    target.zero_signal_in_a_row = source.zero_signal_in_a_row
