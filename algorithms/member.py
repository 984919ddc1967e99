"""A member: one model with its adapter, task and learner, and its checkpoint.

This is what a torchrun group trains. Saving gathers everything a member is into one
checkpoint (see :mod:`pbt.algorithms.checkpoint`); loading a checkpoint and training on gives
exactly what training straight through would have given.
"""

from __future__ import annotations

import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from pbt.algorithms.checkpoint import load_checkpoint, save_checkpoint
from pbt.algorithms.grpo import GRPO
from pbt.algorithms.models import adapter_dir_base, add_lora, load_base_model, load_tokenizer
from pbt.algorithms.tasks import Task, load_task
from pbt.config import Manifest
from pbt.errors import CheckpointError


class Member:
    """Model, tokenizer, task and learner built from a manifest.

    Args:
        manifest: the validated run configuration.
        device: where the model lives.
        member_id: this member's name in lineage records.
    """

    def __init__(
        self, manifest: Manifest, device: torch.device, member_id: str = "member-0"
    ) -> None:
        self.manifest = manifest
        self.device = device
        self.member_id = member_id
        seed_everything(manifest.training.seed)
        self.tokenizer = load_tokenizer(manifest.model)
        self.model = add_lora(load_base_model(manifest.model, device), manifest.lora)
        self.task: Task = load_task(manifest.task, manifest.base_dir, manifest.training.seed)
        self.learner = GRPO(
            self.model,
            self.tokenizer,
            manifest.algorithm,
            manifest.optim,
            manifest.rollout,
            total_steps=manifest.training.steps,
            seed=manifest.training.seed,
        )
        self.fitness: list[float] = []
        self.lineage: dict[str, Any] = {
            "member": member_id,
            "parent": None,
            "generation": 0,
            "mutation": None,
        }

    def attributes(self) -> dict[str, Any]:
        """Everything the member is, as plain data for ``attributes.pt``."""
        return {
            "algorithm": self.manifest.algorithm.name,
            "base_model": self.manifest.model.name,
            "lora_config": asdict(self.manifest.lora),
            "hyperparameters": self.learner.hyperparameters(),
            "mutation_ranges": {},
            "trainable": {
                k: v.detach().cpu() for k, v in get_peft_model_state_dict(self.model).items()
            },
            "learner": self.learner.state_dict(),
            "rng": capture_rng(),
            "step": self.learner.step,
            "fitness": list(self.fitness),
            "lineage": dict(self.lineage),
        }

    def save(self, path: str | Path) -> str:
        """Write the checkpoint; returns its digest."""
        config = self.model.peft_config["default"].to_dict()
        config["base_model_name_or_path"] = adapter_dir_base(self.manifest.model.name)
        config["target_modules"] = (
            sorted(config["target_modules"])
            if isinstance(config["target_modules"], (set, list))
            else config["target_modules"]
        )
        return save_checkpoint(path, self.attributes(), config)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore adapter, optimizer, scheduler, RNG, step, fitness and lineage from ``path``.

        Raises:
            CheckpointError: the checkpoint is invalid or belongs to another model or algorithm.
        """
        attrs = load_checkpoint(path)
        self._check_compatible(attrs, path)
        result = set_peft_model_state_dict(
            self.model, {k: v.to(self.device) for k, v in attrs["trainable"].items()}
        )
        if result.unexpected_keys:
            raise CheckpointError(
                f"checkpoint {path}: adapter keys do not fit this model: {result.unexpected_keys[:3]}"
            )
        self.learner.load_state_dict(attrs["learner"])
        self.learner.apply_hyperparameters(attrs["hyperparameters"])
        restore_rng(attrs["rng"])
        self.fitness = [float(f) for f in attrs["fitness"]]
        self.lineage = dict(attrs["lineage"])
        return attrs

    def _check_compatible(self, attrs: dict[str, Any], path: str | Path) -> None:
        expected = {
            "algorithm": self.manifest.algorithm.name,
            "base_model": self.manifest.model.name,
            "lora_config": asdict(self.manifest.lora),
        }
        for key, value in expected.items():
            if attrs.get(key) != value:
                raise CheckpointError(
                    f"checkpoint {path} has {key} {attrs.get(key)!r} but this run uses {value!r}; "
                    "load it with the manifest it was trained with"
                )


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's global generators (CPU and CUDA)."""
    random.seed(seed)
    torch.manual_seed(seed)


def capture_rng() -> dict[str, Any]:
    """The global RNG states as plain data (tensors and lists)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured."""
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
