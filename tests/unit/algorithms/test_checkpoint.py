"""The checkpoint format: complete or absent, plain data only, and an exact resume."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from support import small_manifest
from transformers import AutoModelForCausalLM

from pbt.algorithms.runtime.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from pbt.algorithms.runtime.member import Member
from pbt.algorithms.runtime.models import resolve_model_path
from pbt.cli.main import main
from pbt.config.errors import CheckpointError
from pbt.distributed.state import DeviceCopies, gather_optimizer, load_optimizer

CPU = torch.device("cpu")


def _adapter(member: Member) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in member.model.named_parameters() if p.requires_grad}


def _train(member: Member, steps: int) -> list[float]:
    return [
        member.learner.train_step(member.task.train, member.task.reward)["reward_mean"]
        for _ in range(steps)
    ]


def test_two_steps_save_load_two_more_equals_four_straight(tmp_path):
    manifest = small_manifest(
        tmp_path, algorithm={"beta": 0.1, "update_epochs": 2, "mini_batch_size": 4}
    )
    straight = Member(manifest, CPU)
    rewards_straight = _train(straight, 4)

    first = Member(manifest, CPU)
    rewards_first = _train(first, 2)
    first.save(tmp_path / "ckpt")

    resumed = Member(manifest, CPU)
    resumed.load(tmp_path / "ckpt")
    rewards_resumed = _train(resumed, 2)

    assert rewards_first + rewards_resumed == rewards_straight
    assert resumed.learner.step == straight.learner.step == 4
    a, b = _adapter(straight), _adapter(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert resumed.learner.scheduler.last_epoch == straight.learner.scheduler.last_epoch
    # and the adapter actually moved: the comparison is not between two untouched zeros
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)


def test_files_manifest_and_plain_peft_loading(tmp_path):
    member = Member(small_manifest(tmp_path), CPU)
    _train(member, 1)
    digest = member.save(tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt"
    assert sorted(json.loads((ckpt / "manifest.json").read_text())["files"]) == [
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "attributes.pt",
    ]
    assert verify_checkpoint(ckpt) == digest
    attrs = torch.load(ckpt / "attributes.pt", weights_only=True)
    for key in (
        "format_version",
        "algorithm",
        "base_model",
        "lora_config",
        "hyperparameters",
        "mutation_ranges",
        "trainable",
        "learner",
        "rng",
        "step",
        "fitness",
        "lineage",
    ):
        assert key in attrs, key
    assert not list(tmp_path.glob(".ckpt.tmp-*")), "temporary directory left behind"

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny"))
    peft_model = PeftModel.from_pretrained(base, ckpt / "adapter")
    ids = member.tokenizer("Repeat the letter q many times.", return_tensors="pt")["input_ids"]
    member.model.eval()
    with torch.no_grad():
        assert torch.allclose(peft_model(ids).logits, member.model(ids).logits, atol=1e-6)


def test_corrupted_truncated_and_incomplete_checkpoints_are_refused(tmp_path):
    member = Member(small_manifest(tmp_path), CPU)
    member.save(tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt"
    weights = ckpt / "adapter" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its digest"):
        member.load(ckpt)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")


class _RunsCode:
    def __reduce__(self):
        return (print, ("pwned",))


def test_pickle_payload_is_refused_without_running(tmp_path, capsys):
    member = Member(small_manifest(tmp_path), CPU)
    member.save(tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt"
    torch.save(
        {"payload": _RunsCode()}, ckpt / "attributes.pt", pickle_protocol=pickle.DEFAULT_PROTOCOL
    )
    # re-sign the manifest so only the weights_only check stands in the way
    manifest = json.loads((ckpt / "manifest.json").read_text())
    from pbt.algorithms.runtime.checkpoint import _sha256

    manifest["files"]["attributes.pt"] = _sha256(ckpt / "attributes.pt")
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="plain data"):
        load_checkpoint(ckpt)
    assert "pwned" not in capsys.readouterr().out


def test_checkpoint_of_another_model_is_refused(tmp_path):
    member = Member(small_manifest(tmp_path), CPU)
    member.save(tmp_path / "ckpt")
    other = Member(small_manifest(tmp_path, lora={"r": 4}), CPU)
    with pytest.raises(CheckpointError, match="lora_config"):
        other.load(tmp_path / "ckpt")


def test_newer_format_is_refused(tmp_path):
    member = Member(small_manifest(tmp_path), CPU)
    member.save(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 99
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="upgrade pbt-llm"):
        load_checkpoint(tmp_path / "ckpt")


def test_a_state_held_in_memory_loads_again_unchanged(tmp_path):
    """A long-lived worker loads a parent it holds in memory once per child (on a GPU without a
    copy on the host first): a child's training must not advance the held state's step counts,
    or the next child would take other bias corrections than one loaded from the file."""
    member = Member(small_manifest(tmp_path), CPU)
    _train(member, 2)
    named = member.learner.named_params
    held = gather_optimizer(named, member.learner.optimizer)
    steps = {n: e["step"].clone() for n, e in held["state"].items() if "step" in e}
    assert steps and all(s.item() == 2 for s in steps.values())
    child = Member(small_manifest(tmp_path), CPU)
    load_optimizer(child.learner.named_params, child.learner.optimizer, held)
    _train(child, 2)
    for name, step in steps.items():
        assert torch.equal(held["state"][name]["step"], step), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on one)")
def test_snapshot_on_a_gpu_travels_in_the_background_and_keeps_its_moment(tmp_path):
    """On one GPU the snapshot's copy to the host is still in flight when it returns; the next
    member may train at once, and the checkpoint written afterwards holds the state of the
    moment of the snapshot, byte for byte what a snapshot copied at once writes."""
    cuda = torch.device("cuda")
    member = Member(small_manifest(tmp_path, training={"device": "cuda"}), cuda)
    _train(member, 2)
    background = member.snapshot(tmp_path / "background")
    assert background._copies is not None  # the copies travel on the side stream
    background.keep_on_device = True  # as a worker holding states on the device asks
    at_once = member.save(tmp_path / "at-once")  # the same moment, written before training
    moment = _adapter(member)
    _train(member, 2)  # the parameters move while the first snapshot's bytes travel
    assert any(not torch.equal(moment[n], p) for n, p in _adapter(member).items())
    assert background() == at_once
    restored = Member(small_manifest(tmp_path, training={"device": "cuda"}), cuda)
    restored.load(tmp_path / "background")
    for name, value in _adapter(restored).items():
        assert torch.equal(value, moment[name]), name
    # the same state from host memory (a parent a long-lived worker holds, in pageable
    # memory: the pinned buffers are reused) trains on exactly as the file's copy does
    held = {**background.attributes, "digest": at_once}
    assert not any(
        t.is_pinned() for t in torch.utils._pytree.tree_leaves(held) if torch.is_tensor(t)
    )
    from_memory = Member(small_manifest(tmp_path, training={"device": "cuda"}), cuda)
    from_memory.load(tmp_path / "background", held)  # each load restores the global RNG too
    from_memory_rewards = _train(from_memory, 2)
    restored.load(tmp_path / "background")
    assert from_memory_rewards == _train(restored, 2)
    for name, value in _adapter(from_memory).items():
        assert torch.equal(value, _adapter(restored)[name]), name
    # and from a prefetch's copy on the device (a long-lived worker copies the next task's
    # parent while the current task trains): moments and adapter on the GPU, RNG on the host
    copies = DeviceCopies(held, cuda)
    _train(member, 1)  # the device works meanwhile
    prefetched = copies.wait()
    moved = torch.utils._pytree.tree_leaves([prefetched["trainable"], prefetched["learner"]])
    floating = [t for t in moved if torch.is_tensor(t) and t.dim() and t.is_floating_point()]
    assert floating and {t.device.type for t in floating} == {"cuda"}
    assert prefetched["learner"]["generator"].device.type == "cpu"  # an RNG state, restored there
    from_device = Member(small_manifest(tmp_path, training={"device": "cuda"}), cuda)
    from_device.load(tmp_path / "background", prefetched, owned=True)
    from_device_rewards = _train(from_device, 2)
    restored.load(tmp_path / "background")
    assert from_device_rewards == _train(restored, 2)
    for name, value in _adapter(from_device).items():
        assert torch.equal(value, _adapter(restored)[name]), name
    # and from the copy held on the device (views of the packed buffers the host copy came
    # from), loaded by two children in turn: each trains on as the file's copy does, and the
    # held buffers stay as they were
    on_device = {**background.on_device, "digest": at_once}
    leaves = [t for t in torch.utils._pytree.tree_leaves(on_device) if torch.is_tensor(t)]
    assert {t.device.type for t in on_device["trainable"].values()} == {"cuda"}
    assert len({t.untyped_storage().data_ptr() for t in on_device["trainable"].values()}) == 1
    kept = [t.clone() for t in leaves]
    for _ in range(2):
        child = Member(small_manifest(tmp_path, training={"device": "cuda"}), cuda)
        child.load(tmp_path / "background", on_device)
        child_rewards = _train(child, 2)
        restored.load(tmp_path / "background")
        assert child_rewards == _train(restored, 2)
        for name, value in _adapter(child).items():
            assert torch.equal(value, _adapter(restored)[name]), name
    # and a prefetch of it (a device copy a buffer on a side stream), taken over by a child
    copies = DeviceCopies(on_device, cuda)
    ahead_of_time = copies.wait()
    assert copies.held_on_device
    child = Member(small_manifest(tmp_path, training={"device": "cuda"}), cuda)
    child.load(tmp_path / "background", ahead_of_time, owned=True)
    child_rewards = _train(child, 2)
    restored.load(tmp_path / "background")
    assert child_rewards == _train(restored, 2)
    assert all(torch.equal(a, b) for a, b in zip(kept, leaves, strict=True))


# -- a checkpoint is the files its manifest lists, nothing else --------------------------------


def _plain_checkpoint(path: Path) -> Path:
    """A small real checkpoint, written as members write theirs."""
    attributes = {"trainable": {"base_model.x.lora_A.weight": torch.ones(2, 2)}, "step": 3}
    save_checkpoint(path, attributes, {"peft_type": "LORA"})
    return path


def _link_to_a_file(ckpt: Path, outside: Path) -> str:
    (ckpt / "adapter" / "leak.txt").symlink_to(outside / "secret.txt")
    return "adapter/leak.txt"


def _link_to_a_folder(ckpt: Path, outside: Path) -> str:
    (ckpt / "adapter" / "subdir").symlink_to(outside)
    return "adapter/subdir"


def _weights_through_a_link(ckpt: Path, outside: Path) -> str:
    """The weights moved outside and linked back: every digest still matches."""
    weights = ckpt / "adapter" / "adapter_model.safetensors"
    weights.rename(outside / "weights.safetensors")
    weights.symlink_to(outside / "weights.safetensors")
    return "adapter/adapter_model.safetensors"


def _manifest_leaving_the_folder(ckpt: Path, outside: Path) -> str:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    name = "adapter/../../outside/secret.txt"
    manifest["files"][name] = hashlib.sha256((outside / "secret.txt").read_bytes()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return name


HOSTILE = {
    "a link to a file outside": _link_to_a_file,
    "a link to a folder outside": _link_to_a_folder,
    "its weights through a link": _weights_through_a_link,
    "a manifest naming a path outside": _manifest_leaving_the_folder,
}


@pytest.mark.parametrize("hostile", list(HOSTILE))
def test_links_and_paths_out_of_a_checkpoint_are_refused_by_export_inspect_and_load(
    tmp_path, capsys, hostile
):
    """Each refused in one line naming the path, before a byte is read through it: no export
    folder, nothing of the outside file in any output."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("SECRET outside the campaign\n")
    ckpt = _plain_checkpoint(tmp_path / "campaign" / "checkpoints" / "g000-m00")
    named = HOSTILE[hostile](ckpt, outside)
    for argv in (["export", str(ckpt), str(tmp_path / "out")], ["inspect", str(ckpt)]):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"error: checkpoint {ckpt}") and named in err, err
        assert "SECRET" not in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=re.escape(named)):
        load_checkpoint(ckpt)


def test_export_copies_only_the_files_the_manifest_lists(tmp_path, capsys):
    ckpt = _plain_checkpoint(tmp_path / "ckpt")
    (ckpt / "adapter" / "notes.txt").write_text("not part of the checkpoint")
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    same = (tmp_path / "out" / "adapter_model.safetensors").read_bytes()
    assert same == (ckpt / "adapter" / "adapter_model.safetensors").read_bytes()


def test_a_pipe_in_a_checkpoint_is_refused_without_waiting_on_it(tmp_path):
    ckpt = _plain_checkpoint(tmp_path / "ckpt")
    (ckpt / "attributes.pt").unlink()
    os.mkfifo(ckpt / "attributes.pt")
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"attributes\.pt is not a plain file"):
        load_checkpoint(ckpt)
    assert time.monotonic() - started < 5
