"""What runs with no download: the built-in tiny model (:mod:`~pbt.algorithms.builtin.tiny`)
and the warm-started addition task (:mod:`~pbt.algorithms.builtin.addition`).
"""
