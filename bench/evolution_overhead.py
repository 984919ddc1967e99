"""Evolution overhead: the share of wall time not spent in rollouts and optimizer steps, with
long-lived workers against a process (and a model load) per member task, side by side.

    python bench/evolution_overhead.py                              # CPU, the tiny model
    python bench/evolution_overhead.py --shape 0.5b --device cuda --members 8 --steps 20

``--generations`` generations (default 2) of ``--members`` member tasks through the campaign's
own launchers and worker (the controller's bookkeeping, a few milliseconds a generation, is left
out): generation 0 trains every member from the base model; in every later generation each
member loads a parent's checkpoint (the next member's, as selection would pick) with its lr
mutated. One slot, so tasks run one after another. "Productive" is the time the workers report
for training steps and evaluation (``productive_seconds``); the rest of the wall time (process
start, imports, model load, checkpoint load and save, handing tasks over) is the overhead, and
each generation's line splits it: the task's setup (the model load, or a reset of the adapter
slot), finding the parent's state (in the worker's memory, or waiting for its prefetch to the
device), the parent checkpoint's load, the checkpoint's save (on a long-lived worker only the
snapshot to host memory: the write runs in the background while the next member trains, and is
shown beside), and what falls outside the task (process start, handing tasks over).
On a long-lived worker the next generation's first task starts as soon as every result is known,
while the generation's last checkpoint is still being written, as a campaign does
(``on_released``): a generation's wall time runs from the moment the generation before had every
result to the moment it has every result; the campaign's very last write, which nothing follows,
is shown apart. "Later generations" is the same share without generation 0: what every generation after the
first costs once a long-lived worker holds the model (a long campaign's steady state).
Member ``i``'s lr is ``--lr`` times ``0.8 + 0.1 i`` (default ``1e-5``, ``optim.lr``'s default): a
member whose policy collapses ends its task early (``algorithm.collapse_patience``), and the
generation would no longer measure ``--steps`` steps a task, so the bench stops on a collapsed
member, naming it and the step it ended at.
``--modes`` runs one mode alone and ``--gpu`` picks its GPU: two processes can then run the two
modes side by side on two GPUs of one host. ``--modes device-states`` (on a GPU) is the long-lived
worker with its latest states also held on the device (``launch.device_state_cache_gib`` 1): a
parent is then prefetched in a device copy, not a copy from the host.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import pick

SHAPES = pick("wide", "0.5b", "1.5b")

MODES = {
    "long-lived": "long-lived worker",
    "restart": "restart per task",
    "device-states": "long-lived, states on the device",
}
DEFAULT_MODES = ["long-lived", "restart"]
DEVICE_STATE_GIB = 1.0
"""``launch.device_state_cache_gib`` in the ``device-states`` mode."""


def write_tasks(
    root: Path,
    campaign: Path,
    manifest: dict,
    generation: int,
    members: int,
    steps: int,
    digests: dict[str, str],
    lr: float = 1e-5,
) -> list:
    """One generation's task files: member ``i`` of a later generation loads member ``i + 1``'s
    checkpoint of the one before (as selection would pick), its lr set apart from the others'.
    ``digests`` holds the checkpoints' digests, so a worker may load a parent from memory."""
    from pbt.launch.local import TaskSpec
    from pbt.protocol.messages import TASK_FILE, TaskMessage

    tasks = []
    for i in range(members):
        member = f"g{generation}-m{i}"
        parent = f"g{generation - 1}-m{(i + 1) % members}" if generation else None
        task_dir = campaign / "tasks" / member
        task_dir.mkdir(parents=True, exist_ok=True)
        TaskMessage(
            campaign_dir=str(campaign),
            manifest=manifest,
            manifest_base_dir=str(root),
            member_id=member,
            generation=generation,
            parent_id=parent,
            parent_checkpoint=f"checkpoints/{parent}" if parent else None,
            parent_digest=digests.get(parent) if parent else None,
            hyperparameters={"lr": lr * (0.8 + 0.1 * i)},
            mutation="lr" if parent else None,
            steps=steps,
            checkpoint=f"checkpoints/{member}",
        ).write(task_dir / TASK_FILE)
        tasks.append(TaskSpec(member, task_dir, campaign / "logs" / member))
    return tasks


def next_first(
    known: list[float],
    root: Path,
    campaign: Path,
    manifest: dict,
    generation: int,
    args: argparse.Namespace,
    digests: dict[str, str],
    results: dict[str, dict],
) -> list:
    """Called once ``generation`` has every result: note the moment, and write the next
    generation's tasks; return those whose parent checkpoint is on disk, to start behind the
    last writes (as a campaign does with its guess of the next generation)."""
    known.append(time.perf_counter())
    if generation + 1 == args.generations:
        return []
    written = digests | {k: r.digest for k, r in results.items() if r.digest}
    tasks = write_tasks(
        root, campaign, manifest, generation + 1, args.members, args.steps, written, args.lr
    )
    return [task for task in tasks if task_parent(task) in written]


def task_parent(task) -> str | None:
    from pbt.protocol.messages import TASK_FILE, TaskMessage

    return TaskMessage.read(Path(task.task_dir) / TASK_FILE).parent_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", *SHAPES])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engine", default="hf", choices=["hf", "static"])
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5, help="member i's lr: LR x (0.8 + 0.1 i)")
    parser.add_argument("--gpu", type=int, default=0, help="the GPU the slot runs on")
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    args = parser.parse_args()

    from pbt.launch.local import LocalLauncher, member_command
    from pbt.launch.persistent import PersistentLauncher

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = "builtin:tiny"
        if args.shape != "tiny":
            from pbt.algorithms.builtin.tiny import build_shaped_model

            model = str(build_shaped_model(root / "model", **SHAPES[args.shape]))
        manifest = {
            "model": {"name": model},
            "algorithm": {"group_size": 8, "prompts_per_step": 8},
            "rollout": {"max_output_tokens": 32, "engine": args.engine},
            "task": {"name": "builtin:letters", "eval_size": 32},
            "training": {"device": args.device, "steps": 2 * args.steps, "seed": 0},
        }
        command = member_command()
        gpus = 1 if args.device == "cuda" else 0
        env = {} if gpus else {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}
        rows = {}
        for mode in (MODES[m] for m in args.modes):
            campaign = root / mode.replace(" ", "-")
            held = DEVICE_STATE_GIB if "device" in mode else 0.0
            manifest["launch"] = {"device_state_cache_gib": held}  # this mode's tasks
            common = dict(slots=1, gpus_per_member=gpus, heartbeat_timeout_s=600.0, env=env)
            if gpus:  # two runs side by side must not share a GPU or a rendezvous port
                common.update(gpu_ids=[args.gpu], base_port=29600 + 100 * args.gpu)
            if mode.startswith("long-lived"):
                launcher = PersistentLauncher(command, campaign / "workers", **common)
            else:
                launcher = LocalLauncher(command, **common)
            walls, works, fitness, digests = [], [], [], {}
            known = [time.perf_counter()]  # when each generation had every result

            try:
                for generation in range(args.generations):
                    tasks = write_tasks(
                        root,
                        campaign,
                        manifest,
                        generation,
                        args.members,
                        args.steps,
                        digests,
                        args.lr,
                    )
                    count = len(known)
                    ahead = functools.partial(
                        next_first, known, root, campaign, manifest, generation, args, digests
                    )
                    outcomes = launcher.run(tasks, on_released=ahead)
                    ended = time.perf_counter()
                    if len(known) == count:  # every write had ended before the results were in
                        known.append(ended)
                    walls.append(known[-1] - known[-2])
                    works.append(0.0)
                    phases = dict.fromkeys(
                        ("setup", "parent", "load", "save", "outside the task"), 0.0
                    )
                    written, from_memory, on_device, prefetched = 0.0, 0, 0, 0
                    for outcome in outcomes:
                        if outcome.status != "ok":
                            raise SystemExit(f"{mode}: {outcome.task_id} {outcome.detail}")
                        trained = outcome.result.steps - generation * args.steps
                        if trained != args.steps:
                            raise SystemExit(
                                f"{mode}: member {outcome.task_id} trained {trained} of "
                                f"{args.steps} steps ({outcome.result.fault.detail if outcome.result.fault else None})"
                                f"; the overhead share needs full tasks: lower --lr (now {args.lr})"
                            )
                        digests[outcome.task_id] = outcome.result.digest
                        from_memory += outcome.result.parent_from == "memory"
                        on_device += bool(outcome.result.parent_on_device)
                        prefetched += bool(outcome.result.parent_prefetched)
                        works[-1] += outcome.result.productive_seconds
                        fitness.append(outcome.result.fitness)
                        for name in ("setup", "parent", "load", "save"):
                            phases[name] += outcome.result.timings.get(name, 0.0)
                        written += outcome.result.write_s or 0.0
                    phases["outside the task"] = walls[-1] - sum(
                        sum(o.result.timings.values()) for o in outcomes
                    )
                    kept = len(launcher.kept_ahead)
                    print(
                        f"{mode}, generation {generation}: wall {walls[-1]:.1f} s, productive "
                        f"{works[-1]:.1f} s, overhead {(walls[-1] - works[-1]) / walls[-1]:.1%} "
                        f"({(walls[-1] - works[-1]) / args.members:.2f} s a task), fitness "
                        f"{[round(f, 4) for f in fitness[-args.members :]]}",
                        flush=True,
                    )
                    print(
                        "  overhead a task: "
                        + ", ".join(f"{k} {v / args.members:.3f} s" for k, v in phases.items())
                        + f" (checkpoint write {written / args.members:.2f} s, in the background "
                        f"on a long-lived worker; parents loaded from memory: {from_memory}, "
                        f"of which held on the device: {on_device}, prefetched to the device: "
                        f"{prefetched}; started behind the "
                        f"last writes of the generation before: {kept})",
                        flush=True,
                    )
                print(
                    f"{mode}: the last generation's last write took {ended - known[-1]:.2f} s "
                    "more (once a campaign: nothing follows it)",
                    flush=True,
                )
            finally:
                launcher.close()
            later = (sum(walls[1:]), sum(works[1:]))
            rows[mode] = (sum(walls), sum(works), fitness, later)

    print(
        f"\n{args.shape} model on {args.device}, engine {args.engine}: {args.generations} "
        f"generations x {args.members} members x {args.steps} steps, one slot\n"
    )
    print(
        "| members run by | wall s | productive s | overhead s | overhead share | "
        "later generations: overhead share |"
    )
    print("|---|---|---|---|---|---|")
    for mode, (wall, productive, _, (wall_1, productive_1)) in rows.items():
        later = f"{(wall_1 - productive_1) / wall_1:.1%}" if wall_1 else "-"
        print(
            f"| {mode} | {wall:.1f} | {productive:.1f} | {wall - productive:.1f} | "
            f"**{(wall - productive) / wall:.1%}** | {later} |"
        )
    if "restart per task" in rows and "long-lived worker" in rows:
        restart, persistent = rows["restart per task"], rows["long-lived worker"]
        ratio = (restart[0] - restart[1]) / max(persistent[0] - persistent[1], 1e-9)
        print(f"\noverhead, restart / long-lived: {ratio:.1f}x")
    if len(rows) > 1:
        same = len({tuple(fitness) for _, _, fitness, _ in rows.values()}) == 1
        print(f"same fitness in every mode: {same}")


if __name__ == "__main__":
    main()
