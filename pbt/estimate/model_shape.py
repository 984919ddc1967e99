"""The shape of a decoder as its ``config.json`` states it, read without loading the model: what
:mod:`pbt.estimate.memory` needs to predict a member's memory."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pbt.config import Manifest
from pbt.config.errors import ConfigError
from pbt.config.gguf import NotGGUFError, read_gguf_info
from pbt.config.sections.model import BUILTIN_MODEL_ARCHITECTURE, locate_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""A block's linear layers, as LoRA's ``target_modules`` name them."""
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """What the estimate needs of a decoder's ``config.json``."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool = False
    """Qwen3's RMSNorm on each head's queries and keys."""
    softcapped: bool = False
    """The logits are post-processed (soft-capped or scaled): the lean log-prob path is off."""

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def projections(self) -> dict[str, tuple[int, int]]:
        """Each linear layer of a block: ``(in_features, out_features)``."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_width, self.kv_width
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def block_params(self) -> int:
        """Parameters of one block: its projections, their biases (q, k, v) and two norms."""
        matrices = sum(a * b for a, b in self.projections().values())
        return matrices + self.q_width + 2 * self.kv_width + 2 * self.hidden

    def params(self) -> int:
        """Parameters of the whole model."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * self.block_params() + self.hidden


def shape_from_config(config: Mapping[str, object], source: str) -> ModelShape:
    """The shape a ``config.json`` describes.

    Raises:
        ConfigError: a field is missing or not a positive integer, or the model is a
            mixture of experts.
    """
    config = dict(config.get("text_config") or config)  # multimodal configs nest the decoder
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads")
    keys += ("vocab_size",)
    fix = "give the config.json of a decoder-only transformer (Llama, Qwen2/3, Mistral)"
    problems = [
        f"{source}: {key} ({config.get(key)!r}) must be a positive integer; {fix}"
        for key in keys
        if not _positive_int(config.get(key))
    ]
    if any(config.get(key) for key in _MOE_KEYS):
        problems.append(
            f"{source} describes a mixture-of-experts model, which the estimate does not model; "
            f"{fix}"
        )
    if problems:
        raise ConfigError(problems)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = config.get("head_dim") or hidden // heads
    model_type = str(config.get("model_type", ""))
    return ModelShape(
        hidden=hidden,
        layers=int(config["num_hidden_layers"]),
        intermediate=int(config["intermediate_size"]),
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        vocab=int(config["vocab_size"]),
        tied=bool(config.get("tie_word_embeddings", False)),
        qk_norm=model_type.startswith("qwen3"),
        softcapped=bool(config.get("final_logit_softcapping") or config.get("logit_scale")),
    )


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def read_model_shape(manifest: Manifest, config_path: str | Path | None = None) -> ModelShape:
    """The shape of ``model.name`` (or of the ``config.json`` at ``config_path``), read without
    loading the model: the built-in model's known architecture, a folder's ``config.json``, a
    GGUF file's header, or a hub model's from the local Hugging Face cache (nothing is
    downloaded).

    Raises:
        ConfigError: the config cannot be found or read, or does not describe a decoder.
    """
    if config_path is not None:
        return shape_from_config(_read_json(Path(config_path)), str(config_path))
    name = manifest.model.name
    where = locate_model(name, manifest.base_dir)
    if where.kind == "builtin":
        return shape_from_config(BUILTIN_MODEL_ARCHITECTURE, name)
    if where.kind == "folder":
        return shape_from_config(_read_json(where.path / "config.json"), name)
    if where.kind == "gguf":
        return shape_from_config(_gguf_config(where.path), name)
    if where.kind == "invalid":
        raise ConfigError([where.problem])
    cached = _hub_cache_config(name)
    if cached is None:
        raise ConfigError(
            [
                f"model.name ({name!r}) is a hub id whose config.json is not in the local "
                f"Hugging Face cache ({_hub_cache()}), and nothing is downloaded here; pass "
                f"--model-config with the model's config.json, fetch it once (hf download {name} "
                "config.json), or point model.name at a local folder"
            ]
        )
    return shape_from_config(_read_json(cached), name)


def _gguf_config(path: Path) -> dict[str, object]:
    try:
        return read_gguf_info(path).config_fields()
    except (OSError, NotGGUFError) as err:
        raise ConfigError([f"cannot read the GGUF header of {path} ({err})"]) from None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ConfigError(
            [f"cannot read {path} ({reason}); give the model's config.json (JSON)"]
        ) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path} is not a JSON object; give the model's config.json"])
    return data


def _hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home) / "hub"


def _hub_cache_config(name: str) -> Path | None:
    """``config.json`` of hub model ``name`` in the local cache (the ``main`` snapshot first)."""
    repo = _hub_cache() / f"models--{name.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        path = repo / "snapshots" / ref.read_text().strip() / "config.json"
        if path.is_file():
            return path
    found = sorted(repo.glob("snapshots/*/config.json"))
    return found[0] if found else None
