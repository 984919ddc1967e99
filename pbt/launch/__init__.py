"""Launching member tasks, torch-free: torchrun process groups on this host, one per task or
long-lived workers (:mod:`~pbt.launch.local`, which also states the task directory's file
protocol), Slurm jobs behind the same contract (:mod:`~pbt.launch.slurm`), process groups and
their limits (:mod:`~pbt.launch.processes`), and a campaign's own MPS daemon
(:mod:`~pbt.launch.mps`).
"""
