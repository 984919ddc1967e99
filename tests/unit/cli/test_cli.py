"""The inspection commands on a real checkpoint: inspect, export, export --merge; Ctrl-C
during ``pbt run``; and what ``pbt check`` says."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from support import FIXTURES, small_manifest, small_sections
from transformers import AutoModelForCausalLM

from pbt.algorithms.runtime.member import Member
from pbt.algorithms.runtime.models import resolve_model_path
from pbt.cli.main import main, pbt_command
from pbt.config import load_manifest
from pbt.config.read.canonical import manifest_from_canonical

AGILERL = FIXTURES / "agilerl"


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
    assert f"interrupted: resume with {pbt_command()} resume {shlex.quote(str(directory))}" in err
    assert "pbt resume DIR" not in err


def test_check_says_its_notes_and_verdict_and_resolved_prints_the_canonical_form(tmp_path, capsys):
    """``pbt check``: a line per note and the verdict, nothing on stdout; ``--resolved``: the
    same lines, and on stdout the configuration as YAML, which loads back to the manifest and
    passes ``pbt check`` itself, with nothing left to translate."""
    path = AGILERL / "grpo.yaml"  # AgileRL's lowercase format, with its notes
    notes = load_manifest(path).notes()
    assert main(["check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == "" and len(notes) >= 3
    assert err.splitlines() == [*(f"note: {n}" for n in notes), f"{path}: valid"]
    assert main(["check", "--resolved", str(path)]) == 0
    resolved, again = capsys.readouterr()
    assert again == err
    assert manifest_from_canonical(yaml.safe_load(resolved), AGILERL) == load_manifest(path)
    for name in ("reward.py", "countdown.jsonl"):
        shutil.copy(AGILERL / name, tmp_path / name)
    (tmp_path / "resolved.yaml").write_text(resolved)
    assert main(["check", str(tmp_path / "resolved.yaml")]) == 0
    assert capsys.readouterr() == ("", f"{tmp_path / 'resolved.yaml'}: valid\n")


def test_check_names_each_problem_on_its_own_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"model": {"nmae": "builtin:tiny"}, "optim": {"lr": -1.0}}))
    assert main(["check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[0] == f"error: {path}: 2 problems"
    problems = err.splitlines()[1:]
    assert len(problems) == 2 and all(p.startswith("  - ") for p in problems), err
    assert "model.nmae is not a known key; did you mean 'name'?" in problems[0]


def test_the_pbt_command_a_message_suggests_runs_as_written(tmp_path, monkeypatch):
    """After ``./dev quickstart`` nothing is activated: the commands the CLI suggests (``more:
    pbt status ...``) name ``pbt`` only when it is on PATH, else its path, and run as printed."""
    bin_dir = Path(sys.executable).parent
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    assert pbt_command() == "pbt"
    monkeypatch.setenv("PATH", f"/usr/bin{os.pathsep}/bin")
    monkeypatch.chdir(tmp_path)
    command = pbt_command()
    assert command != "pbt"
    out = subprocess.run(
        [*shlex.split(command), "--version"],
        capture_output=True,
        text=True,
        env={"PATH": f"/usr/bin{os.pathsep}/bin"},
        cwd=tmp_path,
    )
    assert out.returncode == 0 and out.stdout.startswith("pbt-llm "), out.stderr
