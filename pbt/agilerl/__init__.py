"""AgileRL's call shapes over this package: the agent classes (``GRPO(...)``,
``GRPO.population(...)``), ``create_population``'s positional form, ``VLLMConfig``, the
``pbt.hpo`` selection and mutation, and ``finetune_llm``. Users import them where AgileRL's
users would look: ``from pbt.algorithms import GRPO``, ``from pbt.hpo import Mutations``,
``from pbt import finetune_llm``."""
