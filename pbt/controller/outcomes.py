"""What a campaign does with each attempt's outcome: a member that finished is recorded from its
result (and said how it learned); one that failed has its fault recorded, is retried, replaced
after its last attempt (a clone of the generation's best, or its parent), or stops the campaign
when nothing can stand in for it or the disk is full. No torch here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from pbt.config import Manifest
from pbt.config.errors import PbtError
from pbt.controller.campaign_log import CampaignLog
from pbt.controller.store import CampaignStore
from pbt.launch.attempt import Outcome
from pbt.protocol.collapse import COLLAPSED, diagnosis, last_zero_signal, signal_note
from pbt.protocol.messages import ResultMessage
from pbt.protocol.records import MemberRecord


def applied(m: MemberRecord, result: ResultMessage) -> MemberRecord:
    """``m`` (changed in place) as its task's ``result`` leaves it: done, with its fitness."""
    trained = result.steps - m.steps  # m.steps: its parent's, until now
    m.status = "done"
    m.checkpoint = result.checkpoint
    m.checkpoint_digest = result.digest
    m.fitness_history = [*m.fitness_history, float(result.fitness)]
    m.steps = result.steps
    m.collapsed = result.fault is not None and result.fault.kind == COLLAPSED
    m.metrics = _signal_figures(result.metrics) | {"trained_steps": trained}
    return m


def _signal_figures(metrics: dict[str, float]) -> dict[str, float]:
    """The zero-signal figures of a result's metrics, for the member's record."""
    keys = ("zero_signal_fraction", "zero_signal_fraction_mean", "zero_signal_steps")
    return {k: float(metrics[k]) for k in keys if k in metrics}


class Outcomes:
    """A campaign's handling of attempts' outcomes, recorded in its ``store`` and ``log``;
    ``say`` prints the controller's lines."""

    def __init__(
        self,
        directory: Path,
        manifest: Manifest,
        store: CampaignStore,
        log: CampaignLog,
        say: Callable[[str], None],
    ) -> None:
        self.dir, self.manifest, self.store, self.log, self.say = (
            directory,
            manifest,
            store,
            log,
            say,
        )

    def log_path(self, m: MemberRecord) -> Path:
        """The log of ``m``'s latest attempt."""
        return self.dir / "logs" / f"{m.member_id}.attempt{m.attempts}.log"

    @staticmethod
    def check_result(m: MemberRecord, outcome: Outcome) -> Outcome:
        """A result whose checkpoint is not the one its task named is a bad result: the
        controller would load and later delete whatever path it gives."""
        if outcome.status != "ok":
            return outcome
        named = outcome.result.checkpoint if outcome.result is not None else None
        if named == f"checkpoints/{m.member_id}":
            return outcome
        detail = f"result.json names checkpoint {named!r}, not its task's checkpoints/{m.member_id}"
        return replace(outcome, status="bad_result", detail=detail)

    def succeeded(self, m: MemberRecord, outcome: Outcome) -> None:
        """Record ``m`` as its ok ``outcome``'s result leaves it, and say how it learned."""
        result = outcome.result
        if result is None:  # an ok outcome has its result
            raise ValueError(f"{m.member_id}: an ok outcome without a result")
        applied(m, result)
        trained = int(m.metrics["trained_steps"])
        self.store.register_checkpoint(m.checkpoint, m.checkpoint_digest or "")
        self.store.update_member(m)
        if m.collapsed:
            detail = result.fault.detail if result.fault is not None else ""
            self.store.record_fault(m.generation, m.member_id, m.attempts, COLLAPSED, detail)
        self.log.member_finished(m, result)
        how = (
            f"collapsed after {trained} of {self.manifest.population.evo_steps} steps"
            if m.collapsed
            else "done"
        )
        self.say(
            f"  {m.member_id} {how}: fitness {result.fitness:.3f} ({m.mutation or 'initial'}) "
            f"in {outcome.seconds:.0f} s{signal_note(m.metrics)}"
        )
        self._diagnose(m, result.history)

    def _diagnose(self, m: MemberRecord, history: list[dict[str, float]]) -> None:
        """Say once, for a member with a step that learned nothing, why and what to change."""
        step = last_zero_signal(history)
        if step is not None:
            self.say(f"  {m.member_id} had no signal at step {step['step']:.0f}: {diagnosis(step)}")
        if m.collapsed:
            self.say(f"  {m.member_id} collapsed; selection replaces it")

    def failed(self, m: MemberRecord, outcome: Outcome, action: str) -> None:
        """Record ``m``'s failed attempt and say what follows (``action``)."""
        self.store.record_fault(
            m.generation, m.member_id, m.attempts, outcome.status, outcome.detail
        )
        m.status = "failed"
        self.store.update_member(m)
        self.log.member_failed(m, outcome.status, outcome.detail, final=action == "replacing")
        reason = outcome.detail.splitlines()[0] if outcome.detail else ""
        of = f"attempt {m.attempts} of {self.manifest.launch.max_attempts}"
        self.say(
            f"  {m.member_id} {outcome.status} ({of}): {reason}; {action} (log: {self.log_path(m)})"
        )

    def replace(self, m: MemberRecord, generation: int, outcome: Outcome) -> None:
        """After its last failed attempt (its first, on a configuration error or a broken
        parent checkpoint, which would fail again the same way), a member becomes a clone of
        the generation's best finished member, or of its own parent (unless that is broken)
        when none has finished; with neither, the campaign stops with the member's cause.

        Raises:
            PbtError: nothing can stand in for the member (the message says why and what to do).
        """
        done = [x for x in self.store.members(generation) if x.status == "done"]
        window = self.manifest.population.fitness_window
        if done:
            source = max(done, key=lambda x: x.fitness(window))
            m.checkpoint, m.checkpoint_digest = source.checkpoint, source.checkpoint_digest
            m.fitness_history, m.steps = list(source.fitness_history), source.steps
            m.hyperparameters = dict(source.hyperparameters)
            detail = f"replaced by a clone of {source.member_id} after {m.attempts} failed attempts"
        elif m.parent_checkpoint and outcome.status != "bad_checkpoint":
            m.checkpoint = m.parent_checkpoint
            detail = f"replaced by its parent {m.parent_id} after {m.attempts} failed attempts"
        else:
            raise PbtError(self._nothing_to_replace(m, generation, outcome))
        m.status, m.mutation = "done", detail
        self.store.update_member(m)
        self.store.record_fault(generation, m.member_id, m.attempts, "replaced", detail)
        self.say(f"  {m.member_id} {detail}")

    def _nothing_to_replace(self, m: MemberRecord, generation: int, outcome: Outcome) -> str:
        """Why the campaign stops: the member's cause first, then what it means."""
        cause = outcome.detail.splitlines()[0] if outcome.detail else outcome.status
        times = "once" if m.attempts == 1 else f"{m.attempts} times"
        fix = f"see {self.log_path(m)}"
        if outcome.status in ("config_error", "reward_error"):
            fix = (
                "fix the manifest or its reward and start the campaign again (pbt check "
                "MANIFEST first)"
            )
        if outcome.status == "bad_checkpoint":
            fix = f"restore {m.parent_checkpoint} from a backup, or start the campaign again"
        return (
            f"{m.member_id} failed {times} ({outcome.status}: {cause}) and no member of "
            f"generation {generation} finished to replace it; {fix}"
        )

    def stop_for_disk(self, m: MemberRecord, outcome: Outcome) -> None:
        """A full disk is not the member's fault: clones would fail the same way. Stop, with
        the generation uncommitted, so that a resume re-runs what did not finish.

        Raises:
            PbtError: always, saying to free space and resume.
        """
        reason = outcome.detail.splitlines()[0] if outcome.detail else "the disk is full"
        raise PbtError(
            f"{m.member_id} failed {m.attempts} times for want of disk space ({reason}); the "
            f"campaign stopped with generation {m.generation} uncommitted and every earlier "
            f"checkpoint intact: free space on the disk that holds {self.dir}, then continue "
            f"with: pbt resume {self.dir}"
        )
