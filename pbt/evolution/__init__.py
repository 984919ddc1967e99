"""Evolution, torch-free, shared by campaigns and library mode: selection of parents
(:mod:`~pbt.evolution.selection`), explore steps (:mod:`~pbt.evolution.mutation`, PB2 in
:mod:`~pbt.evolution.pb2`), each generation's children (:mod:`~pbt.evolution.breeding`), and
Optuna as sampler and search strategy (:mod:`~pbt.evolution.search`, the only module that
imports Optuna; a campaign's trials in :mod:`~pbt.evolution.trials`).
"""
