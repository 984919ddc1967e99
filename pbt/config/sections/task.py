"""The task: prompts with answers, and the reward."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pbt.config.rules import PositiveInt, Seconds, above_zero, bound_problems, shown
from pbt.config.sections.env import EnvConfig
from pbt.config.sections.source import definition_problems


@dataclass(kw_only=True, slots=True)
class RewardRef:
    """A user reward function ``reward_fn(completion, answer, question) -> float`` in a file, or
    a rubric there (an OpenEnv ``Rubric`` instance or class, as AgileRL's ``rubric_name``)."""

    file: str
    """Path to a Python file, relative to the manifest's folder."""
    function: str
    """Name of the function in that file."""
    weight: float = 1.0
    """Its weight in the sum, when ``task.rewards`` lists several."""
    batched: bool = False
    """The function takes lists (``completions, answers, questions``) and returns a list of
    floats, one per completion."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        if "\0" in self.file:
            problems.append(
                f"{prefix}.file ({shown(self.file)}) holds a NUL byte, which no path may; give a .py "
                "path relative to the manifest's folder"
            )
        elif not self.file.endswith(".py"):
            problems.append(f"{prefix}.file ({shown(self.file)}) must be a .py file")
        if not self.function.isidentifier():
            problems.append(
                f"{prefix}.function ({shown(self.function)}) must be a Python identifier"
            )
        if not math.isfinite(self.weight) or self.weight == 0:
            problems.append(
                f"{prefix}.weight ({self.weight}) must be a finite, non-zero number; 1.0 counts "
                "the reward as is"
            )
        return problems

    def check_source(self, base_dir: Path, prefix: str) -> list[str]:
        """The file exists under ``base_dir`` and defines ``function`` at its top level. The
        source is parsed, not executed: loading a manifest runs no user code (``pbt check`` then
        imports and calls it once, :func:`pbt.algorithms.data.tasks.check_rewards`)."""
        return definition_problems(base_dir, self.file, self.function, prefix, "function")


@dataclass(kw_only=True, slots=True)
class StageConfig:
    """One stage of a curriculum (``task.stages``): where its rows come from, named as a task's
    rows are, and the step it ends at."""

    until_step: Annotated[int, above_zero("give the step the stage ends at")] | None = None
    """The member's step count at which the next stage begins; null only for the last stage
    (it runs to the end)."""
    name: str | None = None
    """A built-in or ``reasoning_gym:<dataset>`` task, as ``task.name``."""
    train: str | None = None
    """The user's rows, as ``task.train``."""
    eval: str | None = None
    """Held-out rows for the user's own ``train``, as ``task.eval``."""
    options: dict[str, Any] = field(default_factory=dict)
    """reasoning-gym options of this stage (default ``task.options``)."""
    train_size: Annotated[int, above_zero("or null for the task's")] | None = None
    """Training rows of this stage (default ``task.train_size``)."""

    def check(self, prefix: str) -> list[str]:
        problems = bound_problems(self, prefix)
        if (self.name is None) == (self.train is None):
            problems.append(
                f"{prefix} must name its rows with exactly one of name (a built-in or "
                "reasoning_gym: task) and train (your own file); give one"
            )
        return problems


BUILTIN_TASKS = ("builtin:letters", "builtin:arithmetic", "builtin:addition")
"""The procedural tasks shipped with the package (no files, no downloads)."""
REASONING_GYM_PREFIX = "reasoning_gym:"
"""``task.name: reasoning_gym:<dataset>``: a procedural dataset of the reasoning-gym package
(the ``tasks`` extra), scored by its own scorer."""
HUB_PREFIX = "hf:"
"""``task.train: hf:NAME[:SPLIT]``: a dataset on the Hugging Face hub, by ``datasets``' path."""
DEFAULT_TASK = "builtin:letters"


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """Where the rows come from (a built-in task, a reasoning-gym dataset, or the user's own
    files), how a row becomes a prompt, and the reward."""

    name: str | None = None
    """A built-in procedural task (``builtin:letters``, ``builtin:arithmetic``,
    ``builtin:addition``) or ``reasoning_gym:<dataset>``; null: ``builtin:letters`` unless
    ``train`` names the user's own data."""
    train: str | None = None
    """The user's rows: a JSONL, JSON, CSV or Parquet file, or a folder written by
    ``datasets.Dataset.save_to_disk``, relative to the manifest's folder; or ``hf:NAME[:SPLIT]``
    for a hub dataset (split ``train`` by default). Loaded with ``datasets``, memory-mapped."""
    eval: str | None = None
    """Held-out rows for fitness, in the same forms as ``train``; null: a seeded
    ``eval_fraction`` of ``train``."""
    eval_fraction: float = 0.1
    """The share of ``train`` held out for fitness when ``eval`` is null (a split seeded by
    ``training.seed``, the same for every member)."""
    question_field: str = "question"
    """RL: the field of a row that is the question."""
    answer_field: str = "answer"
    """RL: the field passed to the reward as ``answer`` (any JSON value, as is)."""
    prompt_field: str = "prompt"
    """SFT and DPO: the field that is the prompt."""
    response_field: str = "response"
    """SFT: the field that is the response to imitate."""
    chosen_field: str = "chosen"
    """DPO: the field that is the preferred response."""
    rejected_field: str = "rejected"
    """DPO: the field that is the dispreferred response."""
    system_prompt: str | None = None
    """A system turn before each prompt (with the tokenizer's chat template)."""
    prompt_template: str | None = None
    """A format string over the row's fields that makes the user turn, e.g.
    ``"Solve: {question}"``; null: the question (or prompt) field as is."""
    assistant_prefill: str | None = None
    """RL: the start of the assistant's reply (literal text, e.g. ``"Let me think.\\n<think>"``),
    written after the chat template's generation prompt; the model's completion continues it.
    The reward sees the completion only, without the prefill (AgileRL's ``assistant_N`` turn of
    ``prompt_template``)."""
    options: dict[str, Any] = field(default_factory=dict)
    """reasoning-gym: keyword arguments of the dataset's config (e.g. ``{min_digits: 2}``);
    ``size`` and ``seed`` are set from ``train_size + eval_size`` and ``training.seed``."""
    reward: RewardRef | None = None
    """The reward: a user function (replaces a built-in task's own reward)."""
    rewards: list[RewardRef] = field(default_factory=list)
    """Several rewards, summed by their ``weight`` (each logged on its own); not with
    ``reward``."""
    reward_timeout_s: Seconds = 30.0
    """Seconds one reward call (one completion, or one batch with ``batched``) may take before
    the member fails with a message naming the function."""
    train_size: Annotated[int, above_zero("or null for every row")] | None = None
    """Training rows (at most): null takes every row of a file, and 2048 of a built-in or
    reasoning-gym task (a small built-in task may have fewer)."""
    eval_size: PositiveInt = 64
    """Held-out rows that fitness is measured on (at most; a seeded, fixed subset of a larger
    eval split, the same for every member). With ``stages``: per stage; with ``env``, the
    held-out episode seeds."""
    stages: list[StageConfig] = field(default_factory=list)
    """A curriculum: the training rows move from one stage's rows to the next as the member's
    step count passes each ``until_step``; fitness is measured on every stage's held-out rows
    together. Replaces ``name`` and ``train``."""
    replay: float = 0.0
    """With ``stages``: the share of each step's prompts drawn from the earlier stages' rows."""
    env: EnvConfig | None = None
    """A multi-turn environment instead of rows: ``{file, class, kwargs}`` (see
    docs/environments.md). Training episodes start from ``train_size`` seeds (2048 when null),
    fitness is the mean greedy return over ``eval_size`` held-out seeds."""
    env_timeout_s: Seconds = 30.0
    """Seconds one environment call (``reset``, ``step`` or a tool) may take before the member
    fails with a line naming the class, the turn and the action."""

    @property
    def source(self) -> str:
        """Where the rows come from: the task's name, or the ``train`` path (each stage's,
        joined by ``" -> "``, for a curriculum)."""
        if self.stages:
            return " -> ".join(str(stage.name or stage.train) for stage in self.stages)
        if self.train is not None:
            return self.train
        return self.name or DEFAULT_TASK

    @property
    def builtin_train_size(self) -> int:
        """``train_size``, or the default of a built-in or reasoning-gym task."""
        return 2048 if self.train_size is None else self.train_size

    def reward_refs(self) -> list[RewardRef]:
        """The user's rewards, whichever key named them."""
        return [self.reward] if self.reward is not None else list(self.rewards)

    def reward_keys(self) -> list[str]:
        """The manifest key of each of :meth:`reward_refs`, as problems name it:
        ``task.reward``, or ``task.rewards[i]``."""
        if self.reward is not None:
            return ["task.reward"]
        return [f"task.rewards[{i}]" for i in range(len(self.rewards))]

    def check(self, prefix: str) -> list[str]:
        problems = bound_problems(self, prefix)
        if not 0.0 < self.eval_fraction < 1.0:
            problems.append(
                f"{prefix}.eval_fraction ({self.eval_fraction}) must be between 0 and 1 "
                "(exclusive); 0.1 holds out a tenth of train"
            )
        if self.assistant_prefill is not None and not self.assistant_prefill:
            problems.append(
                f"{prefix}.assistant_prefill ('') is empty; give the text that starts the reply, "
                "or null for none"
            )
        problems += self._check_source(prefix) if not self.stages else self._check_stages(prefix)
        if self.reward is not None and self.rewards:
            problems.append(
                f"{prefix}.reward and {prefix}.rewards are both set; give one reward as reward, "
                "or several as rewards"
            )
        if self.env is not None:
            problems += self._check_env(prefix)
        if self.reward is not None:
            problems += self.reward.check(f"{prefix}.reward")
        for i, ref in enumerate(self.rewards):
            problems += ref.check(f"{prefix}.rewards[{i}]")
        return problems

    def _check_stages(self, prefix: str) -> list[str]:
        problems = []
        if self.name is not None or self.train is not None:
            problems.append(
                f"{prefix}.stages replaces {prefix}.name and {prefix}.train (each stage names its "
                "rows); move them into the stages"
            )
        for i, stage in enumerate(self.stages):
            problems += stage.check(f"{prefix}.stages[{i}]")
        ends = [stage.until_step for stage in self.stages]
        if any(end is None for end in ends[:-1]) or any(
            a is not None and b is not None and a >= b for a, b in itertools.pairwise(ends)
        ):
            problems.append(
                f"{prefix}.stages until_step ({ends}) must rise from stage to stage, and only the "
                "last may be null; give each stage but the last the step it ends at"
            )
        names = {stage.name for stage in self.stages}
        if not self.reward_refs() and (len(names) > 1 or None in names):
            problems.append(
                f"{prefix}.stages take their rows from {len(names)} sources ({sorted(map(str, names))}) "
                f"with no {prefix}.reward: stages of your own files, or of different tasks, need "
                "one reward for all; add task.reward"
            )
        if not (isinstance(self.replay, int | float) and 0 <= self.replay < 1):
            problems.append(
                f"{prefix}.replay ({self.replay!r}) must be in [0, 1): the share of a step's prompts "
                "drawn from earlier stages; use 0.2"
            )
        return problems

    def _check_env(self, prefix: str) -> list[str]:
        """An environment is the whole task: no rows, no reward functions beside it."""
        assert self.env is not None
        problems = self.env.check(f"{prefix}.env")
        for key in ("name", "train", "eval", "reward"):
            if getattr(self, key) is not None:
                problems.append(
                    f"{prefix}.{key} is set with {prefix}.env: an environment makes its own "
                    f"episodes and rewards; remove {prefix}.{key}"
                )
        if self.rewards:
            problems.append(
                f"{prefix}.rewards is set with {prefix}.env: the environment's step() returns "
                f"the rewards; remove {prefix}.rewards"
            )
        if self.stages:
            problems.append(
                f"{prefix}.stages is set with {prefix}.env: an environment makes its own "
                f"episodes; remove {prefix}.stages"
            )
        return problems

    def _check_source(self, prefix: str) -> list[str]:
        if self.replay:
            return [
                f"{prefix}.replay ({self.replay}) replays earlier stages, but there are no "
                f"{prefix}.stages; add stages or remove replay"
            ]
        name = self.name
        if self.train is not None and name is not None and not name.startswith("builtin:"):
            return [
                f"{prefix}.name ({shown(name)}) and {prefix}.train ({shown(self.train)}) both name the rows; "
                "give train for your own data, or name for a built-in task"
            ]
        if self.train is not None and name is not None:
            return [
                f"{prefix}.name ({shown(name)}) and {prefix}.train ({shown(self.train)}) both name the rows; "
                "remove name to train on your file"
            ]
        if self.train is None and self.eval is not None:
            return [
                f"{prefix}.eval ({shown(self.eval)}) needs {prefix}.train: held-out rows of your own "
                "data go with training rows of your own; add train or remove eval"
            ]
        if name is not None and name == REASONING_GYM_PREFIX:
            return [
                f"{prefix}.name ({shown(name)}) names no dataset; write "
                "reasoning_gym:<dataset>, e.g. reasoning_gym:basic_arithmetic"
            ]
        for key in ("train", "eval"):
            value = getattr(self, key)
            if value is not None and (not value or "\0" in value):
                problems = f"{prefix}.{key} ({shown(value)}) is not a path"
                return [f"{problems}; give a file or folder relative to the manifest's folder"]
        return []
