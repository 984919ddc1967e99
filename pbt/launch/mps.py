"""A private CUDA MPS daemon for members that share a GPU (``launch.members_per_gpu`` > 1).

Without MPS, CUDA time-slices the kernels of different processes: several members on one GPU
fill its idle gaps but never run at once. Under an MPS daemon their kernels run side by side
(measured on one H200: 8 members of the 0.5B shape at once gave 1.46x the population tokens/s
of one at a time time-sliced, 3.60x under MPS; ``bench/RESULTS.md``). The daemon is the
campaign's own: its pipes and logs live in a private folder, only the campaign's workers are
pointed at it (``CUDA_MPS_PIPE_DIRECTORY``), and it is asked to quit when the campaign closes.
It changes no setting of the GPU. An MPS daemon the environment already names is used as it is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


class MpsDaemon:
    """Start with :meth:`start`; :attr:`env` points a CUDA process at it; :meth:`stop` ends it."""

    def __init__(self) -> None:
        self.env: dict[str, str] = {}
        self.folder: Path | None = None
        self.note = ""

    def start(self) -> MpsDaemon:
        """Start the daemon, or say (in :attr:`note`) why the members will be time-sliced."""
        if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
            self.note = "members share each GPU through the MPS daemon this environment names"
            return self
        control = shutil.which(CONTROL)
        if control is None:
            self.note = (
                f"{CONTROL} is not on PATH: members that share a GPU are time-sliced, not run "
                "side by side (launch.mps needs CUDA's MPS; set launch.mps: false to silence this)"
            )
            return self
        # a short path: the daemon's socket must fit a Unix socket name (108 bytes)
        self.folder = Path(tempfile.mkdtemp(prefix="pbt-mps-"))
        env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.folder / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(self.folder / "log"),
        }
        for path in env.values():
            Path(path).mkdir()
        done = subprocess.run(
            [control, "-d"], env={**os.environ, **env}, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            self.note = (
                f"{CONTROL} -d failed ({(done.stderr or done.stdout).strip() or done.returncode}):"
                " members that share a GPU are time-sliced"
            )
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
            return self
        self.env = env
        self.note = f"members share each GPU under a private MPS daemon ({self.folder})"
        return self

    def stop(self) -> None:
        """Ask the daemon to quit (its clients have ended by then) and remove its folder."""
        if not self.env:
            return
        control = shutil.which(CONTROL) or CONTROL
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                [control], input="quit\n", text=True, env={**os.environ, **self.env},
                capture_output=True, timeout=30, check=False,
            )  # fmt: skip
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.env = {}
