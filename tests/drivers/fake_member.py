"""A hand-written stand-in for `pbt.worker`, for controller tests that must run instantly.

Reads task.json like the real worker, "trains" by a formula (fitness = the parent's fitness
plus a gain that peaks at lr = 3e-3), writes a checkpoint folder and result.json, and can be
told to misbehave per member and attempt through `<campaign>/faults.json`:
`{"g001-m01": ["exit1", "ok"]}` makes the first attempt exit 1 and the second succeed.
"""

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from pbt.launch import Heartbeat, read_json, write_json_atomic


def main() -> None:
    task_path = Path(sys.argv[-1])
    task = read_json(task_path)
    campaign = Path(task["campaign_dir"])
    member = task["member_id"]
    attempts_file = task_path.parent / "attempts"
    attempt = int(attempts_file.read_text()) + 1 if attempts_file.exists() else 1
    attempts_file.write_text(str(attempt))
    plan = (read_json(campaign / "faults.json") or {}).get(member, [])
    behaviour = plan[attempt - 1] if attempt <= len(plan) else "ok"
    with Heartbeat(task_path.parent / "heartbeat", interval_s=0.2):
        time.sleep(float(os.environ.get("FAKE_MEMBER_SECONDS", "0.05")))
        if behaviour == "exit1":
            sys.exit(1)
        if behaviour == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        parent = {"fitness": 0.0, "steps": 0}
        if task["parent_checkpoint"]:
            parent = json.loads((campaign / task["parent_checkpoint"] / "state.json").read_text())
        lr = task["hyperparameters"]["lr"]
        gain = 1.0 - abs(math.log10(lr) - math.log10(3e-3))
        fitness = parent["fitness"] + gain
        steps = parent.get("steps", 0) + task["steps"]
        ckpt = campaign / task["checkpoint"]
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "state.json").write_text(json.dumps({"fitness": fitness, "lr": lr, "steps": steps}))
        history = [
            {"step": step, "reward_mean": parent["fitness"] + gain * i / task["steps"], "lr": lr}
            for i, step in enumerate(range(steps - task["steps"] + 1, steps + 1), start=1)
        ]
        result = {
            "status": "ok",
            "fitness": fitness,
            "steps": steps,
            "checkpoint": task["checkpoint"],
            "digest": f"fake-{member}",
            "metrics": history[-1],
            "history": history,
        }
    if behaviour != "no_result":
        write_json_atomic(task_path.parent / "result.json", result)


if __name__ == "__main__":
    main()
