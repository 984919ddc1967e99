"""An environment task: episode seeds split into train and held-out, and the environment.

Seeds are drawn once from ``training.seed`` (the same for every member): ``eval_size`` held-out
seeds for fitness, ``train_size`` (2048 when null) disjoint ones for training. The user's file
is imported only here and by ``pbt check``, within ``task.env_timeout_s`` times
:data:`IMPORT_TIMEOUTS` (its top level may load something large).
"""

from __future__ import annotations

import hashlib
import importlib.util
import random
import sys
from pathlib import Path
from typing import Any

from pbt.algorithms.data.examples import Example
from pbt.algorithms.envs.builtin import BUILTIN_CLASSES
from pbt.algorithms.envs.episodes import Episodes, env_max_turns
from pbt.algorithms.envs.protocol import Guard
from pbt.config import TaskConfig
from pbt.config.errors import ConfigError, EnvError
from pbt.config.sections.env import EnvConfig

IMPORT_TIMEOUTS = 10
SEED_SPACE = 2**31


def episodes_for(cfg: TaskConfig, base_dir: str | Path) -> Episodes:
    """The environment ``cfg.env`` names, ready to play (its file imported)."""
    env = cfg.env
    assert env is not None
    name = env.class_ if env.builtin else f"{env.class_} ({env.file})"
    factory = BUILTIN_CLASSES.get(env.class_) or _load_factory(env, base_dir, cfg.env_timeout_s)
    return Episodes(
        name=name,
        factory=factory,
        kwargs=dict(env.kwargs),
        max_turns=env.max_turns,
        max_episode_tokens=env.max_episode_tokens,
        use_tools=env.tools,
        timeout_s=cfg.env_timeout_s,
    )


def episode_seeds(cfg: TaskConfig, seed: int) -> tuple[list[Example], list[Example]]:
    """``(train, held-out)`` seeds as examples (``question`` is the seed), disjoint and the
    same for every member of a run seeded ``seed``."""
    rng = random.Random(f"env:{seed}")
    pool = rng.sample(range(SEED_SPACE), cfg.builtin_train_size + cfg.eval_size)
    as_examples = [Example(question=s, answer=None) for s in pool]
    return as_examples[cfg.eval_size :], as_examples[: cfg.eval_size]


def _load_factory(env: EnvConfig, base_dir: str | Path, timeout_s: float) -> Any:
    path = Path(base_dir) / str(env.file)
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"pbt_user_env_{digest}"
    guard = Guard(f"{env.class_} ({env.file})", timeout_s * IMPORT_TIMEOUTS)
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ConfigError([f"task.env.file ({env.file!r}) cannot be imported from {path}"])
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses in the file look themselves up here
        try:
            guard.call(spec.loader.exec_module, (module,), f"import of {env.file}", 0, "")
        except EnvError:
            del sys.modules[module_name]
            raise
    factory = getattr(module, env.class_, None)
    if not callable(factory):
        raise ConfigError(
            [f"task.env.class ({env.class_!r}) in {env.file} is {factory!r}, not a class"]
        )
    return factory


def check_env(cfg: TaskConfig, base_dir: str | Path, seed: int) -> list[str]:
    """``pbt check``: the environment loads, is made, resets on the first training seed and
    plays one turn (an empty reply) with well-formed results; one problem if not."""
    if cfg.env is None:
        return []
    try:
        episodes = episodes_for(cfg, base_dir)
        guard = episodes.guard()
        env = episodes.make(guard)
        missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
        if missing:
            return [
                f"task.env.class ({cfg.env.class_!r}) makes {type(env).__name__}, which has no "
                f"{' or '.join(missing)}(); give it reset(seed) and step(action)"
            ]
        guard.reset(env, episode_seeds(cfg, seed)[0][0].question)
        guard.step(env, "", 1)
        if cfg.env.max_turns is None:
            env_max_turns(env, guard)
    except ConfigError as err:
        return err.problems
    except EnvError as err:
        return [str(err)]
    return []
