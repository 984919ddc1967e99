"""Several members of one shared base trained together: their steps in lock step, their
rollouts in one batch (:mod:`~pbt.algorithms.runtime.population_batch`) and, with
``launch.batched_train``, their updates in one forward and one backward a micro-batch.

:func:`train_together` is the training loop of a process hosting several members (a campaign
worker given ``launch.members_per_batch`` tasks): every live member samples its prompts, all
their completions come from one batched rollout, each member scores its own, then learns. A
member's step is the step it takes alone: the same prompts, the same tokens, and (learning in
turn) the same update, bit for bit. A member whose step fails (it diverged) leaves the batch
with its error; one that collapses stops, as it would alone; the others go on.

:func:`learn_together` runs the members' updates (:meth:`~pbt.algorithms.grpo.GRPO.learn_steps`,
written as the passes they ask for, :mod:`pbt.algorithms.passes`) in lock step: the log-probs
every member asks for at one point come from ONE forward over all their rows, each row through
its own member's adapter (:class:`~pbt.algorithms.runtime.lora_batch.RowAdapters`, the exact
``segmented`` kernel), each member's log-probs at its own temperature; their losses go back in
ONE backward of their sum, so each adapter's gradient comes from its own member's rows and
loss only (each loss normalised as alone); each member's optimizer then steps its own adapter
(clipping, the non-finite check and the schedule its own). Where this departs from a member
alone: the base layers run over every member's rows at once, and the combined batch is padded
to its longest prompt and completion; a matrix product over more rows may round a row
differently (a BLAS picks its blocking by the shape), so the update equals the solo one to
within a few float32 ulps, not bit for bit (the test states the bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pbt.algorithms.passes import Backward, LogProbs, OptimizerStep, Request, Steps
from pbt.algorithms.rollout.hf import (
    chunked_token_logprobs,
    concat_batches,
    model_inputs,
    plain_output_layer,
    trim_padding,
    with_head_forward,
)
from pbt.algorithms.runtime.lora_batch import (
    RowAdapters,
    Segment,
    kernel_for,
    lora_layers,
    segments_of,
)
from pbt.algorithms.runtime.member import Member, StepCallback
from pbt.algorithms.runtime.models import mixed_precision
from pbt.algorithms.runtime.population_batch import (
    SharedMembers,
    batchable,
    complete_together,
    row_adapters,
)


@dataclass
class Trained:
    """What one member's training in a batch gave."""

    history: list[dict[str, float]] = field(default_factory=list)
    """Every step's metrics, each with its ``"step"``, as :meth:`Member.train` returns them."""
    error: BaseException | None = None
    """Why the member left the batch early (None: it trained every step, or collapsed)."""


def learns_together(shared: SharedMembers) -> bool:
    """Whether ``shared``'s members' updates can run as one (``launch.batched_train``): one
    process, an unsharded model whose only trainable tensors are LoRA matrices, no LoRA
    dropout (its draws would come from one stream, not each member's), and an output layer
    the lean log-prob path takes."""
    host, manifest = shared.host, shared.manifest
    layers = {name for name, _ in lora_layers(host.model)}
    lora = {f"{n}.lora_{ab}.default.weight" for n in layers for ab in "AB"}
    return (
        manifest.launch.batched_train
        and host.fsdp is None
        and host.world.world_size == 1
        and manifest.lora.dropout == 0
        and {name for name, _ in host.named_trainable} == lora
        and plain_output_layer(host.model) is not None
    )


def train_together(
    shared: SharedMembers,
    ids: Sequence[str],
    steps: int,
    on_step: Callable[[str], StepCallback | None] = lambda _: None,
    say: Callable[[str], Callable[[str], None] | None] = lambda _: None,
) -> dict[str, Trained]:
    """Train members ``ids`` of ``shared`` ``steps`` steps each, together (see the module).

    Args:
        on_step: a member's step callback (:meth:`Member.train`'s ``on_step``), by member id.
        say: where a member's explanations go (:meth:`Member.train`'s ``say``), by member id.
    """
    out = {member_id: Trained() for member_id in ids}
    members = {member_id: shared.member(member_id) for member_id in ids}
    if not _in_one_batch(shared, members.values()):
        for member_id, member in members.items():  # each in turn: its step is its own
            _alone(shared, member_id, member, steps, on_step, say, out[member_id])
        return out
    live = list(ids)
    for _ in range(steps):
        live = _one_step(shared, live, members, on_step, say, out)
        if not live:
            break
    return out


EVAL_ROWS = 64
"""Held-out questions a member puts in each batched evaluation call, as ``evaluate`` takes
them alone (``batch_size``)."""


def evaluate_together(shared: SharedMembers, ids: Sequence[str], temperature: float) -> dict:
    """Each member's held-out fitness (mean total reward on its task's eval split), their
    greedy completions sampled together, :data:`EVAL_ROWS` questions a member a batch: what
    :meth:`~pbt.algorithms.grpo.GRPO.evaluate` gives each alone. Sampled evaluations
    (``temperature`` > 0), multi-turn tasks and anything not batchable evaluate in turn."""
    members = {member_id: shared.member(member_id) for member_id in ids}
    if not (temperature == 0 and _in_one_batch(shared, members.values())):
        out = {}
        for member_id in ids:
            member = shared.activate(member_id)
            task = member.task
            out[member_id] = member.learner.evaluate(task.eval, task.reward, temperature)
        return out
    totals = dict.fromkeys(ids, 0.0)
    longest = max(len(m.task.eval) for m in members.values())
    for start in range(0, longest, EVAL_ROWS):
        chunks = {m: members[m].task.eval[start : start + EVAL_ROWS] for m in ids}
        chunks = {m: chunk for m, chunk in chunks.items() if chunk}
        questions = {m: [ex.chat for ex in chunk] for m, chunk in chunks.items()}
        batches = complete_together(shared, questions, training=False)
        for member_id, chunk in chunks.items():
            reward = members[member_id].task.reward
            totals[member_id] += float(reward(chunk, batches[member_id].texts)[0].sum())
    return {m: totals[m] / max(len(members[m].task.eval), 1) for m in ids}


def _in_one_batch(shared: SharedMembers, members) -> bool:
    """Whether ``members`` sample in one batch: ``shared`` batches, and each member's step is
    the plain one (:meth:`~pbt.algorithms.grpo.GRPO.plain_step`)."""
    return batchable(shared) and all(m.learner.plain_step(m.task.reward) for m in members)


def _alone(shared, member_id, member: Member, steps, on_step, say, trained: Trained) -> None:
    shared.activate(member_id)
    try:
        trained.history = member.train(steps, on_step(member_id), say(member_id))
    except Exception as err:  # the member's fault; the others train on
        trained.error = err


def _one_step(shared, live, members, on_step, say, out) -> list[str]:
    """One step of every member in ``live``; the members still training after it."""
    started, examples = {}, {}
    for member_id in live:
        learner = shared.activate(member_id).learner
        started[member_id] = time.perf_counter()
        examples[member_id] = learner.sample_prompts(members[member_id].task.train)
    questions = {m: [ex.chat for ex in examples[m]] for m in live}
    failed: dict[str, BaseException] = {}  # a diverged member whose rollout failed alone
    batches = complete_together(shared, questions, training=True, errors=failed)
    scored, learned = {}, dict(failed)
    for member_id in (m for m in live if m not in failed):
        member = shared.activate(member_id)
        try:  # a reward function that fails fails its member's task only
            scored[member_id] = member.learner.scored(
                examples[member_id], batches[member_id], member.task.reward
            )
        except Exception as err:
            learned[member_id] = err
    learned |= _learn(shared, {m: (b, r) for m, (b, r, _) in scored.items()})
    still = []
    for member_id in live:
        member, trained = shared.activate(member_id), out[member_id]
        if isinstance(learned[member_id], BaseException):
            trained.error = learned[member_id]
            continue
        batch, _, terms = scored[member_id]
        metrics = member.learner.step_metrics(
            learned[member_id], member.task.reward, terms, batch, started[member_id]
        )
        if not member.record_step(metrics, trained.history, on_step(member_id), say(member_id)):
            still.append(member_id)
    return still


def _learn(shared, scored: dict[str, tuple[Any, Tensor]]) -> dict[str, Any]:
    """Each member's update from its scored batch: together, or in turn."""
    if not scored:
        return {}
    if learns_together(shared):
        steps = {m: shared.member(m).learner.learn_steps(b, r) for m, (b, r) in scored.items()}
        return learn_together(shared, steps)
    learned: dict[str, Any] = {}
    for member_id, (batch, rewards) in scored.items():
        learner = shared.activate(member_id).learner
        try:
            learned[member_id] = learner.learn(batch, rewards)
        except Exception as err:
            learned[member_id] = err
    return learned


def learn_together(shared: SharedMembers, steps: dict[str, Steps]) -> dict[str, Any]:
    """Run members' updates in lock step (see the module): ``steps`` maps a member id to its
    update's passes; returns each member's result, or the exception its update raised."""
    adapters = row_adapters(shared, len(steps))
    slots = {member_id: slot for slot, member_id in enumerate(steps)}
    names = [name for name, _ in shared.host.named_trainable]
    shared.store_active()
    for member_id, slot in slots.items():
        adapters.load(slot, dict(zip(names, shared.adapter_of(member_id), strict=True)))
    results: dict[str, Any] = {}
    replies: dict[str, Any] = dict.fromkeys(steps)
    for t in adapters.a + adapters.b:
        t.requires_grad_(True)
    try:
        while replies:
            pending = _advance(steps, replies, results)
            replies = _answer(shared, adapters, slots, pending, results)
    finally:
        for t in adapters.a + adapters.b:
            t.requires_grad_(False)
            t.grad = None
    return results


def _advance(steps, replies, results) -> dict[str, Request]:
    """Send each member its reply; its next request, or its result (or error) once done."""
    pending = {}
    for member_id, reply in replies.items():
        try:
            pending[member_id] = steps[member_id].send(reply)
        except StopIteration as stop:
            results[member_id] = stop.value
        except Exception as err:
            results[member_id] = err
    return pending


def _answer(shared, adapters, slots, pending: dict[str, Request], results) -> dict[str, Any]:
    """Answer every pending request: the backward passes first (one, of the losses' sum: the
    graph of the last forward), then the optimizer steps (each member's own; no graph holds
    the adapters then), then the forward passes, those of one kind in one pass."""
    replies: dict[str, Any] = {}
    backward = {m: r for m, r in pending.items() if isinstance(r, Backward)}
    if backward:
        backward_together([r.loss for r in backward.values()])
        replies |= dict.fromkeys(backward)
    for member_id, request in pending.items():
        if isinstance(request, OptimizerStep):
            try:
                replies[member_id] = _step(shared, adapters, slots[member_id], member_id, request)
            except Exception as err:
                results[member_id] = err
    asks = {m: r for m, r in pending.items() if isinstance(r, LogProbs)}
    kernel = kernel_for(shared.manifest.launch.lora_kernel, shared.host.device)
    for kind in ((False, True), (False, False), (True, False)):  # (grad, reference)
        group = {m: r for m, r in asks.items() if (r.grad, r.reference) == kind}
        if group:
            replies |= logprobs_together(shared.host.model, adapters, slots, group, kernel)
    return replies


def backward_together(losses: list[Tensor]) -> None:
    """ONE backward of the members' losses' sum; a non-finite loss is left out (its gradient
    zero, not NaN, so it reaches no other member's adapter through a stacked product): its
    member skips the step on its non-finite loss, as alone."""
    stacked = torch.stack(losses)
    torch.where(torch.isfinite(stacked), stacked, 0.0).sum().backward()


def _step(shared, adapters: RowAdapters, slot: int, member_id: str, request: OptimizerStep):
    """The member's optimizer step on its own adapter: its gradients (its slot's) moved into
    the model's adapter slot with its weights, its optimizer stepped, its weights kept."""
    learner = shared.activate(member_id).learner
    grads = adapters.named_grads(slot)
    for name, param in shared.host.named_trainable:
        param.grad = grads[name]  # a view: clipped in place, then zeroed below
    norm = learner._optimizer_step(request.loss)
    live = [t.grad[slot] for t in adapters.a + adapters.b if t.grad is not None]
    if live:
        torch._foreach_zero_(live)
    adapters.load_from_model(slot)
    return norm


def logprobs_together(
    model,
    adapters: RowAdapters,
    slots: dict[str, int],
    asks: dict[str, LogProbs],
    kernel: str = "segmented",
) -> dict[str, Tensor]:
    """Every ask's log-probs from ONE forward over all their rows, each member's rows through
    its slot's adapter (or none, for the reference policy; ``kernel``: see
    :mod:`~pbt.algorithms.runtime.lora_batch`), each at its own temperature: for each member,
    what :func:`~pbt.algorithms.rollout.hf.sequence_logprobs` gives it alone."""
    first = next(iter(asks.values()))
    trimmed = {m: trim_padding(ask.rows) for m, ask in asks.items()}
    # the padding's ids are masked out: any id gives the real positions the same values
    combined = concat_batches([rows for rows, _ in trimmed.values()], pad_id=0)
    sizes = [len(rows) for rows, _ in trimmed.values()]
    segments = tuple(
        Segment(s.start, s.stop, slots[m]) for s, m in zip(segments_of(sizes), asks, strict=True)
    )
    head = plain_output_layer(model)
    inputs = model_inputs(combined)
    width = combined.completion_ids.shape[1]
    parts: dict[str, Tensor] = {}

    def forward(hidden: Tensor) -> Tensor:  # [N, C + 1, H]: the last C + 1 positions
        for (member_id, (rows, _)), s in zip(trimmed.items(), segments, strict=True):
            parts[member_id] = chunked_token_logprobs(  # [n, C_m]: as alone
                hidden[s.start : s.stop, : rows.completion_ids.shape[1]],
                head.weight,
                head.bias,
                rows.completion_ids,
                asks[member_id].temperature,
            )
        return hidden[:, :0, 0]  # the log-probs leave through ``parts``

    def run(kernel: str) -> None:
        rows_in = (
            model.disable_adapter()
            if first.reference
            else adapters.rows(segments, kernel, keep_masks=False)
        )
        with torch.set_grad_enabled(first.grad), mixed_precision(model), rows_in:
            with_head_forward(model, head, forward, inputs, width + 1)

    run(kernel)
    # a backward through the stacked products sums over every row, and 0 x inf is NaN: a
    # member whose forward went non-finite is run again with the rest, segmented
    stacked = first.grad and adapters.kernel(segments, kernel) == "stacked"
    if stacked and not bool(torch.isfinite(torch.stack([p.sum() for p in parts.values()])).all()):
        run("segmented")
    return {
        member_id: torch.nn.functional.pad(parts[member_id], (0, right))
        if right
        else parts[member_id]
        for member_id, (_, right) in trimmed.items()
    }
