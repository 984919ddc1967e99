"""A member's task as the controller writes it: its :class:`~pbt.protocol.messages.TaskMessage`
in ``<campaign>/tasks/<member>/task.json``, carrying the manifest in canonical form, and the
attempt the launcher runs. No torch here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from pbt.config import Manifest
from pbt.config.read.canonical import canonical_sections
from pbt.controller.store import CampaignStore
from pbt.launch.attempt import TaskSpec
from pbt.protocol.messages import TASK_FILE, TaskMessage
from pbt.protocol.paths import plain_name
from pbt.protocol.records import MemberRecord


def write_task(
    directory: Path,
    manifest: Manifest,
    store: CampaignStore,
    m: MemberRecord,
    parent_digest: str | None = None,
    adopt: str | None = None,
) -> TaskSpec:
    """Write member ``m``'s task in campaign ``directory`` and return its attempt.

    Args:
        parent_digest: the parent checkpoint's digest when the store does not have it yet (a
            task guessed ahead); None: the store's.
        adopt: a job left running for this very attempt (see :class:`TaskSpec`).

    Raises:
        PbtError: ``m``'s id would make a path outside the campaign.
    """
    plain_name(m.member_id, f"a member id in {store.path}")
    task_dir = directory / "tasks" / m.member_id
    task_dir.mkdir(parents=True, exist_ok=True)
    if m.parent_checkpoint:
        parent_digest = parent_digest or store.checkpoint_digest(m.parent_checkpoint)
    else:
        parent_digest = None
    TaskMessage(
        campaign_dir=str(directory.resolve()),
        manifest=member_sections(manifest),
        manifest_base_dir=manifest.base_dir,
        member_id=m.member_id,
        generation=m.generation,
        parent_id=m.parent_id,
        parent_checkpoint=m.parent_checkpoint,
        parent_digest=parent_digest,
        hyperparameters=m.hyperparameters,
        mutation=m.mutation,
        steps=manifest.population.evo_steps,
        checkpoint=f"checkpoints/{m.member_id}",
    ).write(task_dir / TASK_FILE)
    log = directory / "logs" / f"{m.member_id}.attempt{m.attempts}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    return TaskSpec(m.member_id, task_dir, log_path=log, nproc=manifest.launch.ranks, adopt=adopt)


def member_sections(manifest: Manifest) -> dict[str, Any]:
    """The manifest members train by, in canonical form (translated and validated once, by
    the controller; a member translates nothing): the campaign's, with a schedule that spans
    the whole campaign, not one generation."""
    steps = manifest.budget.generations * manifest.population.evo_steps
    training = replace(manifest.training, steps=steps)
    return canonical_sections(replace(manifest, training=training))
