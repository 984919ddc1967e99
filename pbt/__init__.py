"""pbt-llm: population-based training with hyperparameter search for RL fine-tuning of LLMs.

The controller side of this package (configs, manifests, the CLI) imports no torch; the
algorithms (``pbt.algorithms``) and the distributed layer (``pbt.distributed``) do.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "create_population": "pbt.populate",
    "Population": "pbt.library",
    "Agent": "pbt.library",
    "train_population": "pbt.loop",
    "TournamentSelection": "pbt.selection",
    "Mutations": "pbt.mutation",
    "HPRange": "pbt.mutation",
    "GRPO": "pbt.algorithms.grpo",
    "REINFORCE": "pbt.algorithms.grpo",
    "PPO": "pbt.algorithms.ppo",
    "SFT": "pbt.algorithms.sft",
    "DPO": "pbt.algorithms.dpo",
    "FSDPConfig": "pbt.distributed.fsdp",
}


def __getattr__(name: str):
    """The public API, imported on first use: ``import pbt`` stays torch-free and instant."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pbt' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["__version__", *_EXPORTS]
