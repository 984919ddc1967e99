"""The README's front door runs as written: its library-mode snippet, taken from the README
itself, prints a line as each member is evaluated and finishes in minutes on a CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import REPO

README = REPO / "README.md"


def python_snippets(text: str) -> list[str]:
    """The ``python`` code blocks of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readme_has_one_library_snippet():
    snippets = python_snippets(README.read_text())
    assert len(snippets) == 1, "one runnable snippet, not alternatives to pick from"
    assert "GRPO.population(" in snippets[0] and "print(" in snippets[0]


@pytest.mark.integration
def test_the_readme_library_snippet_runs_as_written_with_progress(tmp_path: Path):
    (snippet,) = python_snippets(README.read_text())
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-u", str(script)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines, times = [], []
    for line in proc.stdout:
        times.append(time.monotonic() - started)
        lines.append(line.rstrip("\n"))
    err = proc.stderr.read()
    assert proc.wait(timeout=600) == 0, err[-3000:]
    progress = [
        line for line in lines if re.fullmatch(r"generation \d g\d{3}-m\d\d: fitness [\d.]+", line)
    ]
    assert len(progress) == 12 and progress == lines, lines  # 3 generations x 4 members
    # the lines come as the members are evaluated, not in one burst at the end (held back
    # by buffering, all 12 would arrive within milliseconds; the three generations train for
    # seconds between them, however long the imports before took on a loaded machine)
    assert times[-1] - times[0] > 1.0, times
