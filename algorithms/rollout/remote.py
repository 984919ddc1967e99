"""A dedicated rollout engine: its own process, holding the base model and serving one member's
current adapter with one of our engines (Hugging Face ``generate`` or the static-cache
decoder), while the member's trainer steps.

The engine process (:func:`engine_main`) loads the model once and then loops: it takes every
adapter that has arrived (only the adapter tensors cross, after each optimizer step) and
confirms the version it now serves; it takes the next sampling request, waits if the request
needs a newer adapter, samples, and returns the completions tagged with the version they were
drawn with, the sampler's log-probs when asked, and its generator state. A thread beats a
shared clock while the process lives.

The trainer's side is :class:`EngineProcess`: it starts the process (``spawn``: a fresh
interpreter, no CUDA state inherited), sends, and receives with a deadline. While it waits it
watches the process: one that died (its exit code), stopped beating for
``rollout.engine_heartbeat_s`` (hung), or did not answer within ``rollout.engine_timeout_s``
raises :class:`EngineFailure` naming the engine; the caller restarts it once
(:meth:`EngineProcess.restart`) or fails the member with one line (:class:`RolloutEngineError`).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from pbt.algorithms.rollout.engine_messages import (
    PROTOCOL,
    AdapterUpdate,
    Drain,
    Drained,
    Failed,
    Ready,
    SampleRequest,
    Samples,
    Served,
    Stop,
)
from pbt.algorithms.runtime.models import set_mode
from pbt.config import Manifest
from pbt.config.errors import PbtError

POLL_S = 0.1
"""How often a waiting side looks at the process and the heartbeat."""


class RolloutEngineError(PbtError):
    """A member's dedicated rollout engine failed and could not be brought back: the member's
    task fails with this one line."""


class EngineFailure(Exception):
    """An engine died, hung or missed a deadline; ``str()`` is one line naming it."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What an engine process is started with."""

    manifest: Manifest
    device: str
    """``cpu`` or ``cuda:N``: the engine's device: a GPU of its own after the trainer's
    (``dedicated``), or its trainer rank's (``shared`` under MPS, or the CPU)."""
    threads: int
    """Intra-op CPU threads: the trainer's, so CPU sampling computes what the trainer would."""


def engine_main(spec: EngineSpec, requests, adapters, replies, beat, session) -> None:
    """The engine process: load, announce, serve until :class:`Stop` (see the module)."""
    threading.Thread(target=_beat, args=(beat,), daemon=True).start()
    try:
        torch.set_num_threads(spec.threads)
        server = _Server(spec, adapters, replies, session)
        replies.put(Ready(os.getpid(), PROTOCOL, str(server.params[0].device)))
        server.serve(requests)
    except Exception as err:  # one line back to the trainer, then exit non-zero
        replies.put(Failed(f"{type(err).__name__}: {err}".splitlines()[0]))
        raise SystemExit(1) from None


def _beat(beat) -> None:
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # the trainer is gone: nobody will read another sample
            os._exit(0)
        beat.value = time.time()
        time.sleep(POLL_S)


class _Server:
    """The engine's model and its current adapter, in the engine process."""

    def __init__(self, spec: EngineSpec, adapters, replies, session) -> None:
        from pbt.algorithms.runtime.models import (
            add_lora,
            load_base_model,
            load_tokenizer,
            quiet_transformers,
            set_mixed_precision,
        )
        from pbt.distributed.state import trainable_parameters

        quiet_transformers()
        m = spec.manifest
        self.device = torch.device(spec.device)
        self.tokenizer = load_tokenizer(m.model, m.base_dir)
        self.model = add_lora(load_base_model(m.model, self.device, m.base_dir), m.lora)
        set_mixed_precision(self.model, m.training.mixed_precision)
        set_mode(self.model, False)
        self.params = [p for _, p in trainable_parameters(self.model)]
        self.adapters, self.replies, self.session = adapters, replies, session
        self.served = (-1, -1)  # (session, version)

    def serve(self, requests) -> None:
        while True:
            try:
                msg = requests.get(timeout=POLL_S)
            except queue.Empty:
                self._take_adapters(block=False)
                continue
            if isinstance(msg, Stop):
                return
            if isinstance(msg, Drain):
                self.replies.put(Drained(msg.session))
            elif msg.session == self.session.value:  # an older session's request is dropped
                self._take_adapters(block=False)
                while self.served < (msg.session, msg.min_version):
                    if msg.session != self.session.value:
                        break
                    self._take_adapters(block=True)
                else:
                    self.replies.put(self._sample(msg))

    def _take_adapters(self, block: bool) -> None:
        """Load every adapter that has arrived (waiting for one when ``block``)."""
        while True:
            try:
                update: AdapterUpdate = self.adapters.get(timeout=POLL_S if block else 0.0)
            except queue.Empty:
                return
            block = False
            with torch.no_grad():
                for param, tensor in zip(self.params, update.tensors, strict=True):
                    param.copy_(tensor)
            self.served = (update.session, update.version)
            self.replies.put(Served(update.session, update.version))

    @torch.no_grad()
    def _sample(self, msg: SampleRequest) -> Samples:
        from pbt.algorithms.rollout.hf import generate, sequence_logprobs

        start = time.perf_counter()
        if msg.rng is not None:
            set_rng(msg.rng, self.device)
        batch = generate(
            self.model, self.tokenizer, msg.questions, msg.rollout, repeats=msg.repeats
        )
        rng = get_rng(self.device)
        logprobs = None
        if msg.logprobs:
            logprobs = sequence_logprobs(self.model, batch, msg.rollout.temperature)
        return Samples(
            msg.session, msg.request, self.served[1], batch.prompt_ids.cpu(),
            batch.prompt_mask.cpu(), batch.completion_ids.cpu(), batch.completion_mask.cpu(),
            batch.texts, None if logprobs is None else logprobs.float().cpu(), rng,
            time.perf_counter() - start,
        )  # fmt: skip


def get_rng(device: torch.device) -> dict[str, torch.Tensor]:
    """The generator states sampling on ``device`` draws from."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Set what :func:`get_rng` returned."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class EngineProcess:
    """The trainer's handle on one engine process.

    Args:
        spec: what the engine loads and where.
        name: how messages name it, e.g. ``"member-3's rollout engine 0"``.
        timeout_s: the longest wait for a reply (``rollout.engine_timeout_s``).
        heartbeat_s: the oldest heartbeat of a live engine (``rollout.engine_heartbeat_s``).
    """

    def __init__(self, spec: EngineSpec, name: str, timeout_s: float, heartbeat_s: float) -> None:
        self.spec, self.name = spec, name
        self.timeout_s, self.heartbeat_s = timeout_s, heartbeat_s
        self.restarts = 0
        self.device = spec.device
        """Where the engine's model lives, as the engine reported it once started."""
        self.process: Any = None
        self._session = 0
        self._start()

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return None if self.process is None else self.process.pid

    def describe(self) -> str:
        """The engine in words, for messages."""
        return f"{self.name} (pid {self.pid})"

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.requests, self.adapters, self.replies = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.beat = ctx.Value("d", time.time(), lock=False)
        self.session = ctx.Value("i", self._session, lock=False)
        args = (self.spec, self.requests, self.adapters, self.replies, self.beat, self.session)
        self.process = ctx.Process(target=engine_main, args=args, daemon=True, name="pbt-rollout")
        self.process.start()
        # no heartbeat yet: the process imports torch and loads the model before it beats
        ready = self.receive("start", until=lambda m: isinstance(m, Ready), beating=False)
        if ready.protocol != PROTOCOL:
            raise EngineFailure(
                f"{self.describe()} speaks protocol {ready.protocol}, not {PROTOCOL}"
            )
        self.device = ready.device

    def restart(self) -> None:
        """Stop the process (whatever state it is in) and start a fresh one."""
        self.kill()
        self.restarts += 1
        self._start()

    def begin(self, session: int | None = None) -> int:
        """Serve ``session`` (default: a new one) from now on: requests of other sessions still
        queued are skipped. Returns the session."""
        self._session = self._session + 1 if session is None else session
        self.session.value = self._session
        return self._session

    def send_adapter(self, update: AdapterUpdate) -> None:
        self.adapters.put(update)

    def send(self, msg: SampleRequest | Drain) -> None:
        self.requests.put(msg)

    def receive(self, waiting_for: str, until=None, beating: bool = True) -> Any:
        """The next reply (the next one ``until`` accepts, others dropped).

        Raises:
            EngineFailure: the process died, hung, failed, or sent nothing within the timeout.
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                msg = self.replies.get(timeout=POLL_S)
            except queue.Empty:
                self._check(waiting_for, deadline, beating)
                continue
            except Exception as err:  # a message torn by a dying process
                raise EngineFailure(f"{self.describe()} sent a broken reply: {err}") from None
            if isinstance(msg, Failed):
                raise EngineFailure(f"{self.describe()} failed: {msg.line}")
            if until is None or until(msg):
                return msg

    def _check(self, waiting_for: str, deadline: float, beating: bool) -> None:
        if not self.process.is_alive():
            raise EngineFailure(
                f"{self.describe()} died (exit code {self.process.exitcode}) while the trainer "
                f"waited for {waiting_for}"
            )
        silent = time.time() - self.beat.value
        if beating and silent > self.heartbeat_s:
            raise EngineFailure(
                f"{self.describe()} is hung: no heartbeat for {silent:.0f} s "
                f"(rollout.engine_heartbeat_s {self.heartbeat_s:g}) while the trainer waited "
                f"for {waiting_for}"
            )
        if time.monotonic() > deadline:
            raise EngineFailure(
                f"{self.describe()} sent no {waiting_for} within rollout.engine_timeout_s "
                f"({self.timeout_s:g} s)"
            )

    def close(self) -> None:
        """Ask the process to exit; kill it if it does not within a few seconds."""
        if self.process is None:
            return
        if self.process.is_alive():
            self.requests.put(Stop())
            self.process.join(timeout=5.0)
        self.kill()

    def kill(self) -> None:
        """End the process now (a stopped one too) and reap it."""
        if self.process is None:
            return
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10.0)
        for q in (self.requests, self.adapters, self.replies):
            q.cancel_join_thread()
            q.close()
        self.process = None
