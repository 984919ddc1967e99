"""The inspection commands on a real checkpoint: inspect, export, export --merge; and Ctrl-C
during ``pbt run``."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from peft import PeftModel
from support import small_manifest, small_sections
from transformers import AutoModelForCausalLM

from pbt.algorithms.member import Member
from pbt.algorithms.models import resolve_model_path


def _pbt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pbt.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.integration
def test_inspect_export_and_merge(tmp_path):
    member = Member(small_manifest(tmp_path), torch.device("cpu"), member_id="g004-m01")
    member.learner.train_step(member.task.train, member.task.reward)
    member.fitness.append(0.25)
    digest = member.save(tmp_path / "ckpt")

    shown = _pbt("inspect", str(tmp_path / "ckpt"))
    assert shown.returncode == 0, shown.stderr
    for text in (digest, "g004-m01", '"lr"', "[0.25]", "step 1", "lora_A"):
        assert text in shown.stdout, text

    assert _pbt("export", str(tmp_path / "ckpt"), str(tmp_path / "adapter")).returncode == 0
    assert (
        _pbt("export", str(tmp_path / "ckpt"), str(tmp_path / "merged"), "--merge").returncode == 0
    )
    again = _pbt("export", str(tmp_path / "ckpt"), str(tmp_path / "adapter"))
    assert again.returncode == 2 and "already exists" in again.stderr

    ids = member.tokenizer("Say q again and again.", return_tensors="pt")["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny"))
    adapter = PeftModel.from_pretrained(base, tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    member.model.eval()
    with torch.no_grad():
        want = member.model(ids).logits
        torch.testing.assert_close(adapter(ids).logits, want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(merged(ids).logits, want, atol=1e-4, rtol=1e-3)


def test_inspect_refuses_a_corrupted_checkpoint(tmp_path):
    member = Member(small_manifest(tmp_path), torch.device("cpu"))
    member.save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "attributes.pt").write_bytes(b"truncated")
    shown = _pbt("inspect", str(tmp_path / "ckpt"))
    assert shown.returncode == 2 and "does not match its digest" in shown.stderr
    assert "Traceback" not in shown.stderr


def test_ctrl_c_during_run_names_the_command_that_resumes(tmp_path):
    """SIGINT to the controller's process group, as a terminal's Ctrl-C sends it, once the
    campaign has started: exit 130, no traceback, and the resume command with the real path."""
    sections = small_sections(tmp_path)
    sections |= {
        "population": {"size": 2, "tournament_size": 2},
        "launch": {"slots": 1},
        "tracking": {"enabled": False},
    }
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(sections))
    directory = tmp_path / "my campaign"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pbt.cli", "run", str(path), "--dir", str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # as a terminal's foreground job has it, even when the suite runs in the background
        # (where the shell leaves SIGINT ignored, and children inherit that)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        first = proc.stdout.readline()
        assert first.startswith(f"campaign {directory}: started"), first + proc.stderr.read()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert f"interrupted: resume with pbt resume {shlex.quote(str(directory))}" in err, err
    assert "pbt resume DIR" not in err
