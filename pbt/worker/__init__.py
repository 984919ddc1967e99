"""The member entry points, both run under torchrun: the task worker that a campaign's launcher
starts (``python -m pbt.worker``, :mod:`~pbt.worker.task`), and ``pbt train``, one member
trained standalone from a manifest (:mod:`~pbt.worker.train`).
"""
