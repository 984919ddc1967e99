"""What can be checked before a run is checked (``model.name``), and a member that fails says
why: its one-line cause and its worker's own exit code reach the controller's output and
``pbt status``; a configuration error is not retried."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from huggingface_hub.errors import LocalEntryNotFoundError
from support import small_sections

from pbt.cli.main import main as pbt
from pbt.config.errors import ConfigError, DivergedError
from pbt.config.read.loader import manifest_from_dict
from pbt.config.sections.model import locate_model, model_load_error
from pbt.launch.local import LocalLauncher, TaskSpec
from pbt.protocol import faults


def _manifest(folder: Path, model: str, **sections: dict) -> Path:
    data = small_sections(folder, model={"name": model}, **sections)
    path = folder / "manifest.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _model_folder(path: Path, config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


# -- model.name, checked without loading ------------------------------------------------------


def test_model_names_are_told_apart_without_loading_anything(tmp_path):
    good = _model_folder(tmp_path / "models" / "good", {"model_type": "qwen2"})
    _model_folder(tmp_path / "bare")
    (tmp_path / "weights.bin").write_bytes(b"")
    kinds = {
        "builtin:tiny": "builtin",
        "models/good": "folder",  # two parts, but it exists: a folder, not a hub id
        str(good): "folder",
        "gpt2": "hub",
        "Qwen/Qwen2.5-0.5B-Instruct": "hub",
        "./nope": "invalid",
        "/nowhere/model": "invalid",
        "~/nowhere-pbt-model": "invalid",
        "org/name/extra": "invalid",
        "bare": "invalid",
        "weights.bin": "invalid",
        "builtin:huge": "invalid",
        "my model": "invalid",
    }
    for name, kind in kinds.items():
        where = locate_model(name, tmp_path)
        assert where.kind == kind, (name, where)
        assert bool(where.problem) == (kind == "invalid"), (name, where)
        assert bool(where.note) == (kind == "hub"), (name, where)
    assert locate_model("models/good", tmp_path).path == good
    missing = locate_model("./nope", tmp_path).problem
    assert missing.startswith("model.name ('./nope') is not a folder: ")
    assert str(tmp_path / "nope") in missing and "give a model folder" in missing
    assert "config.json" in locate_model("bare", tmp_path).problem
    assert "builtin:tiny" in locate_model("builtin:huge", tmp_path).problem


def test_a_relative_model_folder_resolves_against_the_manifest(tmp_path):
    _model_folder(tmp_path / "m", {"model_type": "qwen2"})
    sections = {"model": {"name": "./m"}}
    assert manifest_from_dict(sections, base_dir=tmp_path).model.name == "./m"
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    with pytest.raises(ConfigError, match=r"model.name \('./m'\) is not a folder"):
        manifest_from_dict(sections, base_dir=elsewhere)


def test_pbt_check_says_what_is_wrong_with_model_name(tmp_path, capsys):
    _model_folder(tmp_path / "bare")
    for name, expected in (
        ("./nope", f"model.name ('./nope') is not a folder: {tmp_path / 'nope'} does not exist"),
        ("bare", f"model.name ('bare') is a folder without config.json ({tmp_path / 'bare'}"),
    ):
        assert pbt(["check", str(_manifest(tmp_path, name))]) == 2
        err = capsys.readouterr().err
        problems = [line for line in err.splitlines() if line.startswith("  - ")]
        assert len(problems) == 1 and expected in problems[0], err
        assert "Traceback" not in err
    assert pbt(["check", str(_manifest(tmp_path, "someorg/somemodel"))]) == 0
    err = capsys.readouterr().err
    assert "note: model.name ('someorg/somemodel') is not a local folder" in err
    assert "Hugging Face hub" in err and err.rstrip().endswith("valid")


def test_pbt_run_refuses_a_missing_model_before_any_member_starts(tmp_path, capsys):
    directory = tmp_path / "campaign"
    assert pbt(["run", str(_manifest(tmp_path, "./nope")), "--dir", str(directory)]) == 2
    assert "model.name ('./nope') is not a folder" in capsys.readouterr().err
    assert not directory.exists()


def test_a_hub_error_becomes_one_line(tmp_path):
    def wrapped(inner: Exception) -> OSError:
        try:
            raise OSError("We couldn't connect to 'https://huggingface.co'.\nCheck...") from inner
        except OSError as err:
            return err

    offline = model_load_error("org/m", "org/m", "model", wrapped(LocalEntryNotFoundError("x")))
    assert not isinstance(offline, ConfigError)  # a hub out of reach may come back: retried
    assert "\n" not in str(offline) and "hub is unreachable" in str(offline)
    folder = model_load_error("m", str(tmp_path), "model", ValueError("Unrecognized model.\nMore"))
    assert isinstance(folder, ConfigError)
    assert folder.problems == [
        f"model.name ('m'): the model in {tmp_path} could not be loaded (Unrecognized model.); "
        "give a folder that save_pretrained wrote (config.json, weights, tokenizer)"
    ]


# -- a failed member's cause ------------------------------------------------------------------


def test_the_first_report_of_an_attempt_stands(tmp_path):
    config = ConfigError(["model.name ('x') is wrong; fix it", "lora.r (0) must be > 0"])
    assert faults.report(tmp_path, config) == "config_error"
    assert faults.report(tmp_path, RuntimeError("gloo: connection closed"), exit_code=1) is None
    cause = faults.read_cause(tmp_path)
    assert cause == faults.Cause(
        "config_error", "model.name ('x') is wrong; fix it; lora.r (0) must be > 0", 2
    )
    assert faults.read(tmp_path)[0] == "config_error"
    inside = RuntimeError("while handling")
    inside.__context__ = config
    assert faults.classify(inside) is None  # a ConfigError counts only as itself
    assert faults.one_line(DivergedError(3, 3, 7)).startswith("training diverged at step 7")
    assert faults.one_line(KeyError("k")) == "KeyError: 'k'"


AGENT = """
import sys
from pathlib import Path
task_dir = Path(sys.argv[-1]).parent
if task_dir.name == "reported":
    from pbt.protocol import faults
    faults.report(task_dir, KeyError("lr"), exit_code=1)
print("Root Cause (first observed failure):\\n  rank      : 0\\n  exitcode  : -9 (pid: 1)")
sys.exit(1)
"""


def test_the_launcher_shows_the_workers_cause_and_exit_code(tmp_path):
    tasks = []
    for name in ("reported", "killed"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "task.json").write_text("{}")
        tasks.append(TaskSpec(name, tmp_path / name, tmp_path / f"{name}.log"))
    launcher = LocalLauncher([sys.executable, "-c", AGENT], slots=2, poll_s=0.05)
    reported, killed = launcher.run(tasks)
    assert (reported.status, reported.returncode) == ("failed", 1)
    assert reported.detail.splitlines()[0] == "KeyError: 'lr'; worker exit code 1"
    assert killed.detail.splitlines()[0] == "exit code 1 (worker killed by SIGKILL)"


@pytest.mark.integration
def test_a_member_that_cannot_load_its_model_says_why(tmp_path, capsys):
    # a folder with a config.json passes pbt check; the members find it holds no model
    _model_folder(tmp_path / "broken", {"model_type": "qwen2"})
    manifest = _manifest(
        tmp_path,
        "broken",
        population={"size": 2, "evo_steps": 1},
        budget={"generations": 1},
        launch={"slots": 2, "max_attempts": 2},
        tracking={"enabled": False},
    )
    directory = tmp_path / "campaign"
    run = subprocess.run(
        [sys.executable, "-m", "pbt.cli", "run", str(manifest), "--dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 2, output
    assert "Traceback" not in output
    for member in ("g000-m00", "g000-m01"):
        # the member's outcome line (progress lines such as "g000-m00 loading" may come first)
        said = [x.strip() for x in output.splitlines() if x.strip().startswith(member)]
        line = next((x for x in said if not x.endswith(("loading", "starting"))), "")
        assert line.startswith(f"{member} config_error (attempt 1 of 2): "), output
        assert "model.name ('broken')" in line and "; worker exit code 2; replacing" in line
        assert not (directory / "logs" / f"{member}.attempt2.log").exists()  # not retried
    final = run.stderr.strip().splitlines()[-1]
    assert final.startswith("error: g000-m00 failed once (config_error: model.name ('broken')")
    assert "fix the manifest" in final
    assert pbt(["status", str(directory)]) == 0
    status = capsys.readouterr().out
    assert "gen 0 g000-m00 attempt 1: config_error: model.name ('broken')" in status
    assert "worker exit code 2" in status
