"""The memory estimate, torch-free: a member's peak GPU memory per rank
(:mod:`~pbt.estimate.memory`) from its model's shape (:mod:`~pbt.estimate.model_shape`),
before anything is launched (``pbt estimate-memory``, ``pbt check``).
"""
