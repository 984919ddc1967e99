"""A hand-written stand-in for `pbt.worker`, for controller tests that must run instantly.

Reads task.json like the real worker (its path the last argument, or, with `--serve FOLDER`,
one task after another from `FOLDER/inbox`, as a long-lived worker of
`launch.persistent_workers`), "trains" by a formula (fitness = the parent's fitness plus a gain
that peaks at lr = 3e-3), writes a checkpoint folder and result.json, and can be told to misbehave per member and attempt through `<campaign>/faults.json`:
`{"g001-m01": ["exit1", "ok"]}` makes the first attempt exit 1 and the second succeed.

`hang` stops heartbeating and waits (a stall), `hang_beating` waits heartbeating (a task past
its timeout), each with a child process that names the task folder (so that a census of the
campaign's processes sees it); `diverged` fails as a member whose training diverged. Every
attempt leaves the id of the process that ran it in `member.pid` beside its task.

`foreign_result` names a checkpoint outside the campaign in its result. `oom` allocates until
an allocation fails (under `launch.memory_limit_gib`; it gives up after
`FAKE_MEMBER_ALLOCATE_GIB`, default 4, without one); `disk_full` makes the checkpoint write
fail with ENOSPC through `PBT_FAULT_AT`. `reward` scores the first training row with the
manifest's reward through the real `Reward` (a faulty one raises `RewardError`). All are reported as the real worker reports them
(`pbt.protocol.faults`). With `FAKE_MEMBER_CHECKPOINT=real` the checkpoint is a real one
(`pbt.algorithms.runtime.checkpoint`, a tensor and the state), written and read as members do.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pbt.config.errors import DivergedError
from pbt.protocol import faults
from pbt.protocol.files import Heartbeat, read_json
from pbt.protocol.messages import RESULT_FILE, ResultMessage, TaskMessage

REAL_CHECKPOINT = os.environ.get("FAKE_MEMBER_CHECKPOINT") == "real"


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(Path(sys.argv[2]))
    else:
        run_task(Path(sys.argv[-1]))


def serve(folder: Path) -> None:
    """Take the launcher's inbox entries in order, as `pbt.worker --serve` does (without the
    early release: each task's result is written before the next is taken)."""
    taken = 0
    while (folder / "inbox").is_dir() and not (folder / "stop").exists():
        entry = read_json(folder / "inbox" / f"{taken:06d}.json")
        if entry is None:
            time.sleep(0.02)
            continue
        taken += 1
        run_task(Path(entry["task"]))


def run_task(task_path: Path) -> None:
    task = TaskMessage.read(task_path)
    campaign = Path(task.campaign_dir)
    member = task.member_id
    attempts_file = task_path.parent / "attempts"
    attempt = int(attempts_file.read_text()) + 1 if attempts_file.exists() else 1
    attempts_file.write_text(str(attempt))
    plan = (read_json(campaign / "faults.json") or {}).get(member, [])
    behaviour = plan[attempt - 1] if attempt <= len(plan) else "ok"
    (task_path.parent / "member.pid").write_text(str(os.getpid()))
    if behaviour == "hang":  # alive, silent: no heartbeat ever
        wait_with_a_child(task_path.parent)
    with Heartbeat(task_path.parent / "heartbeat", interval_s=0.2):
        time.sleep(float(os.environ.get("FAKE_MEMBER_SECONDS", "0.05")))
        if behaviour == "hang_beating":
            wait_with_a_child(task_path.parent)
        if behaviour == "exit1":
            print(f"error: {member} fails on attempt {attempt}", file=sys.stderr, flush=True)
            sys.exit(1)
        if behaviour == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if behaviour == "disk_full":
            os.environ["PBT_FAULT_AT"] = "disk_full:1"
        try:
            if behaviour == "oom":
                allocate(float(os.environ.get("FAKE_MEMBER_ALLOCATE_GIB", "4")))
            if behaviour == "reward":
                score_reward(task)
            if behaviour == "diverged":
                raise DivergedError(3, 3, 1)
            parent = {"fitness": 0.0, "steps": 0}
            if task.parent_checkpoint:
                parent = load_state(campaign / task.parent_checkpoint)
            lr = task.hyperparameters["lr"]
            gain = 1.0 - abs(math.log10(lr) - math.log10(3e-3))
            fitness = parent["fitness"] + gain
            steps = parent.get("steps", 0) + task.steps
            state = {"fitness": fitness, "lr": lr, "steps": steps}
            digest = save_state(campaign / task.checkpoint, state) or f"fake-{member}"
        except BaseException as err:
            if faults.report(task_path.parent, err) is None:
                raise
            print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(2)
        history = [
            {"step": step, "reward_mean": parent["fitness"] + gain * i / task.steps, "lr": lr}
            for i, step in enumerate(range(steps - task.steps + 1, steps + 1), start=1)
        ]
        checkpoint = task.checkpoint
        if behaviour == "foreign_result":  # a result that names a path outside the campaign
            checkpoint = "checkpoints/../../outside"
        result = ResultMessage(
            status="ok",
            member_id=member,
            fitness=fitness,
            steps=steps,
            checkpoint=checkpoint,
            digest=digest,
            metrics=history[-1],
            history=history,
        )
    if behaviour != "no_result":
        result.write(task_path.parent / RESULT_FILE)


def wait_with_a_child(task_dir: Path) -> None:
    """Start a child that names ``task_dir`` on its command line, and wait (until killed)."""
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", str(task_dir)])
    time.sleep(600)


def score_reward(task: TaskMessage) -> None:
    """Score the task's first training row, its answer as the completion, with the manifest's
    reward, as a member's learner does."""
    from pbt.algorithms.data.tasks import load_task
    from pbt.config.read.loader import manifest_from_dict

    manifest = manifest_from_dict(task.manifest, base_dir=task.manifest_base_dir)
    loaded = load_task(manifest.task, manifest.base_dir, manifest.training.seed)
    row = loaded.train[0]
    loaded.reward([row], [str(row.answer)])


def allocate(most_gib: float) -> None:
    """Hold ever more memory, 64 MiB at a time, until an allocation fails or ``most_gib``."""
    held = []
    while len(held) * 64 < most_gib * 1024:
        held.append(bytearray(64 << 20))


def save_state(ckpt: Path, state: dict) -> str | None:
    """Write the checkpoint; the real one's digest."""
    if not REAL_CHECKPOINT:
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "state.json").write_text(json.dumps(state))
        return None
    import torch

    from pbt.algorithms.runtime.checkpoint import save_checkpoint

    weight = torch.full((2, 2), float(state["fitness"]))
    attributes = {"trainable": {"base_model.fake.lora_A.weight": weight}, "state": state}
    return save_checkpoint(ckpt, attributes, {"peft_type": "LORA"})


def load_state(ckpt: Path) -> dict:
    if not REAL_CHECKPOINT:
        return json.loads((ckpt / "state.json").read_text())
    from pbt.algorithms.runtime.checkpoint import load_checkpoint

    return load_checkpoint(ckpt)["state"]


if __name__ == "__main__":
    main()
