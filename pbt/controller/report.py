"""What a campaign looks like to a person: status tables, the family tree, fitness curves.

Reads the campaign store and the controller lock's record only (never the member processes), so
it works while a campaign runs, after it stopped, and after a crash; a campaign with work left
whose controller is gone says so, and what to run.
"""

from __future__ import annotations

import math
import shlex
import time
from pathlib import Path

from pbt.config.errors import PbtError
from pbt.controller.lock import controller_running, last_controller
from pbt.controller.progress import describe, format_duration
from pbt.controller.store import STORE_FILENAME, CampaignStore
from pbt.launch.slurm import WAITING, read_job
from pbt.protocol.engines import read_statuses
from pbt.protocol.progress import read_progress
from pbt.protocol.records import MemberRecord


def _open(directory: Path) -> CampaignStore:
    if not (directory / STORE_FILENAME).exists():
        raise PbtError(f"{directory} holds no campaign (no store.db)")
    return CampaignStore(directory / STORE_FILENAME)


def status_text(directory: Path) -> str:
    """Generation, whether a controller runs it (when it has work left), each member's status
    (``collapsed`` for one ended for lack of signal, ``interrupted`` for one whose controller
    died while it ran), fitness, zero-signal fraction (mean over its steps / last step) and
    hyperparameters, each running member's progress (from its heartbeat) and log, the dedicated
    rollout engines of the current generation's members, every fault, and the broken
    checkpoints that members were replaced for."""
    with _open(directory) as store:
        members = store.members()
        faults = store.faults()
        committed = store.last_committed_generation()
        best = store.best()
    if not members:
        return f"{directory}: no members yet"
    current = max(m.generation for m in members)
    lines = [f"campaign {directory}: generation {current} (last committed: {committed})"]
    gone = None
    if committed is None or current > committed:  # work left: is anyone doing it?
        gone = _controller_gone(Path(directory))
    if gone:
        lines.append(gone)
    if best:
        lines.append(f"best so far: {best[0]} fitness {best[1]:.4f}")
    jobs = {m.member_id: read_job(Path(directory) / "tasks" / m.member_id) for m in members}
    table = [m for m in members if m.generation == current]
    lines += ["", _member_table(table, jobs, interrupted=gone is not None)]
    running = [m for m in members if m.status == "running"]
    if running:
        lines += ["", "last seen running:" if gone else "running:"]
        lines += [_running_line(Path(directory), m, jobs.get(m.member_id)) for m in running]
    engines = _engine_lines(Path(directory), table)
    if engines:
        lines += ["", "rollout engines:", *engines]
    if faults:
        lines += ["", f"faults ({len(faults)}):"]
        lines += [
            f"  gen {f['generation']} {f['member_id']} attempt {f['attempt']}: {f['kind']}: "
            f"{(f['detail'] or '').splitlines()[0] if f['detail'] else ''}"
            for f in faults
        ]
    broken = _broken_checkpoints(members, faults)
    if broken:
        lines += ["", "broken checkpoints (each member that loaded one was replaced at once):"]
        lines += [f"  {path}  (parent of {', '.join(who)})" for path, who in broken.items()]
    return "\n".join(lines)


def _controller_gone(directory: Path) -> str | None:
    """A line saying that no controller runs the campaign, and what to run; None while one
    does (or where that cannot be told)."""
    try:
        if controller_running(directory) is not None:
            return None
    except (OSError, PbtError):
        return None
    record = last_controller(directory) or {}
    last = ""
    if isinstance(record.get("pid"), int):
        last = f" (the last was pid {record['pid']}"
        last += f" on {record['host']})" if record.get("host") else ")"
    return (
        f"controller: none running{last}, and the campaign has work left: continue it with: "
        f"pbt resume {shlex.quote(str(directory))}"
    )


def _broken_checkpoints(members: list[MemberRecord], faults: list[dict]) -> dict[str, list[str]]:
    """Each parent checkpoint refused on loading (``bad_checkpoint``), with the members that
    loaded it."""
    parents = {m.member_id: m.parent_checkpoint for m in members}
    broken: dict[str, list[str]] = {}
    for f in faults:
        path = parents.get(f["member_id"])
        if f["kind"] == "bad_checkpoint" and path:
            broken.setdefault(path, []).append(f["member_id"])
    return broken


def _running_line(directory: Path, m: MemberRecord, job: dict | None) -> str:
    """Where a running member is: its job (state, and why it waits), its progress and its
    log."""
    log = directory / "logs" / f"{m.member_id}.attempt{m.attempts}.log"
    where = ""
    if job is not None:
        reason = f" ({job['reason']})" if job.get("reason") else ""
        where = f"job {job['job_id']} {job.get('state', '?')}{reason}  "
    progress = _progress(directory / "tasks" / m.member_id / "heartbeat")
    return f"  {m.member_id}  {where}{progress}  log {log}"


def _engine_lines(directory: Path, members: list[MemberRecord]) -> list[str]:
    """A line per dedicated rollout engine of ``members``, from the status files their trainers
    write (:mod:`pbt.protocol.engines`): pid, device, adapter version, heartbeat age, restarts
    and rows dropped as stale."""
    now = time.time()
    return [
        f"  {m.member_id} {status.line(now)}"
        for m in members
        for status in read_statuses(directory / "tasks" / m.member_id)
    ]


def _progress(heartbeat: Path) -> str:
    """``step 3/10 reward 0.410 312 tok/s eta 12 s (heartbeat 2 s ago)``: what the member's
    heartbeat says, and its age (a stale one: a member, or a controller, no longer alive)."""
    try:
        age = time.time() - heartbeat.stat().st_mtime
    except OSError:
        return "no heartbeat yet"
    return f"{describe(read_progress(heartbeat))} (heartbeat {format_duration(age)} ago)"


def _shown_status(m: MemberRecord, job: dict | None, interrupted: bool) -> str:
    if m.collapsed:
        return "collapsed"
    if m.status == "running" and interrupted:
        return "interrupted"
    if m.status == "running" and job is not None and job.get("state") in WAITING:
        return "queued"
    return m.status


def _member_table(
    members: list[MemberRecord], jobs: dict[str, dict | None], interrupted: bool = False
) -> str:
    names = sorted({k for m in members for k in m.hyperparameters})
    header = ["member", "parent", "status", "tries", "fitness", "zero-signal", *names, "mutation"]
    rows = [header]
    for m in members:
        fit = m.fitness_history[-1] if m.fitness_history and m.status == "done" else None
        rows.append(
            [
                m.member_id,
                m.parent_id or "-",
                _shown_status(m, jobs.get(m.member_id), interrupted),
                str(m.attempts),
                f"{fit:.4f}" if fit is not None else "-",
                _zero_signal(m),
                *(f"{m.hyperparameters.get(k, float('nan')):.4g}" for k in names),
                (m.mutation or "initial")[:40],
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _zero_signal(m: MemberRecord) -> str:
    """``0.42/1.00``: the zero-signal fraction over the member's steps and at its last step."""
    figures = m.metrics
    if "zero_signal_fraction_mean" not in figures:
        return "-"
    return f"{figures['zero_signal_fraction_mean']:.2f}/{figures['zero_signal_fraction']:.2f}"


def lineage_text(directory: Path, member_id: str | None = None) -> str:
    """The family tree: every member with its parent and mutation, or one member's ancestry."""
    with _open(directory) as store:
        members = {m.member_id: m for m in store.members()}
    if member_id is not None:
        return "\n".join(
            f"  gen {m.generation}  {m.member_id}  fitness {_last(m)}  <- {m.mutation or 'initial'}"
            for m in _line_of_descent(members, member_id)
        )
    by_gen: dict[int, list[MemberRecord]] = {}
    for m in members.values():
        by_gen.setdefault(m.generation, []).append(m)
    lines = []
    for gen in sorted(by_gen):
        lines.append(f"generation {gen}")
        lines += [
            f"  {m.member_id} <- {m.parent_id or 'base model'}  [{m.mutation or 'initial'}]  fitness {_last(m)}"
            for m in sorted(by_gen[gen], key=lambda x: x.member_id)
        ]
    return "\n".join(lines)


def _last(m: MemberRecord) -> str:
    return f"{m.fitness_history[-1]:.4f}" if m.fitness_history and m.status == "done" else "-"


def lineage_png(directory: Path, out: Path) -> Path:
    """Draw the family tree: generations left to right, member slots top to bottom, an edge per
    parent, each member coloured by its fitness and captioned with the mutation that made it;
    the best member's line of descent is drawn in red."""
    plt = _pyplot()
    with _open(directory) as store:
        members = store.members()
        best = store.best()
    by_id = {m.member_id: m for m in members}
    line = _line_of_descent(by_id, best[0]) if best else []
    on_line = {m.member_id for m in line}
    at = {m.member_id: (m.generation, _slot(m)) for m in members}
    generations, slots = max(g for g, _ in at.values()) + 1, max(s for _, s in at.values()) + 1
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * generations + 2.5), 0.85 * slots + 2.2))
    for m in members:
        if m.parent_id in by_id:
            best_edge = m.member_id in on_line
            xs, ys = zip(at[m.parent_id], at[m.member_id], strict=True)
            ax.plot(xs, ys, color=_BEST if best_edge else "0.7", lw=2.4 if best_edge else 1.0,
                    zorder=2 if best_edge else 1)  # fmt: skip
    points = ax.scatter(
        [at[m.member_id][0] for m in members],
        [at[m.member_id][1] for m in members],
        c=[_final_fitness(m) for m in members],
        cmap="viridis",
        s=200,
        zorder=3,
        edgecolors=[_BEST if m.member_id in on_line else "black" for m in members],
        linewidths=[2.4 if m.member_id in on_line else 0.8 for m in members],
    )
    for m in members:
        if m.parent_id:  # generation 0 has no mutation to show
            ax.annotate(
                _short_mutation(m.mutation), at[m.member_id], xytext=(0, -10),
                textcoords="offset points", ha="center", va="top", fontsize=7, zorder=4,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85},
            )  # fmt: skip
    fig.colorbar(points, ax=ax, label="fitness", pad=0.02)
    ax.set_xticks(range(generations))
    ax.set_yticks(range(slots), [f"m{s:02d}" for s in range(slots)])
    ax.set_xlim(-0.5, generations - 0.5)
    ax.set_ylim(slots - 0.4, -0.6)  # slot 0 on top, room for the bottom row's captions
    ax.set_xlabel("generation")
    ax.set_ylabel("member slot")
    title = f"lineage of {directory.name}"
    if line:
        title += f"\nin red: the line of the best member, {best[0]} (fitness {best[1]:.4g})"
    ax.set_title(title, fontsize=10)
    return _save(fig, out)


_BEST = "crimson"


def _slot(m: MemberRecord) -> int:
    return int(m.member_id.rsplit("m", 1)[1])


def _final_fitness(m: MemberRecord) -> float:
    return float(m.fitness_history[-1]) if m.fitness_history and m.status == "done" else math.nan


def _line_of_descent(by_id: dict[str, MemberRecord], member: str) -> list[MemberRecord]:
    """``member`` and its ancestors, oldest first."""
    chain = []
    current = by_id.get(member)
    while current is not None:
        chain.append(current)
        current = by_id.get(current.parent_id) if current.parent_id else None
    return chain[::-1]


def _short_mutation(mutation: str | None) -> str:
    """``lr x1.2`` for ``lr x1.2 (0.001 -> 0.0012)``; ``elite`` for an unchanged elite copy."""
    if not mutation:
        return "initial"
    if mutation == "none (elite)":
        return "elite"
    return mutation.split(" (")[0]


def fitness_curve_text(directory: Path) -> str:
    """Best and mean fitness per generation, one line each."""
    with _open(directory) as store:
        members = [m for m in store.members() if m.status == "done" and m.fitness_history]
    by_gen: dict[int, list[float]] = {}
    for m in members:
        by_gen.setdefault(m.generation, []).append(m.fitness_history[-1])
    return "\n".join(
        f"  gen {g}: best {max(v):.4f}  mean {sum(v) / len(v):.4f}  "
        + "#" * round(40 * max(0.0, max(v)))
        for g, v in sorted(by_gen.items())
    )


def fitness_png(directory: Path, out: Path) -> Path:
    """Every member's fitness by generation (dots), the best and the mean (lines), and the
    best member's line of descent (red)."""
    plt = _pyplot()
    with _open(directory) as store:
        members = store.members()
        best = store.best()
    by_gen: dict[int, list[float]] = {}
    for m in members:
        if m.status == "done" and m.fitness_history:
            by_gen.setdefault(m.generation, []).append(m.fitness_history[-1])
    gens = sorted(by_gen)
    fig, ax = plt.subplots(figsize=(7, 4))
    for g in gens:
        ax.scatter([g] * len(by_gen[g]), by_gen[g], color="0.6", s=18, zorder=2)
    ax.plot(gens, [max(by_gen[g]) for g in gens], marker="o", label="best")
    ax.plot(gens, [sum(by_gen[g]) / len(by_gen[g]) for g in gens], marker="s", label="mean")
    if best:
        line = _line_of_descent({m.member_id: m for m in members}, best[0])
        ax.plot([m.generation for m in line], [_final_fitness(m) for m in line], color=_BEST,
                lw=2, marker=".", label=f"{best[0]} and its ancestors", zorder=3)  # fmt: skip
    _integer_ticks(ax.xaxis)
    ax.set_xlabel("generation")
    ax.set_ylabel("fitness")
    ax.set_title(f"fitness of {directory.name}")
    ax.legend(fontsize=8)
    return _save(fig, out)


def _integer_ticks(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def hyperparameters_png(directory: Path, out: Path) -> Path:
    """Each hyperparameter's value per member slot across generations: the schedules the
    population found (log scale for values spanning more than a decade)."""
    plt = _pyplot()
    with _open(directory) as store:
        members = store.members()
    names = sorted({k for m in members for k in m.hyperparameters})
    varied = [n for n in names if len({m.hyperparameters.get(n) for m in members}) > 1] or names
    fig, axes = plt.subplots(len(varied), 1, figsize=(7, 2.6 * len(varied)), squeeze=False)
    slots = sorted({m.member_id.rsplit("m", 1)[1] for m in members})
    for ax, name in zip(axes[:, 0], varied, strict=True):
        for slot in slots:
            line = sorted(
                (m.generation, m.hyperparameters[name])
                for m in members
                if m.member_id.endswith(f"m{slot}") and name in m.hyperparameters
            )
            ax.plot([g for g, _ in line], [v for _, v in line], marker="o", label=f"m{slot}")
        values = [m.hyperparameters[name] for m in members if name in m.hyperparameters]
        if min(values) > 0 and max(values) / min(values) > 10:
            ax.set_yscale("log")
        ax.set_ylabel(name)
    axes[-1, 0].set_xlabel("generation")
    for ax in axes[:, 0]:
        _integer_ticks(ax.xaxis)
    axes[0, 0].legend(fontsize=7, ncol=min(len(slots), 8))
    axes[0, 0].set_title(f"hyperparameters of {directory.name}")
    return _save(fig, out)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
