"""The manifest launch: train one member from a manifest, as AgileRL's ``-m agilerl.train``.

    torchrun --nproc_per_node=N -m pbt.train manifest.yaml [--device cuda]
    python -m pbt.train manifest.yaml [--device cpu|cuda|auto] [--output-dir DIR] [--steps N]

The same entry point as ``pbt train`` (:mod:`pbt.worker.train`, where it lives with the other
member entry points): data parallel over the ranks, or FSDP2 when the manifest sets
``distributed.fsdp``; rank 0 prints progress and writes ``metrics.jsonl`` and the checkpoint.
"""

from __future__ import annotations

import sys

from pbt.worker.train import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
