"""What the controller shows while a generation trains: each running member's step, reward,
tokens/s and ETA, read from its heartbeat (:mod:`pbt.protocol.progress`), and the
generation's and the campaign's ETA.

On a terminal, a tqdm bar per running member under a line with the ETAs, redrawn twice a
second and cleared when the launcher's round ends (the controller prints its own lines, such
as each member's ``done``, between rounds, so nothing is drawn over them). Elsewhere (a pipe,
a file, a batch job's log), a plain line per running member and one with the ETAs, every
``every_s`` seconds (``tracking.progress_every_s``), each only when it changed since it was
last printed (a member that is starting is said to be once)::

      g000-m01 step 3/10 reward 0.410 312 tok/s eta 12 s
      generation 0: 2 running, 2 queued; eta 41 s; campaign eta 3 min 05 s

The estimates: a member's ETA is its own (steps left x its mean step time). The generation's
puts each queued task on the first slot to free up, for the typical time of a task (the mean of
this generation's ended ones; before any ended, the running ones' elapsed time plus ETA). The
campaign's adds the generations left after this one times the mean generation time so far (in
the first generation, this one's estimate). Each is "unknown" until there is something to
estimate it from.
"""

from __future__ import annotations

import heapq
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from pbt.launch.local import TaskSpec
from pbt.protocol.progress import Progress, read_progress

EVERY_S = 10.0
"""Seconds between the plain progress lines by default (a campaign's
``tracking.progress_every_s``)."""
REFRESH_S = 0.5
"""Seconds between redraws of the bars."""


def format_duration(seconds: float | None) -> str:
    """``12 s``, ``3 min 05 s``, ``2 h 04 min``; ``unknown`` for None."""
    if seconds is None:
        return "unknown"
    s = round(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def describe(progress: Progress | None, now: float | None = None, step: bool = True) -> str:
    """A member's progress in words: ``step 3/10 reward 0.410 312 tok/s eta 12 s`` (without
    its first two words when not ``step``), or its phase (``starting`` before it reported
    anything); ``now`` is the wall time the ETA counts down to (default: now)."""
    if progress is None:
        return "starting"
    p = progress
    if p.phase == "loading":
        return "loading"
    if p.phase in ("evaluating", "saving"):
        return f"{p.phase} after step {p.step}/{p.steps}" if step else p.phase
    words = [f"step {p.step}/{p.steps}"] if step else []
    if p.reward is not None:
        words.append(f"reward {p.reward:.3f}")
    if p.tokens_per_s is not None:
        words.append(f"{p.tokens_per_s:.0f} tok/s")
    if p.step:
        words.append(f"eta {format_duration(p.eta_now(now))}")
    return " ".join(words)


@dataclass(frozen=True, slots=True)
class Plan:
    """What the display knows of the campaign."""

    generation: int
    generations: int
    """The budget's generations; the campaign's ETA counts those after ``generation``."""
    slots: int
    """Tasks run at once."""
    mean_generation_s: float | None = None
    """The mean time of the generations trained so far; None before the first ended."""


@dataclass(frozen=True, slots=True)
class _Member:
    task_id: str
    progress: Progress | None
    elapsed: float
    """Seconds since the display first saw it running."""


class ProgressDisplay:
    """Shows a generation's progress; its :meth:`poll` is the launcher's ``on_poll`` hook.

    Used once per generation, and entered once per launcher round: leaving clears the bars.

    Args:
        plan: the generation and what its ETA depends on.
        say: where the plain lines go (the controller's own output).
        stream: where the bars are drawn (default stdout).
        terminal: draw bars (True) or write plain lines (False); default: whether ``stream``
            is a terminal.
        every_s: seconds between plain lines; 0 writes none.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        plan: Plan,
        say: Callable[[str], object] = print,
        stream: TextIO | None = None,
        terminal: bool | None = None,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plan, self.say, self.every_s, self.clock = plan, say, every_s, clock
        self.stream = sys.stdout if stream is None else stream
        self.terminal = _is_terminal(self.stream) if terminal is None else terminal
        self._started = clock()
        self._seen: dict[str, float] = {}
        self._durations: list[float] = []
        self._bars: dict[str, tqdm] = {}
        self._head: tqdm | None = None
        self._next_draw = self._started
        self._next_lines = self._started + every_s
        self._said: dict[str, str] = {}  # the last plain line of each member, "" the ETAs'

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def poll(self, running: Sequence[TaskSpec], queued: Sequence[TaskSpec]) -> None:
        """Note which tasks run and, when it is time, show their progress."""
        now = self.clock()
        self._track({t.task_id for t in running}, now)
        if not running:  # the round's last task just ended
            return
        if self.terminal and now >= self._next_draw:
            self._next_draw = now + REFRESH_S
            self._draw(self._members(running, now), len(queued), now)
        elif not self.terminal and self.every_s > 0 and now >= self._next_lines:
            self._next_lines = now + self.every_s
            self._lines(self._members(running, now), len(queued), now)

    def close(self) -> None:
        """The round ended: every task seen ended with it; clear the bars."""
        self._track(set(), self.clock())
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()
        if self._head is not None:
            self._head.close()
            self._head = None

    # -- estimates ---------------------------------------------------------------------------

    def _track(self, running: set[str], now: float) -> None:
        for task_id, since in list(self._seen.items()):
            if task_id not in running:
                self._durations.append(now - since)
                del self._seen[task_id]
        for task_id in running:
            self._seen.setdefault(task_id, now)

    def _members(self, running: Sequence[TaskSpec], now: float) -> list[_Member]:
        return [
            _Member(
                t.task_id,
                read_progress(Path(t.task_dir) / "heartbeat"),
                now - self._seen[t.task_id],
            )
            for t in running
        ]

    def _estimates(
        self, members: list[_Member], queued: int, now: float
    ) -> tuple[float | None, float | None]:
        """Seconds left in the generation and in the campaign (None: unknown)."""
        ended = sum(self._durations) / len(self._durations) if self._durations else None
        generation = _generation_eta(members, queued, self.plan.slots, ended)
        if generation is None:
            return None, None
        plan = self.plan
        per_generation = plan.mean_generation_s
        if per_generation is None:
            per_generation = now - self._started + generation
        later = max(0, plan.generations - plan.generation - 1)
        return generation, generation + later * per_generation

    # -- output ------------------------------------------------------------------------------

    def _summary(self, members: list[_Member], queued: int, now: float) -> str:
        generation, campaign = self._estimates(members, queued, now)
        return (
            f"generation {self.plan.generation}: {len(members)} running, {queued} queued; "
            f"eta {format_duration(generation)}; campaign eta {format_duration(campaign)}"
        )

    def _lines(self, members: list[_Member], queued: int, now: float) -> None:
        """Each member's line and the ETAs, each only when it says something new: a member
        still starting (or stalled at a step) is not repeated every ``every_s``."""
        lines = [(m.task_id, f"  {m.task_id} {describe(m.progress)}") for m in members]
        lines.append(("", f"  {self._summary(members, queued, now)}"))
        for key, line in lines:
            if self._said.get(key) != line:
                self._said[key] = line
                self.say(line)

    def _draw(self, members: list[_Member], queued: int, now: float) -> None:
        if self._head is None:
            self._head = tqdm(
                total=0, bar_format="  {desc}", file=self.stream, leave=False, dynamic_ncols=True
            )
        shown = {m.task_id for m in members}
        for task_id in [t for t in self._bars if t not in shown]:
            self._bars.pop(task_id).close()
        for m in members:
            bar = self._bars.get(m.task_id)
            if bar is None:
                bar = self._bars[m.task_id] = tqdm(
                    total=None,
                    desc=m.task_id,
                    file=self.stream,
                    leave=False,
                    dynamic_ncols=True,
                    bar_format="  {desc} {bar} {n_fmt}/{total_fmt}{postfix}",
                )
            if m.progress is not None:
                bar.total, bar.n = max(m.progress.steps, 1), m.progress.step
            bar.set_postfix_str(describe(m.progress, step=False), refresh=False)
            bar.refresh()
        self._head.set_description_str(self._summary(members, queued, now), refresh=True)


def _eta(progress: Progress | None) -> float | None:
    return None if progress is None else progress.eta_now()


def _generation_eta(
    members: list[_Member], queued: int, slots: int, ended: float | None
) -> float | None:
    """Seconds until the last task ends, or None when unknown.

    A running task has its training ETA left, or once tasks of the generation ended (their
    mean time ``ended``: loading, evaluating and saving included) what that mean leaves after
    its elapsed time, if more. A queued one goes on the first slot to free up and takes
    ``ended``, or before any ended the running ones' mean elapsed time plus ETA."""
    left, whole = [], []
    for m in members:
        eta = _eta(m.progress)
        if eta is not None:
            whole.append(m.elapsed + eta)
        if ended is not None:
            eta = max(eta or 0.0, ended - m.elapsed)
        if eta is None:
            return None
        left.append(max(0.0, eta))
    typical = ended if ended is not None else (sum(whole) / len(whole) if whole else None)
    if queued and typical is None:
        return None
    free = sorted(left) + [0.0] * max(0, slots - len(left))
    heapq.heapify(free)
    for _ in range(queued):
        heapq.heappush(free, heapq.heappop(free) + typical)
    return max(free, default=0.0)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
