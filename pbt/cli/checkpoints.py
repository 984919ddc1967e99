"""``pbt inspect`` and ``pbt export``: read any checkpoint, verified, without training.

These commands load torch (a checkpoint is torch data) but no model unless ``--merge`` asks
for one; the controller never calls them. Both read only the files the checkpoint's manifest
lists, never through a symbolic link (:mod:`pbt.algorithms.runtime.checkpoint`): a checkpoint that holds
one is refused, and an export copies the listed adapter files' verified bytes, nothing else.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from pbt.config import QuantizationConfig
from pbt.config.errors import PbtError


def inspect_text(path: Path) -> str:
    """Hyperparameters, lineage, fitness history, steps, tensor shapes and digest of a checkpoint.

    Raises:
        CheckpointError: the checkpoint fails verification (nothing is loaded then).
    """
    from pbt.algorithms.runtime.checkpoint import load_checkpoint

    attrs = load_checkpoint(path)
    trainable = attrs["trainable"]
    params = sum(t.numel() for t in trainable.values())
    lines = [
        f"checkpoint {path}",
        f"  digest (sha256 of manifest): {attrs['digest']}  [all file digests verified]",
        f"  format version {attrs['format_version']}, algorithm {attrs['algorithm']}, base model {attrs['base_model']}",
        f"  saved at world size {attrs.get('world_size', 1)}, step {attrs['step']}",
        f"  lineage: {json.dumps(attrs['lineage'])}",
        f"  fitness history: {[round(f, 4) for f in attrs['fitness']]}",
        f"  hyperparameters: {json.dumps(attrs['hyperparameters'])}",
        f"  LoRA: {json.dumps(attrs['lora_config'])}",
        f"  base quantization: {json.dumps(attrs.get('quantization'))}",
        f"  trainable tensors: {len(trainable)} ({params:,} parameters)",
    ]
    for name, tensor in list(trainable.items())[:6]:
        lines.append(f"    {name}: {tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}")
    if len(trainable) > 6:
        lines.append(f"    ... {len(trainable) - 6} more")
    lines.append(
        f"  optimizer state for {len(attrs['learner']['optimizer']['state'])} tensors, scheduler at step {attrs['learner']['scheduler'].get('last_epoch')}"
    )
    return "\n".join(lines)


def export(path: Path, out: Path, merge: bool = False) -> Path:
    """Write the checkpoint's adapter as a plain PEFT folder, or merged into its base model.

    An adapter trained on a 4-bit base (``model.quantization``, recorded in ``attributes.pt``)
    merges into the dequantized base: the full-precision model whose quantized weights are
    replaced by what the adapter saw in training.

    Raises:
        PbtError: ``out`` exists, or the checkpoint fails verification (a symbolic link in it
            included).
    """
    from pbt.algorithms.runtime.checkpoint import load_checkpoint

    if out.exists():
        raise PbtError(f"{out} already exists; choose a new output folder")
    if not merge:
        _copy_adapter(path, out)
        return out
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantization = load_checkpoint(path).get("quantization")
    with tempfile.TemporaryDirectory() as tmp:
        adapter = _copy_adapter(path, Path(tmp) / "adapter")
        config = json.loads((adapter / "adapter_config.json").read_text())
        base_path = config["base_model_name_or_path"]
        if quantization is not None:
            from pbt.algorithms.runtime.models import dequantized_base

            base = dequantized_base(base_path, QuantizationConfig(**quantization))
        else:
            base = AutoModelForCausalLM.from_pretrained(base_path)
        merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_path).save_pretrained(out)
    return out


def _copy_adapter(path: Path, out: Path) -> Path:
    """Write the adapter files ``path``'s manifest lists (and nothing else) to a new folder
    ``out``, each the bytes whose digest was checked; no file is written unless all verify."""
    from pbt.algorithms.runtime.checkpoint import (
        ADAPTER_DIR,
        checkpoint_files,
        read_checkpoint_file,
        verify_checkpoint,
    )

    prefix = f"{ADAPTER_DIR}/"
    names = [n for n in checkpoint_files(path) if n.startswith(prefix)]
    contents = {name: read_checkpoint_file(path, name) for name in names}
    verify_checkpoint(path, contents)  # the bytes read are the ones whose digests hold
    out.mkdir(parents=True)
    try:
        for name, data in contents.items():
            target = out / name[len(prefix) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out
