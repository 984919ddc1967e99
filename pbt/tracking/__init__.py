"""Tracking, torch-free: MLflow behind a journal that never blocks training
(:mod:`~pbt.tracking.tracker`, the only module that imports MLflow, lazily) and the run schema
campaigns and library mode log alike (:mod:`~pbt.tracking.run_schema`).
"""
