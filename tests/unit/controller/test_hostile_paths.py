"""Paths that try to lead a campaign outside its folder: through a manifest, rows of the store,
a member's result, the tracking journal, or symlinks. Nothing outside is written, loaded or
deleted; read-only inputs (reward files) may live anywhere but load only from where the manifest
says."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from support import DRIVERS, start_campaign, write_manifest

from pbt.config import RewardRef
from pbt.config.errors import ConfigError, PbtError
from pbt.controller.campaign import Campaign
from pbt.controller.report import status_text
from pbt.controller.store import CampaignStore
from pbt.protocol.paths import inside, plain_name

FAKE = [sys.executable, str(DRIVERS / "fake_member.py")]
MANIFEST = {
    "INIT_HP": {"POP_SIZE": 3, "TOURNAMENT_SIZE": 2, "ELITISM": True, "EVO_STEPS": 2, "LR": 1e-4},
    "population": {"init_sampler": "random"},
    "mutation": {"rl_hp": 1.0, "ranges": {"lr": {"min": 1e-5, "max": 1e-1, "log": True}}},
    "budget": {"generations": 3},
    "launch": {
        "slots": 3,
        "max_attempts": 2,
        "heartbeat_timeout_s": 10,
        "persistent_workers": False,
    },
    "training": {"seed": 9},
    "tracking": {"enabled": False},
}


def _tree(root: Path, skip: Path | None = None) -> dict[str, str]:
    """Every file and link under ``root`` (but ``skip``), with its content's sha256."""
    out = {}
    for p in sorted(root.rglob("*")):
        if skip is not None and p.is_relative_to(skip):
            continue
        if p.is_symlink():
            out[str(p.relative_to(root))] = f"-> {p.readlink()}"
        elif p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A folder outside every campaign, with a file that must survive."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "precious.txt").write_text("not the campaign's\n")
    return folder


def _run(campaign: Campaign, said: list[str] | None = None):
    campaign.say = (lambda line: said.append(line)) if said is not None else (lambda *_: None)
    try:
        return campaign.run()
    finally:
        campaign.close()


def test_names_and_paths_are_checked(tmp_path, victim):
    assert plain_name("g001-m02", "member id") == "g001-m02"
    for bad in ("..", "../x", "a/b", "/abs", "", ".hidden", "a..b"):
        with pytest.raises(PbtError, match="is not a plain name"):
            plain_name(bad, "member id")
    campaign = tmp_path / "c"
    (campaign / "checkpoints").mkdir(parents=True)
    assert inside(campaign, "checkpoints/g000-m00", "checkpoints", "x").name == "g000-m00"
    (campaign / "checkpoints" / "link").symlink_to(victim)
    for bad in ("../outside", str(victim), "checkpoints/../../outside", "checkpoints/link",
                "checkpoints", "store.db"):  # fmt: skip
        with pytest.raises(PbtError, match="is not inside") as err:
            inside(campaign, bad, "checkpoints", "checkpoint")
        assert repr(bad) in str(err.value) and "restore it from a backup" in str(err.value)
    # the checkpoints folder itself a symlink: everything through it is outside
    (campaign / "checkpoints").rename(tmp_path / "moved")
    (campaign / "checkpoints").symlink_to(victim)
    with pytest.raises(PbtError, match="is not inside"):
        inside(campaign, "checkpoints/precious.txt", "checkpoints", "checkpoint")


def test_a_manifest_pointing_outside_makes_the_campaign_write_nothing_there(tmp_path, victim):
    """Read-only inputs may live outside the manifest's folder (a shared reward file); output
    settings that a campaign does not use (``training.output_dir``) lead nowhere: every file the
    campaign writes is inside its folder."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "rewards.py").write_text("def score(completion, answer, question):\n    return 1\n")
    folder = tmp_path / "manifests"
    folder.mkdir()
    manifest = write_manifest(
        folder / "manifest.yaml",
        MANIFEST,
        task={"reward": {"file": "../shared/rewards.py", "function": "score"}},
        training={"output_dir": str(victim / "runs")},
    )
    before = _tree(tmp_path)
    summary = _run(Campaign.start(manifest, tmp_path / "c", member_command=FAKE))
    assert summary.generations == 3
    assert _tree(tmp_path, skip=tmp_path / "c") == before


def test_store_rows_that_lead_outside_are_never_deleted(tmp_path, victim):
    """Unreferenced checkpoint rows that climb out, are absolute, or name a symlink to an
    outside folder: garbage collection forgets them and deletes nothing there."""
    manifest = write_manifest(tmp_path / "manifest.yaml", MANIFEST)
    campaign = Campaign.start(manifest, tmp_path / "c", member_command=FAKE)
    (tmp_path / "c" / "checkpoints").mkdir()
    (tmp_path / "c" / "checkpoints" / "evil-link").symlink_to(victim)
    hostile = ["../outside", str(victim), "checkpoints/../../outside", "checkpoints/evil-link"]
    with sqlite3.connect(tmp_path / "c" / "store.db") as db:
        db.executemany(
            "INSERT INTO checkpoints (path, digest, registered_at, referenced) VALUES (?, '', '', 0)",
            [(path,) for path in hostile],
        )
    before = _tree(victim)
    said: list[str] = []
    summary = _run(campaign, said)
    assert summary.generations == 3
    assert _tree(victim) == before
    assert (tmp_path / "c" / "checkpoints" / "evil-link").is_symlink()  # left alone too
    refused = [line for line in said if "not deleting it" in line]
    assert len(refused) == 4 and all("is not inside" in line for line in refused)
    with CampaignStore(tmp_path / "c" / "store.db") as store:
        assert store.unreferenced_checkpoints() == []


def test_a_parent_checkpoint_outside_is_never_loaded(tmp_path, victim):
    """A store row that makes a member's parent checkpoint an outside folder: the resumed
    controller refuses to start the member, says why, and no task names that folder."""
    manifest = write_manifest(tmp_path / "manifest.yaml", MANIFEST)
    directory = tmp_path / "c"
    env = {"PBT_CRASH_AT": "launch:2"}  # generation 0 committed, generation 1 not started
    proc = start_campaign(manifest, directory, FAKE, 0.05, env, stdout=subprocess.DEVNULL)
    assert proc.wait(timeout=120) < 0
    with sqlite3.connect(directory / "store.db") as db:
        db.execute(
            "UPDATE members SET parent_checkpoint = '../outside' WHERE member_id = 'g001-m01'"
        )
    resumed = Campaign.resume(directory, member_command=FAKE)
    with pytest.raises(PbtError) as err:
        _run(resumed)
    message = str(err.value)
    assert "the parent checkpoint of g001-m01 ('../outside')" in message
    assert f"resolves to {victim}, which is not inside" in message
    tasks = [p.read_text() for p in (directory / "tasks").glob("*/task.json")]
    assert tasks and not any("outside" in text for text in tasks)


def test_a_result_naming_another_checkpoint_is_a_bad_result(tmp_path):
    """A member's result names a checkpoint outside the campaign: the attempt counts as a bad
    result and is retried, and the path never reaches the store."""
    manifest = write_manifest(tmp_path / "manifest.yaml", MANIFEST)
    campaign = Campaign.start(manifest, tmp_path / "c", member_command=FAKE)
    (tmp_path / "c" / "faults.json").write_text(json.dumps({"g001-m01": ["foreign_result"]}))
    summary = _run(campaign)
    assert summary.generations == 3
    with CampaignStore(tmp_path / "c" / "store.db") as store:
        faults = store.faults()
        paths = [m.checkpoint for m in store.members()] + [
            m.parent_checkpoint for m in store.members()
        ]
    assert [(f["member_id"], f["kind"]) for f in faults] == [("g001-m01", "bad_result")]
    assert "names checkpoint 'checkpoints/../../outside'" in faults[0]["detail"]
    assert not any(p and "outside" in p for p in paths)


def test_a_tracking_journal_naming_outside_files_deletes_and_uploads_nothing(tmp_path, victim):
    """An altered journal whose artifact event names a copy outside the journal's folder:
    replayed to a real (embedded) MLflow store, nothing is uploaded or deleted."""
    from mlflow import MlflowClient

    from pbt.tracking.tracker import Tracker, default_uri

    uri, journal = default_uri(tmp_path), tmp_path / "journal"
    with Tracker(uri, "hostile", journal) as tracker:
        tracker.start_run("m0", name="m0")
        assert tracker.flush(timeout=60)
        run_id = tracker.run_id("m0")
    with open(journal / "journal.jsonl", "ab") as f:
        for copy, name in (("../../outside", "precious.txt"), ("0" * 32, "../../../outside")):
            event = {"op": "artifact", "key": "m0", "copy": copy, "name": name}
            f.write(json.dumps(event | {"artifact_path": None}).encode() + b"\n")
    before = _tree(victim)
    with Tracker(uri, "hostile", journal) as tracker:
        tracker.log_metrics("m0", {"x": 1.0}, 1)
        assert tracker.flush(timeout=60)
    assert _tree(victim) == before
    assert MlflowClient(tracking_uri=uri).list_artifacts(run_id) == []


def test_reward_files_load_only_from_where_the_manifest_says(tmp_path, monkeypatch):
    """Decoys named like the reward file, in the working directory and on ``sys.path``, are
    never imported; a missing file is an error, not a search."""
    from pbt.algorithms.data.rewards import load_reward_fn

    decoy = tmp_path / "decoy"
    decoy.mkdir()
    marker = tmp_path / "decoy-ran"
    (decoy / "rewards.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef score(completion, answer, question):\n"
        "    return -1.0\n"
    )
    monkeypatch.chdir(decoy)
    monkeypatch.syspath_prepend(str(decoy))
    folder = tmp_path / "manifest"
    folder.mkdir()
    ref = RewardRef(file="rewards.py", function="score")
    with pytest.raises(ConfigError, match=r"task.reward.file \('rewards.py'\) not found at"):
        load_reward_fn(ref, folder)
    (folder / "rewards.py").write_text("def score(completion, answer, question):\n    return 1.0\n")
    fn = load_reward_fn(ref, folder)
    assert fn("x", "y", "z") == 1.0
    assert not marker.exists()
    # nothing left to import later: no module of that name, none loaded from the decoy folder
    assert "rewards" not in sys.modules
    assert not [
        name
        for name, module in list(sys.modules.items())
        if str(getattr(module, "__file__", None) or "").startswith(str(decoy))
    ]


# -- a broken parent checkpoint ------------------------------------------------------------------


@pytest.fixture(scope="module")
def drawn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A campaign of real checkpoints killed right after generation 0's commit, generation 1
    drawn and not started, 3 attempts a member (copy it before changing it)."""
    root = tmp_path_factory.mktemp("drawn")
    manifest = write_manifest(
        root / "manifest.yaml", MANIFEST, budget={"generations": 2}, launch={"max_attempts": 3}
    )
    env = {"PBT_CRASH_AT": "commit:1", "FAKE_MEMBER_CHECKPOINT": "real"}
    proc = start_campaign(manifest, root / "c", FAKE, 0.05, env, stdout=subprocess.DEVNULL)
    assert proc.wait(timeout=180) < 0
    return root / "c"


def _flip_a_byte(ckpt: Path, victim: Path) -> None:
    data = bytearray((ckpt / "attributes.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ckpt / "attributes.pt").write_bytes(bytes(data))


def _truncate(ckpt: Path, victim: Path) -> None:
    data = (ckpt / "attributes.pt").read_bytes()
    (ckpt / "attributes.pt").write_bytes(data[: len(data) // 2])


def _drop_the_manifest(ckpt: Path, victim: Path) -> None:
    (ckpt / "manifest.json").unlink()


def _plant_links(ckpt: Path, victim: Path) -> None:
    (ckpt / "adapter" / "leak.txt").symlink_to(victim / "precious.txt")
    (ckpt / "adapter" / "subdir").symlink_to(victim)


BREAKS = {
    "a byte flipped": _flip_a_byte,
    "truncated": _truncate,
    "no manifest": _drop_the_manifest,
    "symbolic links out": _plant_links,
}


@pytest.mark.integration
@pytest.mark.parametrize("damage", list(BREAKS))
def test_a_broken_parent_checkpoint_is_replaced_without_retries(
    tmp_path, victim, drawn, damage, monkeypatch
):
    """The resumed campaign's members whose parent checkpoint is broken fail once
    (``bad_checkpoint``, naming it) and are replaced at once: the same checkpoint would fail
    every retry the same way. The others train; ``pbt status`` names the broken checkpoint."""
    directory = Path(shutil.copytree(drawn, tmp_path / "c", symlinks=True))
    with CampaignStore(directory / "store.db") as store:
        children = store.members(1)
    parents = [m.parent_checkpoint for m in children]
    broken = min(parents, key=parents.count)  # one that some children load, not all
    hit = {m.member_id for m in children if m.parent_checkpoint == broken}
    assert 0 < len(hit) < len(children), parents
    before = _tree(victim)
    BREAKS[damage](directory / broken, victim)
    monkeypatch.setenv("FAKE_MEMBER_CHECKPOINT", "real")
    said: list[str] = []
    _run(Campaign.resume(directory, member_command=FAKE), said)
    with CampaignStore(directory / "store.db") as store:
        faults = [(f["member_id"], f["attempt"], f["kind"]) for f in store.faults()]
        details = [f["detail"] for f in store.faults() if f["kind"] == "bad_checkpoint"]
        assert all(m.status == "done" for m in store.members(1))
    assert sorted(faults) == sorted(
        (member, 1, kind) for member in hit for kind in ("bad_checkpoint", "replaced")
    )
    assert all(f"checkpoint {directory.resolve() / broken}" in d for d in details), details
    assert not [p for p in (directory / "logs").glob("g001-*.attempt2.log")]  # no retry
    assert _tree(victim) == before
    status = status_text(directory)
    broken_lines = status.split("broken checkpoints", 1)[1].splitlines()
    assert broken_lines[1].startswith(f"  {broken}  (parent of "), status
    assert all(member in broken_lines[1] for member in hit)


def test_an_artifact_folder_with_links_out_uploads_none_of_their_targets(tmp_path, victim):
    """The best member's adapter logged as an artifact, with links to a file and a folder
    outside planted in it (or the folder itself a link): only its plain files are uploaded."""
    from mlflow import MlflowClient

    from pbt.tracking.tracker import Tracker, default_uri

    adapter = tmp_path / "c" / "checkpoints" / "g000-m00" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "leak.txt").symlink_to(victim / "precious.txt")
    (adapter / "subdir").symlink_to(victim)
    (tmp_path / "linked").symlink_to(victim)
    uri, journal = default_uri(tmp_path), tmp_path / "journal"
    with Tracker(uri, "hostile", journal) as tracker:
        tracker.start_run("m0", name="m0")
        tracker.log_artifact("m0", adapter, "best_adapter")
        tracker.log_artifact("m0", tmp_path / "linked", "linked")
        assert tracker.flush(timeout=60)
        run_id = tracker.run_id("m0")
    client = MlflowClient(tracking_uri=uri)
    listed = [a.path for a in client.list_artifacts(run_id, "best_adapter/adapter")]
    assert listed == ["best_adapter/adapter/adapter_config.json"]
    assert client.list_artifacts(run_id, "linked") == []
    copies = [p for p in journal.rglob("*") if "precious" in p.name or p.is_symlink()]
    assert copies == []
