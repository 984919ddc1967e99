"""A shared base's members sampled together: :class:`~pbt.algorithms.runtime.shared_base.SharedBase`'s
rollouts in batches of ``launch.members_per_batch`` members, each row through its own
member's adapter (:mod:`pbt.algorithms.rollout.batched`).

A member's rollout here is the rollout it makes alone in the adapter slot: the same tokens
(token for token in float32 on the CPU), drawn from its own saved random stream, which ends where
its solo rollout would leave it; nothing else of the member (adapter, optimizer, data
position, Python's stream) is touched. Members are batched in the order given, at most
``members_per_batch`` at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from pbt.algorithms.data.examples import Chat
from pbt.algorithms.rollout.batched import MemberRollout, generate_batched
from pbt.algorithms.rollout.hf import RolloutBatch
from pbt.algorithms.runtime.lora_batch import RowAdapters, kernel_for
from pbt.algorithms.runtime.member import Host, Member
from pbt.algorithms.runtime.models import set_mode
from pbt.config import Manifest


class SharedMembers(Protocol):
    """What a batched rollout needs of a process hosting several members on one base model
    (:class:`~pbt.algorithms.runtime.shared_base.SharedBase` is one)."""

    manifest: Manifest
    host: Host

    def member(self, member_id: str) -> Member: ...

    def adapter_of(self, member_id: str) -> list[Tensor]: ...

    def rng_of(self, member_id: str) -> dict[str, Any]: ...

    def store_active(self) -> None: ...

    def restore_active(self) -> None: ...


def batchable(shared: SharedMembers) -> bool:
    """Whether ``shared`` samples its members together: more than one member a batch, an
    engine in this process (``hf`` or ``static``) and an unsharded model."""
    manifest = shared.manifest
    return (
        manifest.launch.members_per_batch > 1
        and manifest.rollout.engine in ("hf", "static")
        and shared.host.fsdp is None
    )


def complete_together(
    shared: SharedMembers,
    questions: dict[str, list[Chat]],
    training: bool,
    errors: dict[str, BaseException] | None = None,
) -> dict[str, RolloutBatch]:
    """Completions for every member of ``questions`` (``group_size`` samples a question when
    ``training``, else one greedy), ``members_per_batch`` members to a batch.

    A member whose adapter is not finite (it diverged) is left out of the batch and samples
    alone, as it would without a batch; where that fails, its error goes to ``errors`` (the
    member is then missing from the result) or, without ``errors``, is raised. The other
    members' completions are theirs either way."""
    per_batch = shared.manifest.launch.members_per_batch
    ids = list(questions)
    shared.store_active()  # the active member's adapter and stream, read from its copy
    out: dict[str, RolloutBatch] = {}
    broken: list[str] = []
    for start in range(0, len(ids), per_batch):
        chunk = ids[start : start + per_batch]
        out.update(_one_batch(shared, chunk, questions, training, broken))
    for member_id in broken:
        try:
            out[member_id] = shared.activate(member_id).learner.complete(
                questions[member_id], training
            )
        except Exception as err:
            if errors is None:
                raise
            errors[member_id] = err
    return {member_id: out[member_id] for member_id in ids if member_id in out}


def _one_batch(
    shared: SharedMembers,
    ids: Sequence[str],
    questions: dict[str, list[Chat]],
    training: bool,
    broken: list[str],
) -> dict[str, RolloutBatch]:
    """The completions of the members of ``ids`` with finite adapters, in one batch; the
    others are appended to ``broken``."""
    host = shared.host
    adapters = row_adapters(shared, len(ids))
    names = [name for name, _ in host.named_trainable]
    asks, sampled = [], []
    for slot, member_id in enumerate(ids):
        adapters.load(slot, dict(zip(names, shared.adapter_of(member_id), strict=True)))
        if not adapters.finite[slot]:
            broken.append(member_id)
            adapters.clear(slot)
            continue
        sampled.append(member_id)
        learner = shared.member(member_id).learner
        cfg = learner.rollout_cfg
        asks.append(
            MemberRollout(
                slot=slot,
                questions=questions[member_id],
                repeats=learner.algorithm.group_size if training else 1,
                generator=_generator(shared.rng_of(member_id), host.device),
                temperature=cfg.temperature,
                top_k=cfg.top_k,
                top_p=cfg.top_p,
                greedy=not training,
            )
        )
    if not sampled:
        return {}
    set_mode(host.model, False)
    learner = shared.member(sampled[0]).learner
    kernel = kernel_for(shared.manifest.launch.lora_kernel, host.device)
    batches = generate_batched(
        host.model, host.tokenizer, adapters, asks, learner.rollout_cfg, kernel=kernel
    )
    for member_id, ask in zip(sampled, asks, strict=True):
        _store_stream(shared.rng_of(member_id), ask.generator, host.device)
    shared.restore_active()
    return dict(zip(sampled, batches, strict=True))


def row_adapters(shared: SharedMembers, slots: int) -> RowAdapters:
    """The stacked adapters of ``shared``'s host, made (or remade larger) to hold ``slots``
    members. They are the host's, not the members' holder's: a long-lived worker makes a
    holder per batch of tasks, and its batches reuse one set (and the graphs captured on it)."""
    host = shared.host
    if host.row_adapters is None or host.row_adapters.slots < slots:
        per_batch = shared.manifest.launch.members_per_batch
        host.row_adapters = RowAdapters(host.model, max(slots, per_batch))
    return host.row_adapters


def _generator(rng: dict[str, Any], device: torch.device) -> torch.Generator:
    """A generator in the state of the member's saved global stream on ``device``."""
    generator = torch.Generator(device=device)
    if device.type == "cuda":
        generator.set_state(rng["cuda"][_index(device)])
    else:
        generator.set_state(rng["torch"])
    return generator


def _store_stream(rng: dict[str, Any], generator: torch.Generator, device: torch.device) -> None:
    if device.type == "cuda":
        rng["cuda"][_index(device)] = generator.get_state()
    else:
        rng["torch"] = generator.get_state()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
