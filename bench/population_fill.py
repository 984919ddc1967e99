"""A population that fills the GPU: population tokens/s with 1, 2, 4, ... members trained at once
on one GPU (``launch.members_per_gpu``), against one member at a time, side by side in one run;
with ``--batched``, also every member in one process whose rollouts are one batch
(``launch.members_per_batch``).

    python bench/population_fill.py                                   # CPU, the tiny model
    python bench/population_fill.py --shape 0.5b --device cuda --members 8 --steps 20 \\
        --engine static --at-once 1 2 4 8
    python bench/population_fill.py --shape 0.5b --device cuda --members 8 --steps 8 \\
        --engine static --at-once 1 8 --mps --batched --worker-batch

For each ``--at-once`` k: ``--generations`` generations (default 2) of ``--members`` member tasks
through the campaign's own launcher, k long-lived workers on one GPU (one slot each); from the
second generation on, each member loads a parent's checkpoint (the next member's) with its lr
mutated. The measured generation is the last one (the workers have loaded the model and
captured their graphs by then): its population tokens/s is every completion token sampled and
trained by every member (rollout + train) over the generation's wall time. On CUDA,
``nvidia-smi`` is sampled every 200 ms during it: the GPU's busy share and the most memory in
use. Each member's result reports its own peak (``peak_memory_gib``). The generation's wall
ends when the last checkpoint is written; "every result known" is when every member's result
was (a long-lived worker releases a result before its checkpoint is written): what a campaign's
controller selects from, handing the next generation's first members to the workers while
those writes run. Each row's line gives its tasks' mean phases (load, train, evaluate, save).

``--batched``: the same members, steps and lrs as a library-mode population in this process
(one base model, ``launch.members_per_batch`` = ``--members``): each step samples every
member's prompts in ONE batch, each row through its own member's adapter, then each member
scores and learns from its own rows (:class:`pbt.Population`'s ``get_actions``, ``reward``,
``learn``). A first round of ``--steps`` steps warms up (graphs captured); the second is
measured. Its tokens are counted as the workers' are.

``--worker-batch``: the same members through the campaign's own launcher on ONE long-lived
worker that takes them all at once (``launch.members_per_batch`` = ``--members``): their
rollouts in one batch, each member learning in turn; then again with ``launch.batched_train``
(every member's update in one forward and one backward a micro-batch). ``--batch-workers 2``
spreads them over two such workers on the GPU, each batching half (``launch.slots`` and
``members_per_gpu`` 2, ``members_per_batch`` members / 2; under ``--mps`` their kernels run
side by side): one worker's host-side gaps (the members' bookkeeping, its checkpoint writes)
filled by the other's passes.

``--large-batch``: one member sampling and training all the population's rows a step
(``prompts_per_step`` x ``--members``) through one adapter, on the same launcher: the rate the
same rows reach without per-row adapters or per-member bookkeeping, which the table's last
column divides each row's rate by (the share of the large-batch rate a population reaches).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from evolution_overhead import write_tasks
from shapes import pick

SHAPES = pick("wide", "0.5b", "1.5b", "smollm2-shape")

LR = 5e-3
"""Member ``i``'s lr is ``LR x (0.8 + 0.1 i)``: the lr the recorded figures were measured at
(tokens are counted, so a member whose task ends early does not skew them)."""


class _GpuSampler:
    """``nvidia-smi`` every 200 ms on one GPU: busy share and memory in use."""

    def __init__(self, gpu: int) -> None:
        self.proc = None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", "-i", str(gpu), "--query-gpu=utilization.gpu,memory.used",
                 "--format=csv,noheader,nounits", "-lms", "200"],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip

    def stop(self) -> tuple[float | None, float | None]:
        if self.proc is None:
            return None, None
        self.proc.terminate()
        out, _ = self.proc.communicate()
        rows = [line.split(",") for line in out.splitlines() if line.count(",") == 1]
        busy = [float(u) for u, _ in rows]
        memory = [float(m) / 1024 for _, m in rows]
        return (sum(busy) / len(busy) if busy else None), (max(memory) if memory else None)


def _start_mps(folder: Path) -> dict[str, str]:
    """A CUDA MPS control daemon with its pipes and logs in ``folder``; the variables that
    point a CUDA process at it."""
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(folder / "log"),
    }
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**os.environ, **env}, check=True)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", *SHAPES])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--engine", default="hf", choices=["hf", "static"])
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--at-once", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--model",
        help="a model.name instead of --shape (builtin:smollm2-135m-instruct after "
        "`python bench/real_model.py fetch`)",
    )
    parser.add_argument(
        "--batched",
        action="store_true",
        help="also run every member in one process, their rollouts in one batch",
    )
    parser.add_argument(
        "--worker-batch", nargs="*", choices=["in-turn", "batched_train"],
        help="also run every member on one long-lived worker of a campaign "
        "(launch.members_per_batch): its members learning in turn, with launch.batched_train, "
        "or (no value) both",
    )  # fmt: skip
    parser.add_argument(
        "--large-batch", action="store_true",
        help="also run ONE member with --members times the prompts a step through the same "
        "launcher: the population's rows through one adapter, the rate a batch could reach "
        "(the table's share column)",
    )  # fmt: skip
    parser.add_argument(
        "--batch-workers", type=int, nargs="+", default=[1],
        help="with --worker-batch: spread the members over this many long-lived workers on "
        "the GPU, each batching its share (launch.members_per_gpu = slots = this, "
        "members_per_batch = members / this); several values: a row each",
    )  # fmt: skip
    parser.add_argument(
        "--mps", action="store_true",
        help="run the workers under a private CUDA MPS daemon (kernels of different processes "
        "then run side by side instead of time-sliced)",
    )  # fmt: skip
    args = parser.parse_args()
    if any(w < 1 or args.members % w for w in args.batch_workers):
        parser.error(
            f"--batch-workers {args.batch_workers}: each must divide --members ({args.members})"
        )

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        mps_env = _start_mps(root / "mps") if args.mps else {}
        model = args.model or "builtin:tiny"
        if args.shape != "tiny" and not args.model:
            from pbt.algorithms.builtin.tiny import build_shaped_model

            model = str(build_shaped_model(root / "model", **SHAPES[args.shape]))
        group, prompts = 8, 8
        manifest = {
            "model": {"name": model},
            "algorithm": {"group_size": group, "prompts_per_step": prompts},
            "rollout": {"max_output_tokens": 32, "engine": args.engine},
            "task": {"name": "builtin:letters", "eval_size": 32},
            "training": {"device": args.device, "steps": 2 * args.steps, "seed": 0},
        }
        rows = [
            _campaign(root, args, manifest, k, k, 1, mps_env, f"{k} at once") for k in args.at_once
        ]
        worker = args.worker_batch
        learning = () if worker is None else (worker or ["in-turn", "batched_train"])
        for train in (mode == "batched_train" for mode in learning):
            for workers in args.batch_workers:
                per_batch = args.members // workers
                batched = {
                    **manifest,
                    "launch": {"members_per_batch": per_batch, "batched_train": train},
                }
                label = (
                    f"{args.members} in one worker" if workers == 1
                    else f"{args.members} in {workers} workers of {per_batch}"
                ) + (", batched_train" if train else "")  # fmt: skip
                rows.append(
                    _campaign(root, args, batched, workers, workers, per_batch, mps_env, label)
                )
        if args.batched:
            rows.append(_batched(manifest, args, root, group * prompts))
        if args.large_batch:
            algorithm = {**manifest["algorithm"], "prompts_per_step": prompts * args.members}
            label = f"1 member of {args.members}x the rows"
            large = {**manifest, "algorithm": algorithm}
            rows.append(_campaign(root, args, large, 1, 1, 1, mps_env, label, members=1))
        if mps_env:
            subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True,
                           env={**os.environ, **mps_env}, check=False)  # fmt: skip

    print(
        f"\n{args.shape} model on {args.device}, engine {args.engine}: {args.members} members x "
        f"{args.steps} steps, {group} x {prompts} completions of up to 32 tokens a step; the "
        f"last of {args.generations} generations{'; under CUDA MPS' if args.mps else ''}\n"
    )
    large = next((r for r in rows if r[0].startswith("1 member of")), None)
    share = " share of one large batch |" if large else ""
    print(
        "| members | wall s | population tok/s | vs one at a time | every result known, s | "
        f"vs one at a time | GPU busy | GPU memory in use | a member's peak |{share}"
    )
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if large else ""))
    first = next((r for r in rows if r[0] == "1 at once"), rows[0])
    for k, wall, rate, busy, used, peak, _, results_s in rows:
        print(
            f"| {k} | {wall:.1f} | {rate:,.0f} | **{rate / first[2]:.2f}x** | {results_s:.1f} | "
            f"{first[7] / results_s:.2f}x | {'-' if busy is None else f'{busy:.0f}%'} | "
            f"{'-' if used is None else f'{used:.1f} GiB'} | "
            f"{'-' if peak is None else f'{peak:.2f} GiB'} |"
            + (f" {rate / large[2]:.0%} |" if large else "")
        )
    if args.batched:
        print(f"\n`{args.members} in one batch`: one process, members_per_batch {args.members}")
    if large:
        print(
            f"`{large[0]}`: one member sampling and training the population's rows "
            "(prompts_per_step x members) through one adapter: the rate a batch could reach"
        )
    exact = [
        r
        for r in rows
        if "one batch" not in r[0] and "batched_train" not in r[0] and r is not large
    ]
    same = len({tuple(r[6]) for r in exact}) == 1
    print(f"\nsame fitness for every member whatever runs at once: {same}")
    for row in (r for r in rows if "batched_train" in r[0]):
        # within float32 ulps, not bit for bit (population_train's doc)
        print(f"fitness with batched_train: {row[6]}")


def _campaign(
    root: Path,
    args,
    manifest: dict,
    slots: int,
    per_gpu: int,
    batch: int,
    mps_env: dict,
    label: str,
    members: int | None = None,
) -> tuple:
    """``--generations`` generations of the members (``--members``, or ``members``) through
    long-lived workers: ``slots`` of them on the GPU, each taking ``batch`` members at a time;
    the last generation's row."""
    members = args.members if members is None else members
    from pbt.launch.local import member_command
    from pbt.launch.persistent import PersistentLauncher

    gpus = 1 if args.device == "cuda" else 0
    group = manifest["algorithm"]["group_size"] * manifest["algorithm"]["prompts_per_step"]
    campaign = root / label.replace(" ", "-").replace(",", "")
    threads = max(1, (os.cpu_count() or 1) // slots)
    launcher = PersistentLauncher(
        member_command(), campaign / "workers", slots=slots, gpus_per_member=gpus,
        gpu_ids=[args.gpu] if gpus else None, members_per_gpu=per_gpu if gpus else 1,
        heartbeat_timeout_s=900.0, env={"OMP_NUM_THREADS": str(threads), **mps_env},
        members_per_batch=batch,
    )  # fmt: skip
    digests: dict[str, str] = {}
    try:
        for generation in range(args.generations):
            tasks = write_tasks(
                root, campaign, manifest, generation, members, args.steps, digests, LR
            )
            last = generation == args.generations - 1
            sampler = _GpuSampler(args.gpu) if last and gpus else None
            start, released = time.perf_counter(), []

            def known(_results, released=released) -> list:  # every result, writes running
                released.append(time.perf_counter())
                return []

            outcomes = launcher.run(tasks, on_released=known)
            wall = time.perf_counter() - start
            results_s = released[0] - start if released else wall
            busy, used = sampler.stop() if sampler else (None, None)
            for o in outcomes:
                if o.status != "ok":
                    raise SystemExit(f"{label}: {o.task_id} {o.detail}")
                digests[o.task_id] = o.result.digest
            tokens = sum(h["completion_length"] * group for o in outcomes for h in o.result.history)
            peaks = [o.result.peak_memory_gib for o in outcomes]
            fitness = [round(o.result.fitness, 4) for o in outcomes]
            print(
                f"{label}, generation {generation}: wall {wall:.1f} s (every result known at "
                f"{results_s:.1f} s), {tokens / wall:,.0f} tok/s, fitness {fitness}; "
                f"{_phases(outcomes)}",
                flush=True,
            )
    finally:
        launcher.close()
    peak = max((p for p in peaks if p is not None), default=None)
    return (label, wall, tokens / wall, busy, used, peak, fitness, results_s)


def _phases(outcomes) -> str:
    """A task's mean seconds by phase (its result's ``timings``: setting up and loading the
    parent, training, evaluating, saving; a batch's are shared by its members)."""
    timings = [o.result.timings for o in outcomes if o.result.timings]
    if not timings:
        return "no timings"
    keys = [k for k in timings[0] if all(k in t for t in timings)]
    mean = {k: sum(t[k] for t in timings) / len(timings) for k in keys}
    return "a task's phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in mean.items())


def _batched(manifest: dict, args, root: Path, rows_per_step: int) -> tuple:
    """The population in one process, rollouts in one batch: the table's row."""
    import torch

    from pbt import create_population

    config = {
        **manifest,
        "launch": {"members_per_batch": args.members},
        "training": {**manifest["training"], "output_dir": str(root / "batched")},
    }
    pop = create_population(config=config, population_size=args.members)
    for i, agent in enumerate(pop):
        agent.set_hyperparameters({"lr": LR * (0.8 + 0.1 * i)})
    cuda = args.device == "cuda"
    for measured in (False, True):
        sampler = _GpuSampler(args.gpu) if measured and cuda else None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start, tokens = time.perf_counter(), 0.0
        for _ in range(args.steps):
            prompts = {agent: agent.sample_prompts() for agent in pop}
            for agent, batch in pop.get_actions(prompts).items():
                agent.learn(batch, agent.reward(prompts[agent], batch))
                tokens += float(batch.completion_mask.sum())
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        busy, used = sampler.stop() if sampler else (None, None)
        print(
            f"{args.members} in one batch, {'measured' if measured else 'warm-up'} round: "
            f"wall {wall:.1f} s, {tokens / wall:,.0f} tok/s",
            flush=True,
        )
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    fitness = [round(agent.test(), 4) for agent in pop]
    return (f"{args.members} in one batch", wall, tokens / wall, busy, used, peak, fitness, wall)


if __name__ == "__main__":
    main()
