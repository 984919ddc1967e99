"""The member entry points, both run under torchrun: the task worker that a campaign's launcher
starts (``python -m pbt.worker``, :mod:`~pbt.worker.main`), which runs one task
(:mod:`~pbt.worker.task`) or serves many (:mod:`~pbt.worker.serve`, with its state caches,
:mod:`~pbt.worker.cache`), and ``pbt train``, one member trained standalone from a manifest
(:mod:`~pbt.worker.train`).
"""
