"""Members that run out of disk or memory: the kernel's own limits (``RLIMIT_FSIZE``,
``RLIMIT_DATA``) and an injected ``ENOSPC``. A checkpoint write that fails leaves the previous
checkpoint bit-identical and nothing partial; the fault is recorded by kind; a full disk stops the
campaign, which resumes to the end an uninterrupted one reaches; a member over its memory limit
is retried or replaced and the campaign completes."""

from __future__ import annotations

import errno
import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from support import DRIVERS, write_manifest

from pbt.algorithms.runtime.checkpoint import load_checkpoint, save_checkpoint
from pbt.config.errors import CheckpointError, PbtError
from pbt.controller.campaign import Campaign
from pbt.controller.report import status_text
from pbt.controller.store import CampaignStore
from pbt.protocol import crash, faults

FAKE = [sys.executable, str(DRIVERS / "fake_member.py")]
MANIFEST = {
    "INIT_HP": {"POP_SIZE": 3, "TOURNAMENT_SIZE": 2, "ELITISM": True, "EVO_STEPS": 3, "LR": 1e-4},
    "population": {"init_sampler": "random"},
    "mutation": {"rl_hp": 1.0, "ranges": {"lr": {"min": 1e-5, "max": 1e-1, "log": True}}},
    "budget": {"generations": 3},
    "launch": {
        "slots": 3,
        "max_attempts": 2,
        "heartbeat_timeout_s": 30,
        "persistent_workers": False,
    },
    "training": {"seed": 5},
    "tracking": {"enabled": False},
}


def _attributes(size: int, value: float) -> dict:
    weight = torch.full((size,), value)
    return {"trainable": {"base_model.layer.lora_A.weight": weight}, "step": 1}


def _files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by relative path, with its sha256."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _check_previous_intact(root: Path, before: dict[str, str]) -> None:
    assert sorted(p.name for p in root.iterdir()) == ["ckpt"]  # no temporary folder left
    assert _files(root / "ckpt") == before
    loaded = load_checkpoint(root / "ckpt")
    assert torch.equal(
        loaded["trainable"]["base_model.layer.lora_A.weight"], torch.full((64,), 1.0)
    )


WRITE_UNDER_A_FILE_SIZE_LIMIT = textwrap.dedent(
    """
    import resource, signal, sys, torch
    from pbt.algorithms.runtime.checkpoint import save_checkpoint
    from pbt.config.errors import CheckpointError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    weight = torch.full((1 << 16,), 2.0)  # 256 KiB: past the limit
    try:
        save_checkpoint(sys.argv[1], {"trainable": {"base_model.layer.lora_A.weight": weight}}, {})
    except CheckpointError as err:
        print(err)
        sys.exit(3)
    """
)


def test_a_file_size_limit_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """The kernel refuses the write (RLIMIT_FSIZE, EFBIG) in a process of its own."""
    save_checkpoint(tmp_path / "ckpt", _attributes(64, 1.0), {"r": 8})
    before = _files(tmp_path / "ckpt")
    proc = subprocess.run(
        [sys.executable, "-c", WRITE_UNDER_A_FILE_SIZE_LIMIT, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    message = proc.stdout
    assert f"checkpoint {tmp_path / 'ckpt'} was not written" in message
    assert "a file size limit was reached (EFBIG" in message and "attributes.pt" in message
    assert "Traceback" not in proc.stderr
    _check_previous_intact(tmp_path, before)


@pytest.mark.parametrize(
    "hit", [1, 2, 3, 4], ids=["attributes", "adapter", "adapter-config", "manifest"]
)
def test_a_full_disk_at_any_file_leaves_the_previous_checkpoint(tmp_path, monkeypatch, hit):
    save_checkpoint(tmp_path / "ckpt", _attributes(64, 1.0), {"r": 8})
    before = _files(tmp_path / "ckpt")
    monkeypatch.setenv("PBT_FAULT_AT", f"disk_full:{hit}")
    monkeypatch.setattr(crash, "_fault_hits", {})
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(tmp_path / "ckpt", _attributes(1 << 14, 2.0), {"r": 8})
    message = str(err.value)
    assert "was not written: the disk is full (ENOSPC: No space left on device)" in message
    assert "free space on the disk" in message
    assert isinstance(err.value.__cause__, OSError)
    assert faults.classify(err.value) == "disk_full"
    _check_previous_intact(tmp_path, before)


def test_member_faults_are_classified_by_kind(tmp_path):
    cpu = None
    try:
        torch.empty(1 << 50, dtype=torch.uint8)  # a petabyte: the CPU allocator refuses
    except RuntimeError as err:
        cpu = err
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    disk = CheckpointError("not written")
    disk.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    cases = {
        "out_of_memory": [
            MemoryError(),
            cuda,
            cpu,
            OSError(errno.ENOMEM, "Cannot allocate"),
            ImportError("libgomp.so.1: failed to map segment from shared object"),
        ],
        "disk_full": [OSError(errno.EDQUOT, "Quota"), OSError(errno.EFBIG, "Too large"), disk],
        None: [ValueError("bad"), RuntimeError("diverged"), OSError(errno.EACCES, "denied")],
    }
    for kind, errors in cases.items():
        for err in errors:
            assert faults.classify(err) == kind, err
    assert faults.report(tmp_path, cuda) == "out_of_memory"
    kind, message = faults.read(tmp_path)
    assert kind == "out_of_memory" and "CUDA out of memory" in message
    (tmp_path / faults.FAULT_FILE).unlink()
    assert faults.read(tmp_path, "Traceback ...\n  File x\nMemoryError\n")[0] == "out_of_memory"
    assert faults.read(tmp_path, "Traceback ...\nValueError: MemoryError\n") is None
    mapped = "ImportError: libtorch_cpu.so: failed to map segment from shared object"
    assert faults.read(tmp_path, f"Traceback ...\n{mapped}\n") == ("out_of_memory", mapped)
    # with the disk too full for fault.json, the member's last words still say so
    printed = "error: checkpoint c was not written: the disk is full (ENOSPC: No space left ...)"
    assert faults.read(tmp_path, f"step 3\n{printed}\n") == ("disk_full", printed)


def test_an_error_at_the_data_limit_counts_as_out_of_memory(tmp_path):
    """Under a real ``RLIMIT_DATA`` (what ``launch.memory_limit_gib`` sets), a process that holds
    most of its limit reports any error as ``out_of_memory``, with what it held; the same error
    below the limit, or without one, is of no known kind. The report is written from the
    reserve even when nothing else can be allocated."""
    script = textwrap.dedent(
        f"""
        import resource
        from pbt.protocol import faults
        err = SystemError("error return without exception set")
        assert faults.memory_held() is None and faults.classify(err) is None
        faults.keep_reserve()
        def held():
            status = open("/proc/self/status").read().split("VmData:")[1]
            return int(status.split()[0]) * 1024
        # far below: four times what it holds
        resource.setrlimit(resource.RLIMIT_DATA, (4 * held(), resource.RLIM_INFINITY))
        assert faults.memory_held() is None and faults.classify(err) is None
        # near: 32 MiB of room, then filled until an allocation fails
        resource.setrlimit(resource.RLIMIT_DATA, (held() + (32 << 20), resource.RLIM_INFINITY))
        hog = []
        try:
            while True:
                hog.append(bytearray(1 << 20))
        except MemoryError:
            pass
        assert faults.classify(err) == "out_of_memory"
        assert faults.report({str(tmp_path)!r}, err) == "out_of_memory"
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert faults.read(tmp_path)[0] == "out_of_memory"
    cause = faults.read_cause(tmp_path)
    assert cause.message.startswith("SystemError: error return") and " GiB of its " in cause.message
    assert cause.message.endswith("GiB limit)")


def _decisions(directory: Path) -> list[tuple]:
    with CampaignStore(directory / "store.db") as store:
        return [
            (m.member_id, m.parent_id, m.hyperparameters, m.mutation, m.fitness_history, m.steps)
            for m in store.members()
        ]


def _run(manifest: Path, directory: Path, faults_plan: dict | None = None):
    campaign = Campaign.start(manifest, directory, member_command=FAKE)
    if faults_plan:
        (directory / "faults.json").write_text(json.dumps(faults_plan))
    campaign.say = lambda *_: None
    try:
        return campaign.run()
    finally:
        campaign.close()


@pytest.mark.integration
def test_a_full_disk_stops_the_campaign_and_resume_completes_it(tmp_path, monkeypatch):
    """Real checkpoints (``FAKE_MEMBER_CHECKPOINT=real``); one member of generation 1 finds the
    disk full at each attempt: the campaign stops, generation 0's checkpoints load
    bit-identically, nothing partial is left, and a resume ends where an uninterrupted run does."""
    monkeypatch.setenv("FAKE_MEMBER_CHECKPOINT", "real")
    manifest = write_manifest(tmp_path / "manifest.yaml", MANIFEST)
    _run(manifest, tmp_path / "straight")
    directory = tmp_path / "full"
    with pytest.raises(PbtError) as err:
        _run(manifest, directory, {"g001-m01": ["disk_full", "disk_full"]})
    assert "g001-m01 failed 2 times for want of disk space" in str(err.value)
    assert f"pbt resume {directory}" in str(err.value)
    with CampaignStore(directory / "store.db") as store:
        assert store.last_committed_generation() == 0
        recorded = [(f["member_id"], f["attempt"], f["kind"]) for f in store.faults()]
        details = [f["detail"] for f in store.faults()]
        parents = store.members(0)
    assert recorded == [("g001-m01", 1, "disk_full"), ("g001-m01", 2, "disk_full")]
    assert all("the disk is full (ENOSPC: No space left on device)" in d for d in details)
    for parent in parents:  # the previous checkpoints, bit for bit as recorded
        assert load_checkpoint(directory / parent.checkpoint)["digest"] == parent.checkpoint_digest
    on_disk = sorted(p.name for p in (directory / "checkpoints").iterdir())
    assert "g001-m01" not in on_disk and not [n for n in on_disk if n.startswith(".")]
    assert "disk_full" in status_text(directory)
    resumed = Campaign.resume(directory, member_command=FAKE)
    resumed.say = lambda *_: None
    try:
        summary = resumed.run()
    finally:
        resumed.close()
    assert summary.generations == 3
    assert _decisions(directory) == _decisions(tmp_path / "straight")


def test_a_member_over_its_memory_limit_is_retried_then_replaced(tmp_path, monkeypatch):
    """``launch.memory_limit_gib`` puts each member under RLIMIT_DATA; a member allocating past
    it (it would hold 4 GiB without the limit) is recorded as out of memory, and the campaign
    completes."""
    monkeypatch.setenv("FAKE_MEMBER_ALLOCATE_GIB", "4")
    manifest = write_manifest(
        tmp_path / "manifest.yaml", MANIFEST, launch={"memory_limit_gib": 0.5}
    )
    plan = {"g001-m01": ["oom", "ok"], "g002-m00": ["oom", "oom"]}
    summary = _run(manifest, tmp_path / "c", plan)
    assert summary.generations == 3
    with CampaignStore(tmp_path / "c" / "store.db") as store:
        recorded = [(f["member_id"], f["attempt"], f["kind"]) for f in store.faults()]
        details = {f["kind"]: f["detail"] for f in store.faults()}
        retried, replaced = store.member("g001-m01"), store.member("g002-m00")
    assert recorded == [
        ("g001-m01", 1, "out_of_memory"),
        ("g002-m00", 1, "out_of_memory"),
        ("g002-m00", 2, "out_of_memory"),
        ("g002-m00", 2, "replaced"),
    ]
    assert (
        details["out_of_memory"].startswith("MemoryError")
        and "exit code 2" in details["out_of_memory"]
    )
    assert retried.status == "done" and retried.attempts == 2
    assert replaced.status == "done" and "replaced by a clone of" in replaced.mutation
    text = status_text(tmp_path / "c")
    assert "out_of_memory: MemoryError" in text


def test_what_a_killed_write_left_behind_is_collected(tmp_path):
    """A member killed mid-write leaves its temporary folder (and a replaced checkpoint being
    removed); the controller deletes both before the next generation, and only those."""
    manifest = write_manifest(tmp_path / "manifest.yaml", MANIFEST, budget={"generations": 1})
    campaign = Campaign.start(manifest, tmp_path / "c", member_command=FAKE)
    folder = tmp_path / "c" / "checkpoints"
    for name in (".g000-m00.tmp-0a1b2c3d", ".g000-m01.old-0a1b2c3d"):
        (folder / name).mkdir(parents=True)
        (folder / name / "attributes.pt").write_bytes(b"half a checkpoint")
    (folder / ".keep").write_text("not a checkpoint write's\n")
    campaign.say = lambda *_: None
    try:
        campaign.run()
    finally:
        campaign.close()
    assert sorted(p.name for p in folder.iterdir()) == [".keep", "g000-m00", "g000-m01", "g000-m02"]


def test_the_writes_of_members_started_ahead_are_not_collected(tmp_path):
    """After a commit, members of the next generation may already run (started behind the
    last writes): the temporary folders of their checkpoints are writes in flight, not
    leftovers, and stay; a cut-off write of any other member goes."""
    manifest = write_manifest(tmp_path / "manifest.yaml", MANIFEST, budget={"generations": 1})
    campaign = Campaign.start(manifest, tmp_path / "c", member_command=FAKE)
    folder = tmp_path / "c" / "checkpoints"
    for name in (".g001-m00.tmp-0a1b2c3d", ".g001-m01.tmp-0a1b2c3d", ".g001-m02.old-0a1b2c3d"):
        (folder / name).mkdir(parents=True)

    class Ahead:  # the campaign's hand-ahead, with two members started ahead
        def handed(self) -> set[str]:
            return {"g001-m00", "g001-m02"}

    campaign.hand_ahead = Ahead()
    campaign._collect_garbage()
    campaign.close()
    assert sorted(p.name for p in folder.iterdir()) == [
        ".g001-m00.tmp-0a1b2c3d", ".g001-m02.old-0a1b2c3d",
    ]  # fmt: skip


REAL_MEMBER = {
    "model": {"name": "builtin:tiny"},
    "algorithm": {"group_size": 4, "prompts_per_step": 2},
    "rollout": {"max_output_tokens": 6},
    "task": {"name": "builtin:letters", "eval_size": 8},
    "training": {"seed": 3, "device": "cpu"},
    "population": {"size": 1, "tournament_size": 1, "evo_steps": 1},
    "budget": {"generations": 1},
    "launch": {
        "slots": 1,
        "max_attempts": 2,
        "memory_limit_gib": 0.4,
        "heartbeat_timeout_s": 60,
        "persistent_workers": False,
    },
    "tracking": {"enabled": False},
}


@pytest.mark.integration
def test_a_real_member_over_its_memory_limit_is_recorded_as_out_of_memory(tmp_path, monkeypatch):
    """The real member entry point under torchrun, with less memory than loading torch and
    transformers takes: both attempts fail as out of memory (reported by the member itself, in
    ``fault.json``), and `pbt status` says so."""
    # one OpenMP thread: where a native thread pool can't start its threads under the limit,
    # it may spin instead of failing, and only the heartbeat timeout would end the member
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump(REAL_MEMBER))
    campaign = Campaign.start(manifest, tmp_path / "c")
    campaign.say = lambda *_: None
    try:
        with pytest.raises(PbtError, match="no member of generation 0 finished"):
            campaign.run()
    finally:
        campaign.close()
    with CampaignStore(tmp_path / "c" / "store.db") as store:
        kinds = [(f["member_id"], f["attempt"], f["kind"]) for f in store.faults()]
        detail = store.faults()[0]["detail"]
    assert kinds == [("g000-m00", 1, "out_of_memory"), ("g000-m00", 2, "out_of_memory")]
    # a MemoryError, or another error raised at the limit (an extension's failed allocation
    # can surface as a SystemError), with what the member held
    cause = detail.split("; worker exit code")[0]
    assert cause.startswith("MemoryError") or cause.endswith("GiB limit)"), detail
    assert f"out_of_memory: {cause[:40]}" in status_text(tmp_path / "c")
