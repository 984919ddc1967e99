"""What the CUDA allocator held at its peak, by where it was allocated, from a snapshot that
``bench/activation_memory.py --snapshot DIR`` wrote (``torch.cuda.memory._dump_snapshot`` with
its stacks).

    python bench/memory_peak.py DIR/activation_checkpointing.pickle DIR/qlora+...pickle

Replays the allocator's trace (an allocation counts until it is released, as
``torch.cuda.max_memory_allocated`` counts it), finds the moment of the largest total, and
prints the allocations alive then, grouped by the innermost frames outside torch's own
modules, largest first. Totals are above what was allocated when recording began (the
weights, the optimizer's states); ``DIR/MODE.start`` holds that figure.
"""

from __future__ import annotations

import argparse
import collections
import pickle
from pathlib import Path

GIB = 2**30
FRAMEWORK = ("/torch/", "/contextlib.py", "<frozen", "/functools.py", "/threading.py")


def site(frames: list[dict], depth: int) -> str:
    """The ``depth`` innermost Python frames outside torch's own code, as ``file:line name``;
    for an allocation of the backward pass (no Python frame), its autograd node."""
    kept = [
        f"{Path(f['filename']).name}:{f['line']} {f['name']}"
        for f in frames
        if f["filename"].endswith(".py") and not any(part in f["filename"] for part in FRAMEWORK)
    ]
    if kept:
        return " < ".join(kept[:depth])
    nodes = [f["name"] for f in frames if "Backward" in f["name"] or "autograd::" in f["name"]]
    return f"backward: {nodes[0][:120]}" if nodes else "(no Python frame)"


def peak(trace: list[dict]) -> tuple[int, dict[int, dict]]:
    """The largest total allocated over ``trace`` (above its start) and what was alive then."""
    alive: dict[int, dict] = {}
    total = top = 0
    at_top: dict[int, dict] = {}
    for event in trace:
        action = event["action"]
        if action == "alloc":
            alive[event["addr"]] = event
            total += event["size"]
            if total > top:
                top, at_top = total, dict(alive)
        elif action == "free_requested":
            alive.pop(event["addr"], None)
            total -= event["size"]  # a block allocated before recording lowers the start's
    return top, at_top


def report(path: Path, depth: int, rows: int) -> None:
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    start_file = path.with_suffix(".start")
    start = int(start_file.read_text()) if start_file.exists() else 0
    trace = [e for device in snapshot["device_traces"] for e in device]
    top, alive = peak(trace)
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for event in alive.values():
        key = site(event.get("frames", []), depth)
        groups[key][0] += event["size"]
        groups[key][1] += 1
    print(f"\n## {path.stem}")
    print(
        f"allocated when recording began {start / GIB:.3f} GiB; peak above it "
        f"{top / GIB:.3f} GiB (total {(start + top) / GIB:.3f} GiB); {len(trace):,} events"
    )
    print("\n| GiB | tensors | allocated at |\n|---|---|---|")
    for key, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"| {size / GIB:.3f} | {count} | {key} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshots", nargs="+", type=Path)
    parser.add_argument("--depth", type=int, default=3, help="frames shown per site")
    parser.add_argument("--rows", type=int, default=15, help="sites shown per snapshot")
    args = parser.parse_args()
    for path in args.snapshots:
        report(path, args.depth, args.rows)


if __name__ == "__main__":
    main()
