"""The MLflow run schema, said once: the experiment, the parent run and the member runs that a
campaign (:mod:`pbt.controller.campaign_log`) and library mode (:mod:`pbt.library.loop`) log.

- Experiment: ``campaign <absolute directory>`` (or ``tracking.experiment``) for a campaign,
  ``population <absolute output_dir>`` for library mode.
- Parent run: the validated configuration as params, one ``section.key`` per field (a nested
  value as JSON with sorted keys), with the seed and the package version.
- Member runs: children of the parent run, tagged with the member id, its generation, its
  parent member and the mutation that made it (``initial`` for generation 0); its
  hyperparameters as params, so runs can be compared by them. A member's hyperparameters are
  fixed for its run (a mutation makes a new member); the values they take across a population
  are step-indexed metrics, logged by the callers.

Params are logged when a run is first started, never again: MLflow refuses a param whose value
changes, and a resumed campaign (its configuration read back from the store) or a newer
package must not make it refuse anything.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from pbt import __version__
from pbt.config import Manifest
from pbt.tracking.tracker import Tracker

CAMPAIGN_RUN = "campaign"
"""The tracker key of a campaign's parent run."""
POPULATION_RUN = "population"
"""The tracker key of a library-mode population's parent run."""


def campaign_experiment(directory: Path, manifest: Manifest) -> str:
    """The experiment a campaign in ``directory`` logs to."""
    return manifest.tracking.experiment or f"campaign {directory.resolve()}"


def population_experiment(output_dir: Path) -> str:
    """The experiment a library-mode population saved in ``output_dir`` logs to."""
    return f"population {output_dir.resolve()}"


def param_value(value: Any) -> str:
    """A param's text, the same for equal values however they were built: a dict's key order
    (the store saves configurations with sorted keys) does not show."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def config_params(manifest: Manifest, **extra: object) -> dict[str, str]:
    """The parent run's params: every field of every configuration section, the seed, the
    package version and ``extra``."""
    params: dict[str, Any] = {"seed": manifest.training.seed, "version": __version__}
    for section in dataclasses.fields(manifest):
        value = getattr(manifest, section.name)
        if dataclasses.is_dataclass(value):
            for key, item in dataclasses.asdict(value).items():
                params[f"{section.name}.{key}"] = item
    return {key: param_value(value) for key, value in (params | extra).items()}


def start_parent(
    tracker: Tracker,
    key: str,
    *,
    name: str,
    manifest: Manifest,
    tags: dict[str, str] | None = None,
    **extra: object,
) -> None:
    """Start (or, on resume, reopen) the parent run; its params only the first time."""
    params = None if tracker.has_run(key) else config_params(manifest, **extra)
    tracker.start_run(key, name=name, tags=tags, params=params)


class Member(Protocol):
    """What a member run is started from: a campaign's :class:`~pbt.protocol.records.MemberRecord`
    and a library-mode agent alike."""

    member_id: str
    generation: int
    parent_id: str | None
    mutation: str | None

    @property
    def hyperparameters(self) -> dict[str, float]: ...


def start_members(tracker: Tracker, members: Iterable[Member], *, parent: str) -> None:
    """Start (or reopen) each member's run under ``parent``; its hyperparameters as params only
    the first time."""
    for member in members:
        tags = {
            "member": member.member_id,
            "generation": str(member.generation),
            "parent_member": member.parent_id or "",
            "mutation": member.mutation or "initial",
        }
        params = None
        if not tracker.has_run(member.member_id):
            params = {name: param_value(v) for name, v in member.hyperparameters.items()}
        tracker.start_run(
            member.member_id, name=member.member_id, parent=parent, tags=tags, params=params
        )
