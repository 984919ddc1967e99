"""pbt-llm: population-based training with hyperparameter search for RL fine-tuning of LLMs.

``import pbt`` is instant and torch-free: the public API below is imported on first use. The
controller side (``pbt.controller``, ``pbt.evolution``, ``pbt.tracking``, ``pbt.launch``,
``pbt.estimate``) never imports torch; the member entry points (``pbt.worker``),
library mode (``pbt.library``), the algorithms (``pbt.algorithms``) and the distributed layer
(``pbt.distributed``) do.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "create_population": "pbt.library.create",
    "Population": "pbt.library.population",
    "Agent": "pbt.library.population",
    "train_population": "pbt.library.loop",
    "TournamentSelection": "pbt.evolution.selection",
    "Mutations": "pbt.evolution.mutation",
    "HPRange": "pbt.config.ranges",
    "GRPO": "pbt.library.algorithms",
    "REINFORCE": "pbt.library.algorithms",
    "PPO": "pbt.library.algorithms",
    "SFT": "pbt.library.algorithms",
    "DPO": "pbt.library.algorithms",
    "CISPO": "pbt.library.algorithms",
    "GSPO": "pbt.library.algorithms",
    "LLMPPO": "pbt.library.algorithms",
    "LLMReinforce": "pbt.library.algorithms",
    "LLMREINFORCE": "pbt.library.algorithms",
    "VLLMConfig": "pbt.library.algorithms",
    "finetune_llm": "pbt.library.finetune",
    "finetune_llm_reasoning": "pbt.library.finetune",
    "finetune_llm_multiturn": "pbt.library.finetune",
    "RLParameter": "pbt.config.ranges",
    "HyperparameterConfig": "pbt.config.ranges",
    "FSDPConfig": "pbt.config.fsdp",
    "load_manifest": "pbt.config.loader",
}


def __getattr__(name: str):
    """The public API, imported on first use: ``import pbt`` stays torch-free and instant."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pbt' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["__version__", *_EXPORTS]
