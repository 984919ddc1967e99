"""The checkpoint format: a directory that is complete or does not exist.

Layout (the same whatever world size saved it)::

    <checkpoint>/
      attributes.pt                      torch.save'd dict; loads with weights_only=True
      adapter/adapter_model.safetensors  plain PEFT adapter: PeftModel.from_pretrained works
      adapter/adapter_config.json
      manifest.json                      sha256 of every file above; written last

A checkpoint is written into a temporary sibling directory and renamed into place, so readers
see the old checkpoint or the new one, never half of one. Loading checks every digest before
deserialising anything, and deserialises with ``weights_only=True`` so a file cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pbt.errors import CheckpointError

FORMAT_VERSION = 1
ATTRIBUTES = "attributes.pt"
ADAPTER_DIR = "adapter"
MANIFEST = "manifest.json"


def save_checkpoint(
    path: str | Path, attributes: dict[str, Any], adapter_config: dict[str, Any]
) -> str:
    """Write a checkpoint atomically and return its digest (sha256 of the manifest).

    Args:
        path: the checkpoint directory; replaced if it exists.
        attributes: the state dict; ``attributes["trainable"]`` holds the adapter tensors with
            PEFT's saved key names (``get_peft_model_state_dict``), and any other trained
            tensors, which stay out of the PEFT folder (see :func:`is_policy_adapter_key`).
        adapter_config: PEFT's ``adapter_config.json`` content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        _write_files(tmp, {**attributes, "format_version": FORMAT_VERSION}, adapter_config)
        digest = _write_manifest(tmp)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return digest


def _write_files(root: Path, attributes: dict[str, Any], adapter_config: dict[str, Any]) -> None:
    torch.save(attributes, root / ATTRIBUTES)
    adapter = root / ADAPTER_DIR
    adapter.mkdir()
    tensors = {
        k: v.detach().to("cpu").contiguous()
        for k, v in attributes["trainable"].items()
        if is_policy_adapter_key(k)
    }
    save_file(tensors, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    (adapter / "adapter_config.json").write_text(
        json.dumps(adapter_config, indent=2, sort_keys=True)
    )


POLICY_ADAPTER = "default"
"""PEFT's name of the policy adapter, the one the PEFT folder holds."""


def peft_key(name: str, adapter: str = POLICY_ADAPTER) -> str:
    """PEFT's saved name for a parameter: the adapter name dropped, as in its safetensors."""
    return name.replace(f".{adapter}.", ".")


def adapter_config(model, base_model: str | None = None) -> dict[str, Any]:
    """The policy adapter's ``adapter_config.json`` content (target modules sorted, so the
    file is the same from run to run), with ``base_model_name_or_path`` set when given."""
    config = model.peft_config[POLICY_ADAPTER].to_dict()
    if base_model is not None:
        config["base_model_name_or_path"] = base_model
    targets = config["target_modules"]
    config["target_modules"] = sorted(targets) if isinstance(targets, (set, list)) else targets
    return config


# A tensor of another named adapter keeps its adapter name (``...lora_A.value.weight``) where
# the policy adapter's PEFT key has none (``...lora_A.weight``).
_NAMED_ADAPTER = re.compile(r"\.lora_\w+\.[^.]+\.\w+$")


def is_policy_adapter_key(key: str) -> bool:
    """Whether ``key`` of ``attributes["trainable"]`` belongs in the PEFT folder: the policy
    (``default``) adapter's tensors do; extra trained modules (PPO's ``value`` adapter and value
    head) live in ``attributes.pt`` only, so the folder stays a plain policy adapter."""
    return key.startswith("base_model.") and not _NAMED_ADAPTER.search(key)


def _write_manifest(root: Path) -> str:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    for file in files:
        _fsync(file)
    manifest = {
        "format_version": FORMAT_VERSION,
        "files": {p.relative_to(root).as_posix(): _sha256(p) for p in files},
    }
    text = json.dumps(manifest, indent=2, sort_keys=True)
    (root / MANIFEST).write_text(text)
    _fsync(root / MANIFEST)
    return hashlib.sha256(text.encode()).hexdigest()


def _replace_dir(tmp: Path, path: Path) -> None:
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        path.rename(old)
    tmp.rename(path)
    _fsync(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(path: str | Path) -> str:
    """Check the manifest and every file's digest; return the checkpoint's digest.

    Raises:
        CheckpointError: saying what is missing, unreadable, altered or too new.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    try:
        text = (path / MANIFEST).read_text()
        manifest = json.loads(text)
        files = manifest["files"]
        version = int(manifest["format_version"])
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete") from None
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({err})") from None
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version}; this pbt-llm reads up to "
            f"{FORMAT_VERSION}: upgrade pbt-llm"
        )
    for required in (ATTRIBUTES, f"{ADAPTER_DIR}/adapter_model.safetensors"):
        if required not in files:
            raise CheckpointError(f"checkpoint {path}: manifest does not list {required}")
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        if _sha256(file) != expected:
            raise CheckpointError(
                f"checkpoint {path}: {name} does not match its digest (altered or truncated)"
            )
    return hashlib.sha256(text.encode()).hexdigest()


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Verify, then load ``attributes.pt`` with ``weights_only=True``.

    Raises:
        CheckpointError: the checkpoint fails verification or holds anything but plain data.
    """
    path = Path(path)
    digest = verify_checkpoint(path)
    try:
        attributes = torch.load(path / ATTRIBUTES, map_location=map_location, weights_only=True)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint {path}: {ATTRIBUTES} holds more than plain data and was refused ({err})"
        ) from None
    attributes["digest"] = digest
    return attributes


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with file.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file or a directory entry to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
