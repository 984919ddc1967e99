"""An update as the passes it asks for: what a learner's update needs of the model it trains
(log-probs of some rows, a backward pass of a loss, an optimizer step), as requests.

A GRPO-family update is written once, as a generator that yields these requests and receives
their answers (:meth:`pbt.algorithms.grpo.GRPO.learn_steps`). Alone, the learner answers each
request itself at once (:func:`run_alone`): the update is the plain sequence of forward,
backward and step calls it always was. In a population batch
(:mod:`pbt.algorithms.runtime.population_train`) several members' updates run in lock step and
one driver answers their log-prob requests with ONE forward over all their rows (each row
through its own member's adapter) and their backward requests with ONE backward of the sum of
their losses; each member's optimizer step stays its own.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from pbt.algorithms.rollout.hf import RolloutBatch, sequence_logprobs

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LogProbs:
    """Log-probs ``[N, C]`` of ``rows``' completion tokens at ``temperature``: with gradients
    (``grad``) or without; through the adapter, or the reference policy (the adapter
    disabled) when ``reference``. Answered with a tensor."""

    rows: RolloutBatch
    temperature: float
    grad: bool
    reference: bool = False


@dataclass(frozen=True, slots=True)
class Backward:
    """A backward pass of ``loss`` (gradients accumulate in the adapter). Answered with None."""

    loss: Tensor


@dataclass(frozen=True, slots=True)
class OptimizerStep:
    """The optimizer step that ends a mini-batch, with the mini-batch's ``loss`` (checked for
    NaN and inf). Answered with the gradient norm, or None when the step was skipped."""

    loss: float


Request = LogProbs | Backward | OptimizerStep
Steps = Generator[Request, Any, T]
"""An update as requests; its return value is the update's result."""


def run_alone(learner: Any, steps: Steps[T]) -> T:
    """Run ``steps`` with ``learner`` answering every request itself, on its own model."""
    reply: Any = None
    while True:
        try:
            request = steps.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = answer_alone(learner, request)


def answer_alone(learner: Any, request: Request) -> Any:
    """What ``learner`` answers ``request`` with, alone on its model."""
    if isinstance(request, Backward):
        request.loss.backward()
        return None
    if isinstance(request, OptimizerStep):
        return learner._optimizer_step(request.loss)
    model = learner.model
    with torch.set_grad_enabled(request.grad):
        if request.reference:
            with model.disable_adapter():
                return sequence_logprobs(model, request.rows, request.temperature)
        return sequence_logprobs(model, request.rows, request.temperature)
