"""The checkpoint format: a directory that is complete or does not exist.

Layout (the same whatever world size saved it)::

    <checkpoint>/
      attributes.pt                      torch.save'd dict; loads with weights_only=True
      adapter/adapter_model.safetensors  plain PEFT adapter: PeftModel.from_pretrained works
      adapter/adapter_config.json
      manifest.json                      sha256 of every file above; written last

A checkpoint is written into a temporary sibling directory, every file and folder fsynced, and
renamed into place, so readers see the old checkpoint or the new one, never half of one. A write
that fails (a full disk: ``ENOSPC``; a file-size limit: ``EFBIG``) removes its temporary
directory, leaves the previous checkpoint as it was, and raises a :class:`CheckpointError` that
names the errno and the path. Loading checks every digest before deserialising anything, and
deserialises with ``weights_only=True`` so a file cannot run code.

A checkpoint is the files its manifest lists, nothing else: verifying, loading, inspecting and
exporting read only those, and refuse, in one line naming the path, a checkpoint that holds a
symbolic link or anything but plain files and folders (a link would lead a reader out of the
folder, a pipe would hang it) or whose manifest names a path that leaves the folder.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import stat
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
from safetensors.torch import save_file

from pbt.config.errors import CheckpointError
from pbt.protocol.crash import delay_point, fault_point
from pbt.protocol.faults import DISK_FULL_ERRNOS

FORMAT_VERSION = 1
ATTRIBUTES = "attributes.pt"
ADAPTER_DIR = "adapter"
MANIFEST = "manifest.json"


def save_weights(model: torch.nn.Module, folder: Path, dtype: torch.dtype | None = None) -> None:
    """A whole model's weights as ``folder/model.safetensors``, each shared tensor once (a tied
    output head is the input embedding), cast to ``dtype`` when given.

    Written directly rather than through ``save_pretrained``, which writes nothing on a rank
    other than 0 once a process group exists: any rank of a member may be the one that builds
    a model folder."""
    tensors, seen = {}, set()
    for key, value in model.state_dict().items():
        if value.data_ptr() in seen:
            continue
        seen.add(value.data_ptr())
        tensors[key] = (value if dtype is None else value.to(dtype)).contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


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
    delay_point("checkpoint_write")
    tmp = path.parent / f".{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        attributes = _canonical({**attributes, "format_version": FORMAT_VERSION})
        digest = _write_manifest(tmp, _write_files(tmp, attributes, adapter_config))
        _replace_dir(tmp, path)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = _os_error(err)
        if cause is not None:
            raise CheckpointError(_write_failure(path, cause)) from cause
        raise
    return digest


def _canonical(obj: Any) -> Any:
    """``obj`` with every string interned, in rebuilt containers: pickle shares equal strings
    only when they are one object, so without this the same state saves to different bytes
    (and digests) depending on whether its keys came from code or from an unpickled file."""
    if isinstance(obj, str):
        return sys.intern(obj)
    if isinstance(obj, dict):
        return {_canonical(k): _canonical(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_canonical(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_canonical(v) for v in obj)
    return obj


TMP_MARK = ".tmp-"
"""In the name of a checkpoint being written (``.<name>.tmp-<random>``): never a checkpoint."""
OLD_MARK = ".old-"
"""In the name of a replaced checkpoint being removed (``.<name>.old-<random>``)."""


class _HashingFile:
    """A binary file that hashes what is written through it, so no write is read back."""

    def __init__(self, f) -> None:
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _write_files(
    root: Path, attributes: dict[str, Any], adapter_config: dict[str, Any]
) -> dict[str, str]:
    """Write the checkpoint's files; return their sha256 digests by relative name."""
    target = root / ATTRIBUTES
    with _writing(target), target.open("wb") as f:
        hashing = _HashingFile(f)
        torch.save(attributes, hashing)
    digests = {ATTRIBUTES: hashing.sha.hexdigest()}
    adapter = root / ADAPTER_DIR
    adapter.mkdir()
    tensors = {
        k: v.detach().to("cpu").contiguous()
        for k, v in attributes["trainable"].items()
        if is_policy_adapter_key(k)
    }
    config = json.dumps(adapter_config, indent=2, sort_keys=True)
    for name, data in (
        ("adapter_model.safetensors", safetensors_bytes(tensors, metadata={"format": "pt"})),
        ("adapter_config.json", config.encode()),
    ):
        _write_bytes(adapter / name, data)
        digests[f"{ADAPTER_DIR}/{name}"] = hashlib.sha256(data).hexdigest()
    return digests


def _write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file; a short write (a full disk) raises, never truncates."""
    with _writing(path), path.open("wb") as f:
        f.write(data)


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Name ``path`` in the OSError a write to it raises, however deep the writer hid it."""
    fault_point("disk_full", path)
    try:
        yield
    except BaseException as err:
        cause = _os_error(err)
        if cause is None or cause.filename:
            raise
        raise OSError(cause.errno, cause.strerror, str(path)) from err


def _os_error(err: BaseException) -> OSError | None:
    """The OSError behind ``err``: itself, or one it was raised from or while handling
    (``torch.save`` reports a failed write as a RuntimeError raised while handling it)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _write_failure(path: Path, err: OSError) -> str:
    """What went wrong writing checkpoint ``path``, and what to do about it."""
    code = errno.errorcode.get(err.errno or 0, "an OS error")
    where = f" writing {err.filename}" if err.filename else ""
    if err.errno in DISK_FULL_ERRNOS:
        why = "the disk is full" if err.errno != errno.EFBIG else "a file size limit was reached"
        return (
            f"checkpoint {path} was not written: {why} ({code}: {err.strerror}){where}; the "
            f"previous checkpoint there, if any, is unchanged and nothing partial was left; free "
            f"space on the disk that holds {path.parent} (or raise the limit) and resume"
        )
    return (
        f"checkpoint {path} was not written ({code}: {err.strerror}){where}; the previous "
        "checkpoint there, if any, is unchanged and nothing partial was left"
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


def _write_manifest(root: Path, digests: dict[str, str]) -> str:
    """Fsync every file, then write the manifest of their ``digests`` (any file written but
    not in ``digests`` is hashed from disk) and fsync it and the folders."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    for file in files:
        _fsync(file)
    names = {p.relative_to(root).as_posix(): p for p in files}
    manifest = {
        "format_version": FORMAT_VERSION,
        "files": {name: digests.get(name) or _sha256(p) for name, p in names.items()},
    }
    text = json.dumps(manifest, indent=2, sort_keys=True)
    _write_bytes(root / MANIFEST, text.encode())
    _fsync(root / MANIFEST)
    for folder in (root / ADAPTER_DIR, root):
        _fsync(folder)
    return hashlib.sha256(text.encode()).hexdigest()


def _replace_dir(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path``; a checkpoint already there is swapped out first and put back
    if the rename fails, so ``path`` never ends up empty."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}{OLD_MARK}{uuid.uuid4().hex[:8]}"
        path.rename(old)
    try:
        tmp.rename(path)
    except BaseException:
        if old is not None:
            old.rename(path)
        raise
    _fsync(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(path: str | Path, contents: dict[str, bytes] | None = None) -> str:
    """Check the folder, the manifest and every listed file's digest; return the checkpoint's
    digest.

    ``contents`` holds files already read (by relative name), hashed instead of read again.

    Raises:
        CheckpointError: saying what is missing, unreadable, altered, too new, a link, or a
            path that leaves the folder.
    """
    path = Path(path)
    text, files = _manifest(path)
    for name, expected in files.items():
        data = (contents or {}).get(name)
        actual = hashlib.sha256(_read_plain(path, name) if data is None else data).hexdigest()
        if actual != expected:
            raise CheckpointError(
                f"checkpoint {path}: {name} does not match its digest (altered or truncated)"
            )
    return hashlib.sha256(text.encode()).hexdigest()


def checkpoint_files(path: str | Path) -> list[str]:
    """The files of a verified checkpoint (relative names, sorted): those its manifest lists.

    Raises:
        CheckpointError: as :func:`verify_checkpoint`.
    """
    verify_checkpoint(path)
    return sorted(_manifest(Path(path))[1])


def read_checkpoint_file(path: str | Path, name: str) -> bytes:
    """The bytes of file ``name`` (as the manifest lists it) of checkpoint ``path``, read without
    following a link.

    Raises:
        CheckpointError: it is missing, a link, not a plain file, or outside the folder.
    """
    _check_name(Path(path), name)
    return _read_plain(Path(path), name)


def _manifest(path: Path) -> tuple[str, dict[str, str]]:
    """The manifest's text and its files (name -> sha256), once the folder holds nothing but
    plain files and folders and every name listed stays inside it.

    Raises:
        CheckpointError: what is wrong, naming the path.
    """
    _check_tree(path)
    if not (path / MANIFEST).exists():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete")
    try:
        text = _read_plain(path, MANIFEST).decode()
        manifest = json.loads(text)
        files = manifest["files"]
        version = int(manifest["format_version"])
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise TypeError("files must map names to digests")
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
    for name in files:
        _check_name(path, name)
    return text, files


def _check_tree(path: Path) -> None:
    """Refuse a checkpoint folder that does not exist or holds anything but plain files and
    folders (a symbolic link, to a file or a folder, inside or outside; a pipe; a device).
    The folder itself may be reached through a link: its caller named it."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    for folder, dirs, names in os.walk(path, onerror=_raise):  # never follows a link
        for name in [*dirs, *names]:
            entry = Path(folder) / name
            mode = entry.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise CheckpointError(
                    f"checkpoint {path}: {entry.relative_to(path)} is a symbolic link (to "
                    f"{os.readlink(entry)}); a checkpoint holds plain files only, so it was "
                    "refused and nothing was read through it"
                )
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise CheckpointError(
                    f"checkpoint {path}: {entry.relative_to(path)} is not a plain file or "
                    "folder; a checkpoint holds plain files only, so it was refused"
                )


def _raise(err: OSError) -> None:
    raise CheckpointError(f"checkpoint folder {err.filename} cannot be read ({err.strerror})")


def _check_name(path: Path, name: object) -> None:
    """Refuse a name in the manifest that is not a plain relative path inside the folder."""
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} lists {name!r}, which is not a path inside the "
            "checkpoint folder; it was refused and nothing was read"
        )


def _read_plain(path: Path, name: str) -> bytes:
    """Read ``path / name``: a plain file, never through a link (``O_NOFOLLOW`` on the file,
    and no folder on the way may be a link)."""
    file = path / name
    try:
        for parent in list(Path(name).parents)[:-1]:  # the folders between, innermost first
            if (path / parent).is_symlink():
                raise CheckpointError(f"checkpoint {path}: {parent} is a symbolic link; refused")
        fd = os.open(
            file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        )
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: {name} is missing") from None
    except OSError as err:
        raise CheckpointError(
            f"checkpoint {path}: {name} cannot be read as a plain file ({err.strerror}); refused"
        ) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CheckpointError(f"checkpoint {path}: {name} is not a plain file; refused")
        return f.read()


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Verify, then load ``attributes.pt`` with ``weights_only=True``.

    Raises:
        CheckpointError: the checkpoint fails verification or holds anything but plain data.
    """
    path = Path(path)
    _check_tree(path)  # before a byte is read: nothing through a link, nothing that blocks
    try:  # read once: the digest is checked on these bytes, and they are what is loaded
        data = _read_plain(path, ATTRIBUTES)
    except CheckpointError:
        data = None  # verify_checkpoint says what is wrong
    digest = verify_checkpoint(path, None if data is None else {ATTRIBUTES: data})
    try:
        attributes = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
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
