"""The trainer's side of dedicated and asynchronous rollouts: which prompts the engine samples
next, which samples are fresh enough to learn from, and how the rest are weighted.

A member with ``launch.rollout_gpus_per_member > 0`` samples its training batches on its own
engine process (:mod:`pbt.algorithms.rollout.remote`). Versions count the optimizer steps of
the current session (one training run of the member): the engine starts each session serving
version 0, the member's adapter as loaded, and the trainer sends the adapter again after every
training step that stepped the optimizer.

- ``rollout.max_staleness: 0`` (``mode: sync``, or ``async`` with no lag allowed): lockstep.
  Each request is sent when the trainer needs its batch, asks for the trainer's current
  version and carries the member's generator state; the engine samples from that state and
  hands back the state after sampling, which the trainer adopts. The engine computes what the
  trainer's own ``generate`` would have, so the member trains exactly as a colocated one.
- ``max_staleness: s > 0``: the trainer keeps ``s // k`` batches requested ahead (``k``
  optimizer steps per training step), so the engine samples the next batches while the trainer
  learns from this one, each with the newest adapter that has arrived. A batch drawn more than
  ``s`` optimizer steps ago is dropped (counted in ``stale_dropped``) and asked for again with
  the current adapter; the rest are corrected by truncated importance weights
  (:func:`behaviour_weights`).

At the end of a session (a generation boundary, a checkpoint) the engine drains: requests
still queued are skipped, and the data position is rewound to the first prompts not learned
from, so the checkpoint holds exactly what training consumed, and a copied or resumed member
starts a clean session.
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pbt.algorithms import losses
from pbt.algorithms.rollout.engine_messages import (
    AdapterUpdate,
    Drain,
    Drained,
    SampleRequest,
    Samples,
    Served,
)
from pbt.algorithms.rollout.engine_place import (
    EngineReporter,
    engine_device,
    engine_placement,
)
from pbt.algorithms.rollout.hf import RolloutBatch
from pbt.algorithms.rollout.remote import (
    EngineFailure,
    EngineProcess,
    EngineSpec,
    RolloutEngineError,
    get_rng,
    set_rng,
)
from pbt.config import AlgorithmConfig

SEQUENCE_LEVEL = ("gspo",)
"""Objectives whose ratio is per sequence: their stale samples are weighted per sequence."""


def optimizer_steps_per_batch(algorithm: AlgorithmConfig, world_size: int) -> int:
    """Optimizer steps one training step takes: ``update_epochs`` x mini-batches."""
    rows = algorithm.batch_completions // world_size
    mini = (algorithm.mini_batch_size or algorithm.batch_completions) // world_size
    return algorithm.update_epochs * max(1, math.ceil(rows / max(mini, 1)))


def fresh_rows(versions: Tensor, current: int, max_staleness: int) -> Tensor:
    """``[N]`` bool: rows drawn at most ``max_staleness`` optimizer steps before ``current``."""
    return (current - versions) <= max_staleness


def behaviour_weights(
    objective: str,
    trainer_logp: Tensor,
    sampler_logp: Tensor,
    stale: Tensor,
    mask: Tensor,
    cap: float,
) -> tuple[Tensor, Tensor]:
    """Truncated importance weights ``[N, T]`` (no gradient) of samples drawn with an older
    adapter, and where the cap bit: ``min(p_trainer / p_sampler, cap)``, per token, or per
    sequence (the exp of the mean token log-ratio) for the objectives in
    :data:`SEQUENCE_LEVEL`, as their own ratio is. Rows not ``stale`` weigh exactly 1: the
    adapter that drew them is the one being trained.

    Args:
        trainer_logp, sampler_logp: ``[N, T]`` log-probs of the sampled tokens under the
            trainer's adapter before this update, and under the sampler's.
        stale: ``[N]`` bool, rows drawn with an older adapter.
        mask: ``[N, T]`` the completion mask.
        cap: the truncation, > 0.
    """
    log_ratio = losses.log_ratio(trainer_logp.detach(), sampler_logp, mask)
    log_ratio = torch.where(stale.unsqueeze(1) & (mask != 0), log_ratio, 0.0)
    if objective in SEQUENCE_LEVEL:
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        log_ratio = (log_ratio.sum(dim=1, keepdim=True) / lengths).expand_as(mask)
    ratio = torch.exp(log_ratio)
    return ratio.clamp(max=cap), ratio > cap


@dataclass(slots=True)
class _Pending:
    """A request sent and not learned from yet."""

    msg: SampleRequest
    examples: list[Any]
    data_state: dict[str, Any]
    """The learner's data position before these prompts were taken."""


class DedicatedRollouts:
    """One session of a learner with its engine: requests, versions, drops, weights.

    Args:
        engine: the engine process (kept by the host across sessions).
        learner: the GRPO-family learner it samples for; its ``rollouts`` is set to this.
    """

    def __init__(self, engine: EngineProcess, learner) -> None:
        self.engine, self.learner = engine, learner
        cfg = learner.rollout_cfg
        self.max_staleness = cfg.max_staleness
        self.cap = cfg.staleness_cap
        k = optimizer_steps_per_batch(learner.algorithm, learner.world_size)
        self.ahead = self.max_staleness // k
        """Batches requested beyond the one being learned from; 0 is lockstep."""
        self.version = 0
        self.served = -1
        self.session = 0
        self.pending: deque[_Pending] = deque()
        self.arrived: dict[int, Samples] = {}
        self._next_request = 0
        self.stale_dropped = 0
        """Rows dropped this session for lagging past ``max_staleness``."""

    @property
    def lockstep(self) -> bool:
        """Whether every batch is drawn with the current adapter from the member's stream:
        nothing is requested ahead (``max_staleness`` below one training step's optimizer
        steps)."""
        return self.ahead == 0

    # -- the session -----------------------------------------------------------------------

    def begin(self) -> None:
        """Start a session: the engine serves the learner's adapter as version 0."""
        self.session = self.engine.begin()
        self.learner.rollouts = self
        self._guarded(self._send_adapter, "adapter version 0")
        self._guarded(lambda: self._confirm(0), "adapter version 0")

    def end(self) -> None:
        """Drain: skip what is still queued, rewind the data position to the first prompts not
        learned from, and forget the session."""
        self.learner.rollouts = None
        if self.pending:
            self.learner.data.load_state_dict(self.pending[0].data_state)
        self.pending.clear()
        self.arrived.clear()
        old = self.session
        self.engine.begin()  # a new session number: the engine skips the old requests
        self._guarded(functools.partial(self._drain, old), "the drain")

    def _drain(self, session: int) -> None:
        self.engine.send(Drain(session))
        self.engine.receive("the drain", lambda m: isinstance(m, Drained) and m.session == session)

    def push(self, steps: int) -> None:
        """After a training step that took ``steps`` optimizer steps: send the new adapter."""
        if steps <= 0:
            return
        self.version += steps
        self._guarded(self._send_adapter, f"adapter version {self.version}")

    # -- batches ---------------------------------------------------------------------------

    def take(self, train: Sequence) -> tuple[list[Any], RolloutBatch, dict[str, float]]:
        """The examples and completions of the next training step, with its metrics:
        ``stale_dropped`` (rows drawn too long ago, dropped and drawn again),
        ``rollout_staleness`` (optimizer steps behind, of the rows kept) and
        ``rollout_wait_s`` (time the trainer waited for them)."""
        start = time.perf_counter()
        self._fill(train, 1 + self.ahead)
        dropped = 0
        while True:
            head = self.pending[0]
            samples = self._guarded(functools.partial(self._result, head.msg.request), "a batch")
            if (self.version - samples.version) <= self.max_staleness:
                break
            dropped += len(samples.texts)
            self.pending[0] = self._resubmit(head)
        self.pending.popleft()
        self.stale_dropped += dropped
        if self.lockstep:
            set_rng(samples.rng, self.learner.device)
        waited = time.perf_counter() - start
        self._fill(train, self.ahead)  # the engine samples the next batches while this one trains
        metrics = {
            "stale_dropped": float(dropped),
            "rollout_staleness": float(self.version - samples.version),
            "rollout_wait_s": waited,
            "engine_version": float(self.served),
        }
        return head.examples, self._batch(samples), metrics

    def settle(self) -> None:
        """Wait until every batch requested ahead has arrived (benchmarks and tests use it to
        fix which adapter each was drawn with)."""
        for item in list(self.pending):
            request = item.msg.request
            samples = self._guarded(functools.partial(self._result, request), f"batch {request}")
            self.arrived[request] = samples

    def _batch(self, s: Samples) -> RolloutBatch:
        device = self.learner.device
        return RolloutBatch(
            s.prompt_ids.to(device), s.prompt_mask.to(device), s.completion_ids.to(device),
            s.completion_mask.to(device), list(s.texts),
            None if s.logprobs is None else s.logprobs.to(device),
            torch.full((len(s.texts),), s.version, dtype=torch.long),
        )  # fmt: skip

    def _fill(self, train: Sequence, count: int) -> None:
        while len(self.pending) < count:
            state = self.learner.data.state_dict()
            examples = self.learner.sample_prompts(train)
            self.pending.append(_Pending(self._request(examples), examples, state))

    def _request(self, examples: list[Any]) -> SampleRequest:
        learner = self.learner
        rng = None
        if self.lockstep or self._next_request == 0:
            rng = get_rng(learner.device)
        msg = SampleRequest(
            self.session, self._next_request, [ex.chat for ex in examples],
            learner.algorithm.group_size, learner.rollout_cfg, self.version, rng,
            not self.lockstep,
        )  # fmt: skip
        self._next_request += 1
        self._guarded(lambda: self.engine.send(msg), "a batch")
        return msg

    def _resubmit(self, head: _Pending) -> _Pending:
        return _Pending(self._request(head.examples), head.examples, head.data_state)

    def _result(self, request: int) -> Samples:
        while request not in self.arrived:
            msg = self.engine.receive(f"batch {request}")
            if isinstance(msg, Samples) and msg.session == self.session:
                self.arrived[msg.request] = msg
            elif isinstance(msg, Served) and msg.session == self.session:
                self.served = max(self.served, msg.version)
        return self.arrived.pop(request)

    def _send_adapter(self) -> None:
        tensors = [p.detach().to("cpu", copy=True) for _, p in self.learner.named_params]
        self.engine.send_adapter(AdapterUpdate(self.session, self.version, tensors))

    def _confirm(self, version: int) -> None:
        while self.served < version:
            msg = self.engine.receive(f"adapter version {version}")
            if isinstance(msg, Served) and msg.session == self.session:
                self.served = max(self.served, msg.version)
            elif isinstance(msg, Samples) and msg.session == self.session:
                self.arrived[msg.request] = msg

    # -- faults ----------------------------------------------------------------------------

    def _guarded(self, action, waiting_for: str):
        """``action()``; an engine that fails is restarted once (the session's current adapter
        and its pending requests sent again), and a second failure fails the member."""
        while True:
            try:
                return action()
            except EngineFailure as err:
                failure = err
            if self.engine.restarts >= 1:
                raise RolloutEngineError(
                    f"{failure}; it was restarted once already, so the member stops here "
                    f"(waiting for {waiting_for}): check the engine's memory and device, or "
                    "raise rollout.engine_timeout_s / rollout.engine_heartbeat_s"
                )
            print(f"warning: {failure}; restarting it", flush=True)
            try:
                self._restart()
            except EngineFailure as err:
                raise RolloutEngineError(f"{err}; the restarted engine did not come up") from None

    def _restart(self) -> None:
        self.engine.restart()
        self.engine.begin(self.session)
        self.served = -1
        self.arrived.clear()
        self._send_adapter()
        for item in self.pending:
            self.engine.send(item.msg)


@contextmanager
def dedicated_rollouts(
    host, learner, member_id: str, status_dir: Path | None = None
) -> Iterator[DedicatedRollouts | None]:
    """While the block runs, ``learner`` samples its training batches on the host's dedicated
    engine (started on first use, kept for the host's later members), which reports to
    ``status_dir`` (:class:`EngineReporter`); nothing when the member has no engine
    (``launch.rollout_gpus_per_member: 0``, or ``auto`` resolved to none)."""
    manifest = host.manifest
    placement = engine_placement(manifest, learner.device)
    if placement.engines_per_member == 0:
        yield None
        return
    engine = host.rollout_engine
    name = f"{member_id}'s rollout engine {host.world.rank}"
    if engine is None:
        device = engine_device(placement, learner.device)
        spec = EngineSpec(manifest, device, torch.get_num_threads())
        cfg = manifest.rollout
        engine = start_engine(spec, name, cfg.engine_timeout_s, cfg.engine_heartbeat_s)
        host.rollout_engine = engine
    engine.name = name
    session = DedicatedRollouts(engine, learner)
    reporter = EngineReporter(session, member_id, host.world.rank, placement.kind, status_dir)
    try:
        session.begin()
        reporter.start()
        yield session
    except BaseException as err:
        learner.rollouts = None  # the engine may be the fault: no drain to wait for
        reporter.stop("failed" if isinstance(err, RolloutEngineError) else "stopped")
        raise
    session.end()
    reporter.stop("drained")


def start_engine(spec: EngineSpec, name: str, timeout_s: float, heartbeat_s: float):
    """Start an engine process, or fail the member with one line."""
    try:
        return EngineProcess(spec, name, timeout_s, heartbeat_s)
    except EngineFailure as err:
        raise RolloutEngineError(f"{err}; the member cannot sample") from None
