"""What a campaign looks like to a person: status tables, the family tree, fitness curves.

Reads the campaign store only (never the member processes), so it works while a campaign runs,
after it stopped, and after a crash.
"""

from __future__ import annotations

from pathlib import Path

from pbt.config.errors import PbtError
from pbt.controller.store import STORE_FILENAME, CampaignStore
from pbt.protocol.records import MemberRecord


def _open(directory: Path) -> CampaignStore:
    if not (directory / STORE_FILENAME).exists():
        raise PbtError(f"{directory} holds no campaign (no store.db)")
    return CampaignStore(directory / STORE_FILENAME)


def status_text(directory: Path) -> str:
    """Generation, each member's status, fitness and hyperparameters, and every fault."""
    with _open(directory) as store:
        members = store.members()
        faults = store.faults()
        committed = store.last_committed_generation()
        best = store.best()
    if not members:
        return f"{directory}: no members yet"
    current = max(m.generation for m in members)
    lines = [f"campaign {directory}: generation {current} (last committed: {committed})"]
    if best:
        lines.append(f"best so far: {best[0]} fitness {best[1]:.4f}")
    lines += ["", _member_table([m for m in members if m.generation == current])]
    if faults:
        lines += ["", f"faults ({len(faults)}):"]
        lines += [
            f"  gen {f['generation']} {f['member_id']} attempt {f['attempt']}: {f['kind']}: "
            f"{(f['detail'] or '').splitlines()[0] if f['detail'] else ''}"
            for f in faults
        ]
    return "\n".join(lines)


def _member_table(members: list[MemberRecord]) -> str:
    names = sorted({k for m in members for k in m.hyperparameters})
    header = ["member", "parent", "status", "tries", "fitness", *names, "mutation"]
    rows = [header]
    for m in members:
        fit = m.fitness_history[-1] if m.fitness_history and m.status == "done" else None
        rows.append(
            [
                m.member_id,
                m.parent_id or "-",
                m.status,
                str(m.attempts),
                f"{fit:.4f}" if fit is not None else "-",
                *(f"{m.hyperparameters.get(k, float('nan')):.4g}" for k in names),
                (m.mutation or "initial")[:40],
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def lineage_text(directory: Path, member_id: str | None = None) -> str:
    """The family tree: every member with its parent and mutation, or one member's ancestry."""
    with _open(directory) as store:
        members = {m.member_id: m for m in store.members()}
    if member_id is not None:
        chain = []
        current = members.get(member_id)
        while current is not None:
            chain.append(current)
            current = members.get(current.parent_id) if current.parent_id else None
        return "\n".join(
            f"  gen {m.generation}  {m.member_id}  fitness {_last(m)}  <- {m.mutation or 'initial'}"
            for m in reversed(chain)
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
    """Draw the family tree: generations left to right, an edge per parent labelled with the
    mutation, and each member coloured by its fitness."""
    plt = _pyplot()
    with _open(directory) as store:
        members = store.members()
    slot = {m.member_id: int(m.member_id.rsplit("m", 1)[1]) for m in members}
    fig, ax = plt.subplots(
        figsize=(2.4 * (max(m.generation for m in members) + 1) + 2, 1.2 * max(slot.values()) + 2.5)
    )
    by_id = {m.member_id: m for m in members}
    for m in members:
        if m.parent_id in by_id:
            parent = by_id[m.parent_id]
            ax.annotate(
                "",
                xy=(m.generation, slot[m.member_id]),
                xytext=(parent.generation, slot[parent.member_id]),
                arrowprops={"arrowstyle": "->", "color": "0.6"},
            )
            label = (m.mutation or "").split(" (")[0]
            mid = (
                (m.generation + parent.generation) / 2,
                (slot[m.member_id] + slot[parent.member_id]) / 2,
            )
            ax.text(*mid, label, fontsize=7, ha="center", va="bottom", color="0.3")
    fitness = [
        float(m.fitness_history[-1]) if m.fitness_history and m.status == "done" else float("nan")
        for m in members
    ]
    points = ax.scatter(
        [m.generation for m in members],
        [slot[m.member_id] for m in members],
        c=fitness,
        cmap="viridis",
        s=260,
        zorder=3,
        edgecolors="black",
    )
    for m in members:
        ax.text(
            m.generation, slot[m.member_id] - 0.32, m.member_id, fontsize=7, ha="center", va="top"
        )
    fig.colorbar(points, ax=ax, label="fitness")
    ax.set_xlabel("generation")
    ax.set_ylabel("member slot")
    ax.set_title(f"lineage of {directory.name}")
    ax.invert_yaxis()
    return _save(fig, out)


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
    """Every member's fitness by generation (dots), with the best and the mean (lines)."""
    plt = _pyplot()
    with _open(directory) as store:
        members = [m for m in store.members() if m.status == "done" and m.fitness_history]
    by_gen: dict[int, list[float]] = {}
    for m in members:
        by_gen.setdefault(m.generation, []).append(m.fitness_history[-1])
    gens = sorted(by_gen)
    fig, ax = plt.subplots(figsize=(7, 4))
    for g in gens:
        ax.scatter([g] * len(by_gen[g]), by_gen[g], color="0.6", s=18, zorder=2)
    ax.plot(gens, [max(by_gen[g]) for g in gens], marker="o", label="best")
    ax.plot(gens, [sum(by_gen[g]) / len(by_gen[g]) for g in gens], marker="s", label="mean")
    ax.set_xlabel("generation")
    ax.set_ylabel("fitness")
    ax.set_title(f"fitness of {directory.name}")
    ax.legend()
    return _save(fig, out)


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
