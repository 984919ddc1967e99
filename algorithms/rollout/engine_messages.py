"""The messages between a member's trainer and its dedicated rollout engine process.

Three queues join them: the trainer puts :class:`AdapterUpdate` on the adapter queue and
:class:`SampleRequest` / :class:`Drain` / :class:`Stop` on the request queue; the engine answers
on one reply queue with :class:`Ready`, :class:`Served`, :class:`Samples`, :class:`Drained`
and :class:`Failed`. Tensors cross through shared memory (torch's multiprocessing reductions).
Two queues, not one, so that the engine can take every adapter that has arrived before it
starts a request, whatever requests are queued behind it.

Every message carries the trainer's ``session``: one per training run of a member (a task, or
``Member.train`` call). An engine ignores requests of an older session, so a copied or resumed
member never receives a sample of its predecessor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from pbt.config import RolloutConfig

PROTOCOL = 2
"""The version of these messages; an engine of another version refuses to start."""


@dataclass(frozen=True, slots=True)
class AdapterUpdate:
    """The member's adapter after ``version`` optimizer steps of this session."""

    session: int
    version: int
    tensors: list[Tensor]
    """The trainable tensors, in :func:`~pbt.distributed.state.trainable_parameters` order."""


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """``repeats`` completions of each question, drawn with adapter ``min_version`` or newer."""

    session: int
    request: int
    questions: list[Any]
    repeats: int
    rollout: RolloutConfig
    """Sampling settings as the trainer holds them now (a mutation may have changed them)."""
    min_version: int
    """The engine waits for this adapter version before sampling (the trainer's current one
    when ``rollout.max_staleness`` is 0)."""
    rng: dict[str, Tensor] | None
    """Generator states to sample from (the member's own stream), or None to continue the
    engine's stream. The reply returns the states after sampling."""
    logprobs: bool
    """Whether to return the sampler's log-probs (what stale samples are corrected with)."""


@dataclass(frozen=True, slots=True)
class Drain:
    """End ``session``: the engine answers :class:`Drained` once every request before it is
    done or skipped."""

    session: int


@dataclass(frozen=True, slots=True)
class Stop:
    """Exit the engine process."""


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine loaded its model and serves."""

    pid: int
    protocol: int
    device: str
    """Where the engine's model lives, as the engine process names it (``cpu``, ``cuda:1``)."""


@dataclass(frozen=True, slots=True)
class Served:
    """The engine now samples with adapter ``version`` of ``session``."""

    session: int
    version: int


@dataclass(frozen=True, slots=True)
class Samples:
    """The completions of request ``request``, drawn with adapter ``version``."""

    session: int
    request: int
    version: int
    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    texts: list[str]
    logprobs: Tensor | None
    rng: dict[str, Tensor]
    """Generator states after sampling."""
    seconds: float
    """Time the engine spent on the request."""


@dataclass(frozen=True, slots=True)
class Drained:
    """Every request of ``session`` is answered or skipped."""

    session: int


@dataclass(frozen=True, slots=True)
class Failed:
    """The engine hit an error it cannot serve past; ``line`` says which, in one line."""

    line: str
