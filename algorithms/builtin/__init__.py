"""What runs with no download: the built-in tiny model (:mod:`~pbt.algorithms.builtin.tiny`)
and the procedural tasks, one module each (:mod:`~pbt.algorithms.builtin.letters`,
:mod:`~pbt.algorithms.builtin.arithmetic`, :mod:`~pbt.algorithms.builtin.addition` with its
warm-started model).
"""
