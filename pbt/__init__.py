"""pbt-llm: population-based training with hyperparameter search for RL fine-tuning of LLMs.

The controller side of this package (configs, manifests, the CLI) imports no torch; the
algorithms (``pbt.algorithms``) and the distributed layer (``pbt.distributed``) do.
"""

__version__ = "0.1.0"
