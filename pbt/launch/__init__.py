"""Launching member tasks, torch-free. Two launchers: a process group per task attempt
(:mod:`~pbt.launch.local`, which also states the task directory's file protocol) or long-lived
workers (:mod:`~pbt.launch.persistent`); each runs its groups through a backend
(:mod:`~pbt.launch.backend`): this machine's, or Slurm jobs behind the same contract
(:mod:`~pbt.launch.slurm`); :mod:`~pbt.launch.build` picks both from the manifest. Also: what an
attempt is and how it ended (:mod:`~pbt.launch.attempt`), the next generation's tasks handed
ahead to workers still writing (:mod:`~pbt.launch.handahead`), process groups and their limits
(:mod:`~pbt.launch.processes`), and a campaign's own MPS daemon (:mod:`~pbt.launch.mps`).
"""
