"""What a campaign tells MLflow: one parent run for the campaign, one child run per member.

The controller logs everything (member processes only write their results), through a
:class:`pbt.tracking.tracker.Tracker` whose journal lives in the campaign directory: logging
never blocks the controller, and whatever the tracking store missed (down, or the controller
killed) is sent when the campaign resumes. The runs' params and tags, logged once, follow
:mod:`pbt.tracking.run_schema`, which library mode shares.

- Parent run: the validated configuration, seed and package version as params, the manifest as
  an artifact; per generation the best and mean fitness and, for every member slot, its fitness
  and every hyperparameter's value as step-indexed metrics (params are write-once; slots
  mutate); at the end the fitness and hyperparameter plots, the lineage PNG and the best
  member's adapter.
- Member runs: tagged with member id, generation, parent member and the mutation applied, with
  their hyperparameters as params; the member's per-step training metrics (reward mean and std,
  loss, KL, clip fraction, zero-signal fraction, learning rate, tokens/s, GPU memory) at its
  lineage's step, and at the step it was evaluated its fitness, hyperparameters, the zero-signal
  fraction over its task (``zero_signal_fraction_mean``, and the last step's), its zero-signal
  steps, trained steps and ``collapsed`` (1 when it ended for lack of signal, then also a tag).
"""

from __future__ import annotations

from pathlib import Path

from pbt.config import Manifest
from pbt.controller.report import fitness_png, hyperparameters_png, lineage_png
from pbt.protocol.messages import ResultMessage
from pbt.protocol.records import MemberRecord
from pbt.tracking.run_schema import (
    CAMPAIGN_RUN,
    campaign_experiment,
    start_members,
    start_parent,
)
from pbt.tracking.tracker import Tracker, default_uri

PARENT = CAMPAIGN_RUN


class CampaignLog:
    """The campaign's MLflow runs; every method is a no-op when tracking is disabled."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.dir = directory
        self.manifest = manifest
        self.tracker = None
        cfg = manifest.tracking
        if cfg.enabled:
            self.tracker = Tracker(
                cfg.uri or default_uri(directory),
                campaign_experiment(directory, manifest),
                directory / "tracking",
            )

    @property
    def uri(self) -> str | None:
        if self.tracker is None:
            return None

        return self.manifest.tracking.uri or default_uri(self.dir)

    def started(self, manifest_file: Path | None = None) -> None:
        """Open (or, on resume, reopen) the campaign's run."""
        if self.tracker is None:
            return
        start_parent(
            self.tracker,
            PARENT,
            name=self.dir.name,
            manifest=self.manifest,
            tags={"campaign": str(self.dir)},
        )
        if manifest_file is not None and manifest_file.exists():
            self.tracker.log_artifact(PARENT, manifest_file)

    def members_started(self, members: list[MemberRecord]) -> None:
        if self.tracker is None:
            return
        start_members(self.tracker, members, parent=PARENT)

    def member_finished(self, m: MemberRecord, result: ResultMessage) -> None:
        """The member's training history, fitness and hyperparameters; its run ends."""
        if self.tracker is None:
            return
        for entry in result.history:
            metrics = {k: float(v) for k, v in entry.items() if k != "step"}
            self.tracker.log_metrics(m.member_id, metrics, int(entry["step"]))
        evaluated = {"fitness": float(result.fitness), **m.hyperparameters, **m.metrics}
        evaluated["collapsed"] = float(m.collapsed)
        self.tracker.log_metrics(m.member_id, evaluated, m.steps)
        if m.collapsed:
            detail = result.fault.detail if result.fault is not None else ""
            self.tracker.set_tags(m.member_id, {"collapsed": detail[:250] or "true"})
        self.tracker.end_run(m.member_id)

    def member_failed(self, m: MemberRecord, status: str, detail: str, final: bool) -> None:
        if self.tracker is None:
            return
        self.tracker.set_tags(
            m.member_id,
            {f"fault.attempt{m.attempts}": f"{status}: {detail.splitlines()[0]}"[:250]}
            if detail
            else {f"fault.attempt{m.attempts}": status},
        )
        if final:
            self.tracker.end_run(m.member_id, "FAILED")

    def generation_committed(self, generation: int, members: list[MemberRecord]) -> None:
        if self.tracker is None:
            return
        window = self.manifest.population.fitness_window
        scores = [m.fitness(window) for m in members if m.fitness_history]
        metrics: dict[str, float] = {}
        if scores:
            metrics |= {"best_fitness": max(scores), "mean_fitness": sum(scores) / len(scores)}
        for m in members:
            slot = m.member_id.rsplit("-", 1)[-1]
            if m.fitness_history:
                metrics[f"{slot}.fitness"] = m.fitness_history[-1]
            for name, value in m.hyperparameters.items():
                metrics[f"{slot}.{name}"] = float(value)
        self.tracker.log_metrics(PARENT, metrics, generation)

    def finished(self, best_checkpoint: Path | None) -> None:
        """Plots, the lineage and the best adapter as artifacts; the campaign run ends."""
        if self.tracker is None:
            return

        plots = self.dir / "plots"
        for draw, name in (
            (fitness_png, "fitness.png"),
            (hyperparameters_png, "hyperparameters.png"),
            (lineage_png, "lineage.png"),
        ):
            self.tracker.log_artifact(PARENT, draw(self.dir, plots / name), "plots")
        adapter = best_checkpoint / "adapter" if best_checkpoint else None
        if adapter is not None and adapter.is_dir():
            self.tracker.log_artifact(PARENT, adapter, "best_adapter")
        self.tracker.end_run(PARENT)

    def close(self, timeout: float = 30.0) -> None:
        if self.tracker is not None:
            self.tracker.close(timeout)
