"""Multi-turn environments and tools, trained token-in/token-out.

An environment has AgileRL's ``MultiTurnEnv`` shape (:mod:`~pbt.algorithms.envs.protocol`);
tools are plain functions (:mod:`~pbt.algorithms.envs.tools`); episodes are played in batches
(:mod:`~pbt.algorithms.envs.episodes`) into trajectories that keep the sampled token ids
(:mod:`~pbt.algorithms.envs.trajectory`); the task's seeds and the user's file are loaded by
:mod:`~pbt.algorithms.envs.task`; built-ins live in :mod:`~pbt.algorithms.envs.builtin`.
"""
