"""pbt-llm: population-based training with hyperparameter search for RL fine-tuning of LLMs.

``import pbt`` is instant and torch-free: the public API below is imported on first use. The
controller side (``pbt.controller``, ``pbt.evolution``, ``pbt.tracking``, ``pbt.launch``,
``pbt.estimate``) never imports torch; the member entry points (``pbt.worker``),
library mode (``pbt.library``), the algorithms (``pbt.algorithms``) and the distributed layer
(``pbt.distributed``) do.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "create_population": "pbt.agilerl.create",
    "Population": "pbt.library.population",
    "Agent": "pbt.library.population",
    "train_population": "pbt.library.loop",
    "TournamentSelection": "pbt.evolution.selection",
    "Mutations": "pbt.evolution.mutation",
    "HPRange": "pbt.config.ranges",
    "GRPO": "pbt.agilerl.agents",
    "REINFORCE": "pbt.agilerl.agents",
    "PPO": "pbt.agilerl.agents",
    "SFT": "pbt.agilerl.agents",
    "DPO": "pbt.agilerl.agents",
    "CISPO": "pbt.agilerl.agents",
    "GSPO": "pbt.agilerl.agents",
    "LLMPPO": "pbt.agilerl.agents",
    "LLMReinforce": "pbt.agilerl.agents",
    "LLMREINFORCE": "pbt.agilerl.agents",
    "VLLMConfig": "pbt.agilerl.agents",
    "finetune_llm": "pbt.agilerl.finetune",
    "finetune_llm_reasoning": "pbt.agilerl.finetune",
    "finetune_llm_multiturn": "pbt.agilerl.finetune",
    "RLParameter": "pbt.config.ranges",
    "HyperparameterConfig": "pbt.config.ranges",
    "FSDPConfig": "pbt.config.sections.fsdp",
    "load_manifest": "pbt.config.read.loader",
}


def __getattr__(name: str):
    """The public API, imported on first use: ``import pbt`` stays torch-free and instant."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pbt' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["__version__", *_EXPORTS]
