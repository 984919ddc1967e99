"""The task file a worker is handed, read once for both entry points (one task and the serve
loop): a file it cannot use ends the worker with one line that says why, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import task_message

from pbt.protocol.messages import TASK_FILE
from pbt.worker.task import read_task

TASK = task_message()


def test_a_valid_task_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    TASK.write(tmp_path / TASK_FILE)
    assert read_task(tmp_path / TASK_FILE) == TASK
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "is missing or not valid JSON"),
        ('{"campaign_dir": "/r', "is missing or not valid JSON"),
        (json.dumps(TASK.to_dict() | {"version": 9}), "task version 9"),
    ],
)
def test_an_unusable_task_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, said: str
) -> None:
    path = tmp_path / TASK_FILE
    if content is not None:
        path.write_text(content)
    assert read_task(path) is None
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and err.count("\n") == 1
    worker = subprocess.run(
        [sys.executable, "-m", "pbt.worker", str(path)], capture_output=True, text=True
    )
    assert worker.returncode == 2 and worker.stderr == err
