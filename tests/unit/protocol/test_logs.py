"""Library chatter stays off the user's stderr: ``kernels`` (imported by bitsandbytes, which
peft imports) warns on every import while the Hugging Face Hub is offline."""

from __future__ import annotations

import subprocess
import sys

WARN = (
    "import logging; logging.getLogger('kernels._internals.hf_hub').warning('Skipping publisher')"
)


def _stderr(code: str) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stderr


def test_the_kernels_warning_prints_unless_quieted() -> None:
    assert "Skipping publisher" in _stderr(WARN)  # what a bare process shows
    quiet = "from pbt.protocol.logs import quiet_library_loggers; quiet_library_loggers(); "
    assert _stderr(quiet + WARN) == ""
