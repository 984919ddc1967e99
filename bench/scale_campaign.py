"""Two sharded members side by side: a population of two members of a 7B-class shape, each a
torchrun group of ``gpus_per_member`` ranks with FSDP2, run for two generations by the real
controller, then checked.

The driver builds the random-weight model folder, writes the campaign's manifest from
``bench/scale_campaign.yaml`` (model folder, launch and device filled in), runs the campaign
with ``Campaign.start(...).run()``, and checks, from the campaign store, the members' results
and what each member's launch recorded:

- both members of each generation trained at once (their runs overlap in time), each on its
  own GPUs (their ``CUDA_VISIBLE_DEVICES`` are disjoint), each as a group of the configured
  number of ranks;
- selection and mutation happened: the next generation has an elite and a child whose
  hyperparameters differ from its parent's;
- the best checkpoint loads on another world size: a torchrun group of ``--load-ranks`` ranks
  loads it into a freshly sharded member, gathers the adapter and optimizer state back and
  finds them equal to what was saved, and evaluates it.

Each member's command is the controller's own ``torchrun ... -m pbt.worker``, started through
this script's ``member`` step, which records the member's ``CUDA_VISIBLE_DEVICES`` and wall
times in ``tasks/<member>/placement.json`` and exits with torchrun's status.

    python bench/scale_campaign.py --shape 7b --dir /scratch/scale7b --build-only  # folder
    python bench/scale_campaign.py --shape 7b --dir /scratch/scale7b            # 8 GPUs
    python bench/scale_campaign.py --shape 7b --dir /scratch/s --gpus-per-member 1   # 2 GPUs
    python bench/scale_campaign.py --shape tiny --dir /tmp/sc --gpus-per-member 0    # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from pbt.protocol.messages import RESULT_FILE, TASK_FILE, ResultMessage, TaskMessage

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import QWEN2

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "scale_campaign.yaml"
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-7B's config (scale_run's "7b") with the tiny model's tokenizer
    "7b": {**QWEN2["7b"], "head_dim": 128, "dtype": "bfloat16"},
    # the built-in tiny model itself (see model_folder)
    "tiny": {},
}
CPU_SECTIONS: dict[str, dict[str, Any]] = {
    "algorithm": {"group_size": 4, "prompts_per_step": 2, "micro_batch_size": 4},
    "rollout": {"max_output_tokens": 4},
    "task": {"eval_size": 4},
    "training": {"device": "cpu"},
    "population": {"evo_steps": 1},
}
"""What the CPU run changes in the manifest: a batch that a shared CPU trains in seconds."""


def model_folder(shape: str, work: Path) -> Path:
    """The random-weight model folder of ``shape`` under ``work``, built once; the built-in
    tiny model's own folder for ``tiny``."""
    from pbt.algorithms.builtin.tiny import build_shaped_model, tiny_model_dir

    if shape == "tiny":
        return tiny_model_dir()
    folder = work / f"model-{shape}"
    if not (folder / "config.json").is_file():
        start = time.perf_counter()
        build_shaped_model(folder, **SHAPES[shape])
        print(f"built {folder} in {time.perf_counter() - start:.0f} s", flush=True)
    return folder


def write_manifest(args: argparse.Namespace, model: Path) -> Path:
    """The campaign's manifest: ``bench/scale_campaign.yaml`` with the folder and launch set."""
    data = yaml.safe_load(MANIFEST.read_text())
    if args.gpus_per_member == 0:
        for section, values in CPU_SECTIONS.items():
            data[section] = {**data.get(section, {}), **values}
    data["model"]["name"] = str(model)
    data["launch"] = {
        **data["launch"],
        "gpus_per_member": args.gpus_per_member,
        "nproc_per_member": args.ranks,
        "slots": args.slots,
        # a process group per task: the wrapper records each task's placement as it starts
        "persistent_workers": False,
    }
    path = args.dir / "manifest.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def member_command() -> list[str]:
    """The controller's member command, started through :func:`record_member`."""
    from pbt.launch.local import member_command as torchrun

    return [sys.executable, str(Path(__file__).resolve()), "member", "--", *torchrun()]


def record_member(command: list[str]) -> int:
    """Run a member's command (its task.json last), recording where and when it ran."""
    placement = Path(command[-1]).parent / "placement.json"
    record = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "started": time.time(),
    }
    placement.write_text(json.dumps(record))
    returncode = subprocess.call(command)
    record |= {"ended": time.time(), "returncode": returncode}
    placement.write_text(json.dumps(record))
    return returncode


def run_campaign(manifest: Path, directory: Path) -> Any:
    from pbt.controller.campaign import Campaign

    campaign = Campaign.start(manifest, directory, member_command=member_command())
    try:
        return campaign.run()
    finally:
        campaign.close()


def check_placement(
    directory: Path, members: list[Any], ranks: int, gpus_per_member: int
) -> list[tuple[str, bool, str]]:
    """Per generation: the members' runs overlap, each had ``gpus_per_member`` GPUs of its own
    (disjoint sets), and each ran as a group of ``ranks``."""
    checks = []
    judged = 0
    for generation in sorted({m.generation for m in members}):
        group = [m for m in members if m.generation == generation]
        retried = [m.member_id for m in group if m.attempts > 1]
        placed = {}
        for m in group:
            task = directory / "tasks" / m.member_id
            try:
                record = json.loads((task / "placement.json").read_text())
                result = ResultMessage.read(task / RESULT_FILE)
                if result is None:
                    raise OSError(f"{task}/result.json is missing")
            except (OSError, ValueError) as err:
                checks.append((f"generation {generation}: {m.member_id} trained", False, str(err)))
                continue
            if "ended" not in record:  # its last attempt was killed
                checks.append(
                    (f"generation {generation}: {m.member_id} trained", False, m.mutation)
                )
                continue
            gpus = record["cuda_visible_devices"] or ""
            placed[m.member_id] = (record, {g for g in gpus.split(",") if g}, result.world_size)
        if not placed:
            continue
        latest_start = max(r["started"] for r, _, _ in placed.values())
        earliest_end = min(r["ended"] for r, _, _ in placed.values())
        overlap = earliest_end - latest_start
        if retried:  # a retry starts late by design: this generation says nothing either way
            note = f"not judged: {', '.join(retried)} retried after a fault"
            checks.append((f"generation {generation}: members trained at once", True, note))
        else:
            judged += 1
            checks.append(
                (
                    f"generation {generation}: members trained at once",
                    overlap > 0,
                    f"{overlap:.1f} s",
                )
            )
        sets = [s for _, s, _ in placed.values()]
        disjoint = all(a.isdisjoint(b) for i, a in enumerate(sets) for b in sets[i + 1 :])
        where = "; ".join(f"{k}: {sorted(s) or 'cpu'}" for k, (_, s, _) in placed.items())
        disjoint = disjoint and all(len(gpus) == gpus_per_member for gpus in sets)
        checks.append((f"generation {generation}: GPU sets disjoint", disjoint, where))
        sizes = {k: w for k, (_, _, w) in placed.items()}
        good = all(w == ranks for w in sizes.values())
        checks.append((f"generation {generation}: {ranks} ranks per member", good, str(sizes)))
    checks.append(("a generation without retries to judge overlap", judged > 0, f"{judged} judged"))
    return checks


def check_evolution(store) -> list[tuple[str, bool, str]]:
    """The second generation came from selection (an elite) and mutation (a changed hp)."""
    events = [e for e in store.lineage() if e["generation"] == 1]
    kinds = sorted(e["kind"] for e in events)
    mutated = []
    for e in events:
        if e["kind"] != "mutate":
            continue
        child, parent = store.member(e["member_id"]), store.member(e["parent_id"])
        changed = {
            k: (parent.hyperparameters.get(k), v)
            for k, v in child.hyperparameters.items()
            if parent.hyperparameters.get(k) != v
        }
        if changed:
            mutated.append(f"{e['member_id']} from {e['parent_id']}: {changed}")
    return [
        ("selection: generation 1 has an elite", "elite" in kinds, ", ".join(kinds)),
        ("mutation: a child's hyperparameters changed", bool(mutated), "; ".join(mutated)),
    ]


def check_load(directory: Path, member_id: str, ranks: int) -> list[tuple[str, bool, str]]:
    """Load ``member_id``'s checkpoint in a torchrun group of ``ranks`` ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "load.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={ranks}", str(Path(__file__).resolve()), "load",
            str(directory), member_id, str(out),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return [(f"checkpoint loads on world size {ranks}", False, proc.stderr[-2000:])]
        r = json.loads(out.read_text())
    where = f"saved by {r['saved_world_size']} ranks, loaded by {r['world_size']}"
    return [
        (
            f"checkpoint loads on world size {ranks}",
            r["world_size"] != r["saved_world_size"],
            where,
        ),
        ("reloaded adapter equals the saved one", r["adapter_equal"], f"{r['tensors']} tensors"),
        (
            "reloaded optimizer state equals the saved one",
            r["optimizer_equal"],
            f"step {r['step']}",
        ),
        (
            "reloaded member evaluates",
            r["fitness"] == r["fitness"],
            f"fitness {r['fitness']:.3f} (saved {r['saved_fitness']:.3f})",
        ),
    ]


def load_worker(directory: Path, member_id: str, out: Path) -> None:
    """One rank of the loading group: build the member sharded over this group's ranks, load
    the checkpoint, gather it back and compare."""
    import torch

    from pbt.algorithms.runtime.checkpoint import peft_key
    from pbt.algorithms.runtime.member import Member
    from pbt.config.read.loader import manifest_from_dict
    from pbt.distributed import pick_device, shutdown, world_info
    from pbt.distributed.state import gather_parameters

    task = TaskMessage.read(directory / "tasks" / member_id / TASK_FILE)
    manifest = manifest_from_dict(task.manifest, base_dir=task.manifest_base_dir)
    world = world_info()
    member = Member(manifest, pick_device(manifest.training.device, world.local_rank), member_id)
    saved = member.load(directory / task.checkpoint)
    named = member.learner.named_params
    gathered = gather_parameters(named)
    adapter_equal = all(torch.equal(gathered[n], saved["trainable"][peft_key(n)]) for n, _ in named)
    state = member.learner.state_dict()["optimizer"]["state"]
    saved_state = saved["learner"]["optimizer"]["state"]
    optimizer_equal = state.keys() == saved_state.keys() and all(
        torch.equal(torch.as_tensor(v), torch.as_tensor(saved_state[name][k]))
        for name, entry in state.items()
        for k, v in entry.items()
    )
    fitness = member.learner.evaluate(
        member.task.eval, member.task.reward, manifest.training.eval_temperature
    )
    if world.rank == 0:
        result = {
            "world_size": world.world_size,
            "saved_world_size": saved["world_size"],
            "adapter_equal": adapter_equal,
            "optimizer_equal": optimizer_equal,
            "tensors": len(named),
            "step": member.learner.step,
            "fitness": fitness,
            "saved_fitness": saved["fitness"][-1],
        }
        out.write_text(json.dumps(result))
    shutdown()


def drive(args: argparse.Namespace) -> int:
    """Build, run, check; print the checks; exit 1 unless every check passed."""
    from pbt.controller.store import CampaignStore

    if (args.dir / "campaign").exists():
        print(
            f"{args.dir / 'campaign'} exists: give a new --dir (the model folder is reused "
            "from a --dir that holds one)",
            file=sys.stderr,
        )
        return 2
    args.dir.mkdir(parents=True, exist_ok=True)
    model = model_folder(args.shape, args.dir)
    if args.build_only:
        return 0
    manifest = write_manifest(args, model)
    start = time.perf_counter()
    summary = run_campaign(manifest, args.dir / "campaign")
    seconds = time.perf_counter() - start
    ranks = args.gpus_per_member or args.ranks
    with CampaignStore(args.dir / "campaign" / "store.db") as store:
        members = [m for m in store.members() if m.status == "done"]
        checks = check_placement(args.dir / "campaign", members, ranks, args.gpus_per_member)
        checks += check_evolution(store)
    checks += check_load(args.dir / "campaign", summary.best_member, args.load_ranks)
    print(
        f"\n# campaign: {summary.generations} generations in {seconds:.0f} s ({summary.stop_reason})"
    )
    print("| check | passed | detail |\n|---|---|---|")
    for name, passed, detail in checks:
        print(f"| {name} | {'yes' if passed else 'NO'} | {detail} |")
    if args.json is not None:
        figures = {"seconds": seconds, "best_member": summary.best_member}
        figures["checks"] = [{"check": n, "passed": p, "detail": d} for n, p, d in checks]
        args.json.write_text(json.dumps(figures, indent=2))
    return 0 if all(passed for _, passed, _ in checks) else 1


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="7b")
    parser.add_argument("--dir", type=Path, required=True, help="work folder (model, campaign)")
    parser.add_argument("--gpus-per-member", type=int, default=4, help="0: members on the CPU")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per CPU member")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--load-ranks", type=int, help="default: 1 on the CPU, else 2")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--build-only", action="store_true", help="build the model folder in --dir and stop"
    )
    args = parser.parse_args(argv)
    if args.load_ranks is None:
        args.load_ranks = 1 if args.gpus_per_member == 0 else 2
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["member", "--"]:
        return record_member(argv[2:])
    if argv[:1] == ["load"] and len(argv) == 4:
        load_worker(Path(argv[1]), argv[2], Path(argv[3]))
        return 0
    return drive(parse(argv))


if __name__ == "__main__":
    sys.exit(main())
