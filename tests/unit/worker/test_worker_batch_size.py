"""How many members a long-lived worker trains together (``launch.members_per_batch``): only
where one process samples for all of them in one batch."""

from __future__ import annotations

import pytest
from support import task_message

from pbt.protocol.messages import TaskMessage
from pbt.worker.batch import batch_size


def _task(launch: dict, rollout: dict | None = None) -> TaskMessage:
    manifest = {"launch": {"members_per_batch": 4, **launch}, "rollout": rollout or {}}
    return task_message(manifest=manifest)


@pytest.mark.parametrize(
    ("launch", "rollout", "world_size", "expected"),
    [
        ({}, None, 1, 4),
        ({}, None, 2, 1),  # several ranks: each rank's rows are its own
        ({"members_per_batch": 1}, None, 1, 1),
        ({"rollout_gpus_per_member": "auto"}, None, 1, 4),  # auto with sync rollouts: no engine
        ({"rollout_gpus_per_member": "auto"}, {"mode": "async", "max_staleness": 1}, 1, 1),
        ({"rollout_gpus_per_member": 1}, {"mode": "async", "max_staleness": 1}, 1, 1),
        ({"backend": "slurm"}, None, 1, 1),  # a member task runs alone in its job there
    ],
)
def test_a_worker_batches_members_only_where_one_process_samples_for_them(
    launch: dict, rollout: dict | None, world_size: int, expected: int
) -> None:
    assert batch_size(_task(launch, rollout), world_size) == expected
