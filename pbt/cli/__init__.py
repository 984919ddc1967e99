"""The ``pbt`` command (:mod:`~pbt.cli.main`) and what it serves: the MLflow UI and
optuna-dashboard (:mod:`~pbt.cli.serve`), checkpoint inspection and export
(:mod:`~pbt.cli.checkpoints`).
"""
