"""Load the base model and tokenizer, and wrap the model with a LoRA adapter.

Every model, the built-in tiny one included, goes through the same ``from_pretrained`` path:
``builtin:tiny`` only resolves to a local folder first.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from pbt.algorithms.builtin.tiny import tiny_model_dir
from pbt.algorithms.runtime.gguf import gguf_model_dir
from pbt.config import LoRAConfig, ModelConfig, QuantizationConfig
from pbt.config.errors import ConfigError
from pbt.config.sections.model import locate_model, model_load_error
from pbt.distributed.fsdp import transformer_blocks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quiet_transformers() -> None:
    """Silence transformers' load progress bars and peft's deprecation chatter: not the
    user's concern, and noise in a member's log."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings(
        "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
    )
    # transformers >= 5.25 renames forward's past_key_values to cache; the static decoder keeps
    # the old name, which every 5.x release reads
    warnings.filterwarnings(
        "ignore", message=".*past_key_values.*is deprecated.*", category=FutureWarning
    )


def resolve_model_path(name: str, base_dir: str | Path = ".") -> str:
    """The folder or hub id to load for ``model.name`` (a folder relative to ``base_dir``, the
    manifest's folder); ``builtin:tiny`` is built and a GGUF file converted (into the cache) on
    first use.

    Raises:
        ConfigError: ``name`` is neither a built-in model, a model folder, a GGUF file that
            can be converted, nor a hub id.
        PbtError: a GGUF conversion ran out of disk.
    """
    where = locate_model(name, base_dir)
    if where.kind == "invalid":
        raise ConfigError([where.problem])
    if where.kind == "builtin":
        return str(tiny_model_dir())
    if where.kind == "gguf":
        return str(gguf_model_dir(where.path, name))
    return str(where.path) if where.kind == "folder" else name


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def load_tokenizer(cfg: ModelConfig, base_dir: str | Path = "."):
    """The tokenizer, with a pad token (falling back to EOS) and left padding for generation.

    Raises:
        ConfigError: ``model.name`` is not a model, or its tokenizer does not fit the config.
        PbtError: the hub could not be reached for it.
    """
    path = resolve_model_path(cfg.name, base_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise model_load_error(cfg.name, path, "tokenizer", err) from None
    if cfg.pad_token is not None:
        if cfg.pad_token not in tokenizer.get_vocab():
            raise ConfigError(
                [
                    f"model.pad_token ({cfg.pad_token!r}) is not in the tokenizer's vocabulary; "
                    "use one of its special tokens, or leave it unset for the default"
                ]
            )
        tokenizer.pad_token = cfg.pad_token
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
        print(
            f"note: model.name ({cfg.name!r}) has a tokenizer without a pad token; its "
            f"end-of-sequence token {tokenizer.eos_token!r} pads batches (model.pad_token "
            "chooses another)",
            file=sys.stderr,
        )
    if cfg.pad_token_id is not None and cfg.pad_token_id != tokenizer.pad_token_id:
        raise ConfigError(
            [
                f"model.pad_token_id ({cfg.pad_token_id}) is not the id of the pad token "
                f"{tokenizer.pad_token!r} ({tokenizer.pad_token_id}); set pad_token_id to "
                f"{tokenizer.pad_token_id} or name the token you mean with pad_token"
            ]
        )
    if tokenizer.chat_template is None:
        raise ConfigError(
            [f"model.name ({cfg.name!r}) has a tokenizer without a chat template; use a chat model"]
        )
    return tokenizer


def load_base_model(cfg: ModelConfig, device: torch.device, base_dir: str | Path = "."):
    """The frozen base model on ``device``.

    Raises:
        ConfigError: ``model.name`` is not a model this library can load.
        PbtError: the hub could not be reached for it.
    """
    path = resolve_model_path(cfg.name, base_dir)
    kwargs: dict = {"dtype": resolve_dtype(cfg.dtype, device)}
    if cfg.quantization is not None:
        # quantized as each weight is loaded, straight onto the device
        kwargs["quantization_config"] = bnb_config(cfg.quantization)
        kwargs["device_map"] = {"": device}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        raise model_load_error(cfg.name, path, "model", err) from None
    if cfg.quantization is None:
        model.to(device)
    else:
        keep_cpu_layout(model)
    model.requires_grad_(False)
    return model


STORAGE_DTYPES = {**DTYPES, "uint8": torch.uint8}


def require_bitsandbytes() -> None:
    """Import bitsandbytes, or say how to get it.

    Raises:
        ConfigError: bitsandbytes is not installed, or cannot load on this machine.
    """
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError(
            [
                "model.quantization needs bitsandbytes, which is not installed in this "
                "environment; install the extra: pip install 'pbt-llm[quant]', or remove "
                "model.quantization"
            ]
        ) from None
    except Exception as err:  # a native library that cannot load here
        raise ConfigError(
            [
                f"model.quantization needs bitsandbytes, which could not load on this machine "
                f"({type(err).__name__}: {err}); reinstall pbt-llm[quant] for this platform, or "
                "remove model.quantization"
            ]
        ) from None


def bnb_config(cfg: QuantizationConfig):
    """transformers' ``BitsAndBytesConfig`` for ``model.quantization``."""
    require_bitsandbytes()
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.quant_type,
        bnb_4bit_compute_dtype=DTYPES[cfg.compute_dtype],
        bnb_4bit_use_double_quant=cfg.double_quant,
        bnb_4bit_quant_storage=STORAGE_DTYPES[cfg.storage_dtype],
    )


def keep_cpu_layout(model) -> None:
    """Keep every 4-bit layer in bitsandbytes' portable layout: on a CPU with AVX512-BF16 an
    inference forward would otherwise repack the weights in place (and drop the double
    quantization), so evaluation would change what training and checkpoints see, and a sharded
    weight would no longer match its shards."""
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False


def dequantized_base(path: str, quantization: QuantizationConfig):
    """The full-precision base at ``path`` with every weight that ``quantization`` would make
    4-bit replaced by its dequantized value: the weights a QLoRA adapter was trained on, so
    merging the adapter into it gives the model that was trained. On the CPU."""
    from bitsandbytes.functional import dequantize_4bit
    from bitsandbytes.nn import Linear4bit

    quantized = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb_config(quantization), device_map={"": "cpu"}
    )
    keep_cpu_layout(quantized)
    with torch.no_grad():
        weights = {
            name: dequantize_4bit(m.weight.data, m.weight.quant_state).float()
            for name, m in quantized.named_modules()
            if isinstance(m, Linear4bit)
        }
    del quantized
    base = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for name, weight in weights.items():
            base.get_submodule(name).weight.copy_(weight)
    return base


def lora_config(cfg: LoRAConfig) -> LoraConfig:
    """The peft ``LoraConfig`` for ``cfg``."""
    return LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type="CAUSAL_LM",
    )


def add_lora(model, cfg: LoRAConfig, adapter_name: str = "default") -> PeftModel:
    """Wrap ``model`` with a fresh LoRA adapter (B initialised to zero: no change at step 0)."""
    return get_peft_model(model, lora_config(cfg), adapter_name=adapter_name)


def adapter_dir_base(name: str, base_dir: str | Path = ".") -> str:
    """What a saved adapter records as its base model: an absolute path for ``builtin:tiny``,
    a local folder and a GGUF file's converted folder, the hub id otherwise."""
    if locate_model(name, base_dir).kind == "hub":
        return name
    return str(Path(resolve_model_path(name, base_dir)).resolve())


def set_mixed_precision(model, enabled: bool) -> None:
    """Decide once whether :func:`mixed_precision` autocasts ``model``'s passes: on CUDA, when
    the frozen base is bf16 or fp16 (the adapter's master weights stay float32)."""
    frozen = next((p for p in model.parameters() if not p.requires_grad), None)
    half = frozen is not None and frozen.dtype in (torch.bfloat16, torch.float16)
    on_cuda = frozen is not None and frozen.device.type == "cuda"
    model.pbt_autocast_dtype = frozen.dtype if enabled and half and on_cuda else None


def set_mode(model: torch.nn.Module, training: bool) -> None:
    """``model.train(training)``, skipped when ``model`` is in that mode already. The call walks
    every module (about 2,000 in the 0.5B shape with LoRA: some milliseconds, and a member's
    step switched twice, for each member of a batch); the mode here only ever changes for the
    whole model, so its own flag is every module's."""
    if model.training != training:
        model.train(training)


def mixed_precision(model) -> contextlib.AbstractContextManager:
    """Autocast to the base's half type for ``model``'s passes, where
    :func:`set_mixed_precision` turned it on; otherwise nothing."""
    dtype = getattr(model, "pbt_autocast_dtype", None)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=dtype)


def compile_decoder(model) -> None:
    """Compile the decoder stack of ``model`` (a peft model) in place: parameter names and the
    state dict stay as they are; the output layer stays eager (the log-prob path swaps it), and
    the log-prob path compiles its own elementwise work (``pbt_compiled``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.get_decoder().compile()
    model.pbt_compiled = True


def quantize_blocks(base, device, quant_type: str = "nf4", double_quant: bool = True) -> int:
    """Replace every linear layer of ``base``'s blocks by a bitsandbytes 4-bit layer holding
    its weights quantized (what ``model.quantization`` gives through ``from_pretrained``: the
    embeddings and the output layer stay as they are), for a model built in memory rather than
    loaded; returns how many. One layer at a time,
    so the unquantized copy of a whole model is never held twice."""
    blocks = transformer_blocks(base)
    count = sum(quantize_block(block, device, quant_type, double_quant) for block in blocks)
    keep_cpu_layout(base)
    return count


def quantize_block(block, device, quant_type: str = "nf4", double_quant: bool = True) -> int:
    """Quantize one block's linear layers in place (:func:`quantize_blocks`); how many."""
    import bitsandbytes as bnb

    count = 0
    for parent in list(block.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            layer = bnb.nn.Linear4bit(
                child.in_features, child.out_features, bias=child.bias is not None,
                compute_dtype=torch.bfloat16, compress_statistics=double_quant,
                quant_type=quant_type, quant_storage=torch.bfloat16, device="meta",
            )  # fmt: skip
            layer.weight = bnb.nn.Params4bit(
                child.weight.data, requires_grad=False,
                compress_statistics=double_quant, quant_type=quant_type,
                quant_storage=torch.bfloat16, module=layer,
            )  # fmt: skip
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, layer.to(device))  # quantizes the weight
            count += 1
    return count
