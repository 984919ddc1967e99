"""The LLM algorithms: learners, objectives, rollouts, rewards, tasks and checkpoints.

Users import the algorithms by name from here, as in AgileRL::

    from pbt.algorithms import GRPO, CISPO, GSPO, LLMPPO, LLMReinforce, SFT, DPO, VLLMConfig

Those names are AgileRL's agent classes and its ``VLLMConfig``, defined with AgileRL's call
shapes (:mod:`pbt.agilerl.agents`), floors above this package; they are re-exported on first use,
like ``pbt``'s own public names, so ``import pbt.algorithms`` imports no torch (nor does
building an agent: it loads on first use) and nothing in this package depends on them
(tests/unit/test_layout.py holds this package's ``__getattr__`` to exactly that).
"""

import logging

# bitsandbytes (imported by peft whenever it is installed) warns on every import on a CPU with
# AVX512-BF16 that its optimised 4-bit kernel needs the optional `kernels` package; the
# fallback it then uses is what runs, so the line is noise in every member's log.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

HANDLES = (
    "GRPO", "CISPO", "GSPO", "LLMPPO", "LLMReinforce", "LLMREINFORCE", "REINFORCE", "PPO", "SFT",
    "DPO", "VLLMConfig",
)  # fmt: skip


def __getattr__(name: str):
    """The agent classes and ``VLLMConfig``, imported on first use; any other name is a
    submodule."""
    if name not in HANDLES:
        raise AttributeError(f"module 'pbt.algorithms' has no attribute {name!r}")
    from pbt.agilerl import agents

    return getattr(agents, name)
