"""The LLM algorithms: learners, objectives, rollouts, rewards, tasks and checkpoints.

Users import the algorithms by name from here, as in AgileRL::

    from pbt.algorithms import GRPO, CISPO, GSPO, LLMPPO, LLMReinforce, SFT, DPO

Those names are handles that build library-mode populations (:mod:`pbt.library.algorithms`),
a floor above this package; they are re-exported on first use, like ``pbt``'s own public
names, so ``import pbt.algorithms`` imports no torch and nothing in this package depends on
them (tests/test_layout.py holds this package's ``__getattr__`` to exactly that).
"""

HANDLES = (
    "GRPO", "CISPO", "GSPO", "LLMPPO", "LLMReinforce", "LLMREINFORCE", "REINFORCE", "PPO", "SFT",
    "DPO",
)  # fmt: skip


def __getattr__(name: str):
    """The algorithm handles, imported on first use; any other name is a submodule."""
    if name not in HANDLES:
        raise AttributeError(f"module 'pbt.algorithms' has no attribute {name!r}")
    from pbt.library import algorithms

    return getattr(algorithms, name)
