"""Playing episodes: many environments at once, one batched sampling call per turn.

:func:`play` runs ``repeats`` episodes from each seed (a group: the rows of one seed are
consecutive, so the learner's group-relative advantages compare trajectories of one start) and
returns their :class:`~pbt.algorithms.envs.trajectory.Trajectory` objects;
:func:`to_batch` turns them into a :class:`~pbt.algorithms.rollout.hf.RolloutBatch` whose
completion is everything after the first prompt, with the loss mask on sampled tokens only and
the attention mask on every real token. A trajectory's return (the sum of its per-turn and final
rewards) is its row's reward, so every objective of the GRPO family, the zero-signal and
collapse diagnoses included, runs on trajectories unchanged.

Each turn samples through the member's rollout engine from the token ids themselves:
``generate`` or the static-cache decoder (:func:`~pbt.algorithms.rollout.hf.sample_ids`), or the
colocated vLLM engine (:meth:`~pbt.algorithms.rollout.vllm.VLLMRollout.continue_ids`, token ids
as the prompt, prefix-cached across turns, the sampler's log-probs kept for the importance
correction). Under FSDP, and with a vLLM engine that spans the ranks, every rank takes the same
number of sampling calls (a rank whose episodes have all ended samples a stand-in row and drops
it). Data-parallel ranks play their own episodes (their own seeds) and meet only in the
gradient all-reduce.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pbt.algorithms.data.examples import Example
from pbt.algorithms.envs.protocol import Guard
from pbt.algorithms.envs.tools import (
    parse_call,
    renders_tools,
    schemas,
    tool_result,
    tools_system_prompt,
)
from pbt.algorithms.envs.trajectory import Trajectory, TurnTemplate
from pbt.algorithms.rollout.hf import RolloutBatch, sample_ids
from pbt.algorithms.runtime.models import set_mode
from pbt.distributed import all_reduce
from pbt.distributed.fsdp import is_sharded

Sampler = Callable[
    [list[list[int]], int], list[list[int]] | tuple[list[list[int]], list[list[float]] | None]
]
"""``sampler(contexts, max_new)``: one reply's token ids for each context (at most ``max_new``
new tokens each), or ``(ids, log-probs)`` where the engine reports the log-prob of each
sampled token (vLLM; None when greedy)."""

TERMS = ("return", "turns", "tool_calls", "success")
"""What each trajectory reports, logged as ``reward/<name>`` means: its return, its replies,
its tool calls, and whether the environment said ``info["success"]``."""


@dataclass(slots=True)
class Episodes:
    """A task's environment, ready to play: the factory, its arguments and the limits.

    Stands where a row task's :class:`~pbt.algorithms.data.rewards.Reward` stands (``Task.reward``):
    the learner plays episodes where it would sample and score completions.
    """

    name: str
    """How errors name the environment: its class (and file)."""
    factory: Callable[..., Any]
    kwargs: dict[str, Any]
    max_turns: int | None
    """``task.env.max_turns``; None: the environment's own."""
    max_episode_tokens: int
    use_tools: bool
    timeout_s: float
    names: tuple[str, ...] = TERMS

    def guard(self) -> Guard:
        """A fresh guard for this environment's calls."""
        return Guard(self.name, self.timeout_s)

    def make(self, guard: Guard) -> Any:
        """One environment, constructed within the timeout."""
        return guard.call(lambda: self.factory(**self.kwargs), (), "construction", 0, "")


@dataclass(slots=True)
class _Game:
    """One episode in play: its environment, trajectory, opening turns and tools."""

    env: Any
    trajectory: Trajectory
    opening: list[dict[str, str]]
    tools: dict[str, Callable[..., Any]]
    tool_schemas: list[dict[str, Any]] | None
    max_turns: int


def play(
    learner,
    episodes: Episodes,
    seeds: Sequence[int],
    *,
    repeats: int = 1,
    greedy: bool = False,
    temperature: float | None = None,
    sampler: Sampler | None = None,
) -> list[Trajectory]:
    """Play ``repeats`` episodes from each seed with ``learner``'s model (rows grouped by seed).

    ``sampler(contexts, max_new)`` replaces the rollout engine (token ids in, token ids out)
    where a caller needs to fix what is sampled; None samples through the learner's engine
    (:func:`sampler_for`).
    """
    set_mode(learner.model, False)  # sampling: no dropout
    template = TurnTemplate(learner.tokenizer)
    guard = episodes.guard()
    games = [_start(episodes, guard, template, s) for s in seeds for _ in range(repeats)]
    sample = sampler or sampler_for(learner, greedy, temperature)
    engine = learner.engine
    synced = is_sharded(learner.model) or (engine is not None and engine.spans_ranks)
    eos = template.eos_id
    while True:
        live = [g for g in games if not g.trajectory.done]
        room = [_room(g, episodes, learner.rollout_cfg.max_output_tokens) for g in live]
        wanted = max(room, default=0)
        if synced:
            wanted = int(all_reduce([float(wanted)], "max")[0])
        if wanted == 0:
            break
        contexts = [g.trajectory.context for g in live] or [games[0].trajectory.context]
        replies, logprobs = _replies(sample(contexts, wanted), len(contexts))
        for game, reply, logp, limit in zip(live, replies, logprobs, room, strict=False):
            ids = _through_eos(reply, eos)[:limit]
            game.trajectory.add_reply(ids, eos, None if logp is None else logp[: len(ids)])
            _answer(game, guard, template, episodes, ids)
    return [g.trajectory for g in games]


def _replies(out, n: int) -> tuple[list[list[int]], list[list[float] | None]]:
    """A sampler's answer as (ids, log-probs or None) per context."""
    if isinstance(out, tuple):
        replies, logprobs = out
        return replies, logprobs if logprobs is not None else [None] * n
    return out, [None] * n


def _start(episodes: Episodes, guard: Guard, template: TurnTemplate, seed: int) -> _Game:
    env = episodes.make(guard)
    observation, info = guard.reset(env, seed)
    tools = list(getattr(env, "tools", None) or []) if episodes.use_tools else []
    opening: list[dict[str, str]] = []
    system = getattr(env, "system_prompt", None) if tools else None
    tool_schemas = schemas(tools) if tools and renders_tools(template.tokenizer) else None
    if tools and tool_schemas is None:
        system = "\n\n".join(s for s in (system, tools_system_prompt(tools)) if s)
    if system:
        opening.append({"role": "system", "content": system})
    if tools:
        opening += [dict(turn) for turn in getattr(env, "demonstration", None) or ()]
    opening.append({"role": "user", "content": observation})
    max_turns = episodes.max_turns or env_max_turns(env, guard)
    prompt = template.prompt_ids(opening, tool_schemas)
    trajectory = Trajectory(seed=seed, prompt=prompt, info=info)
    named = {tool.__name__: tool for tool in tools}
    return _Game(env, trajectory, opening, named, tool_schemas, max_turns)


def env_max_turns(env: Any, guard: Guard) -> int:
    """The environment's ``max_turns``, checked: a whole number of at least 1."""
    value = getattr(env, "max_turns", None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise guard.error(
            "max_turns", 0, "", f"is {value!r}",
            "give the environment a max_turns attribute of at least 1, or set task.env.max_turns",
        )  # fmt: skip
    return value


def _room(game: _Game, episodes: Episodes, per_turn: int) -> int:
    """Tokens the next reply may sample: one is kept back for the EOS a cut reply gets."""
    left = episodes.max_episode_tokens - len(game.trajectory.ids) - 1
    return max(min(per_turn, left), 0)


def _through_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _answer(game: _Game, guard: Guard, template: TurnTemplate, episodes: Episodes, ids) -> None:
    """Run the reply (a tool call, or a step of the environment) and append what comes back,
    or end the episode."""
    trajectory = game.trajectory
    reply = template.tokenizer.decode(ids, skip_special_tokens=True)  # the action, never re-encoded
    call = parse_call(reply, list(game.tools)) if game.tools else None
    if call is not None:
        message = {"role": "tool", "content": _run_tool(game, guard, call, trajectory.turns, reply)}
        trajectory.rewards.append(0.0)
        trajectory.tool_calls += 1
    else:
        step = guard.step(game.env, reply, trajectory.turns)
        trajectory.rewards.append(step.reward)
        trajectory.success = trajectory.success or bool(step.info.get("success", False))
        if step.terminated or step.truncated:
            trajectory.done, trajectory.truncated = True, step.truncated
            return
        message = {"role": "user", "content": step.observation}
    if trajectory.turns >= game.max_turns:
        trajectory.done = trajectory.truncated = True
        return
    observation = template.observation_ids(game.opening, message, game.tool_schemas)
    # room must remain for one sampled token and a closing EOS after the observation
    if len(trajectory.ids) + len(observation) + 2 > episodes.max_episode_tokens:
        trajectory.done = trajectory.truncated = True
        return
    trajectory.add_observation(observation)


def _run_tool(game: _Game, guard: Guard, call, turn: int, reply: str) -> str:
    """The tool's result as text; arguments that do not fit its signature are the model's
    mistake, answered as an error message, not a failure."""
    tool = game.tools[call.name]
    try:
        inspect.signature(tool).bind(**call.arguments)
    except TypeError as err:
        return f"error: {err}"
    value = guard.call(lambda: tool(**call.arguments), (), f"tool {call.name}()", turn, reply)
    return tool_result(value)


def sampler_for(learner, greedy: bool = False, temperature: float | None = None) -> Sampler:
    """The learner's rollout engine as a :data:`Sampler`: its vLLM engine (token ids in and
    out, with the sampler's log-probs) when it has one, else ``generate`` or the static-cache
    decoder over its model."""
    engine = learner.engine
    if engine is None:
        return _model_sampler(learner, greedy, temperature)

    def sample(contexts: list[list[int]], max_new: int):
        return engine.continue_ids(
            learner, contexts, max_new, greedy=greedy, temperature=temperature
        )

    return sample


def _model_sampler(learner, greedy: bool, temperature: float | None) -> Sampler:
    tokenizer, model = learner.tokenizer, learner.model
    device = next(model.parameters()).device
    synced = is_sharded(model)

    def sample(contexts: list[list[int]], max_new: int) -> list[list[int]]:
        ids, mask = _left_pad(contexts, tokenizer.pad_token_id, device)
        cfg = dataclasses.replace(
            learner.rollout_cfg, max_output_tokens=max_new, min_output_tokens=0
        )
        out = sample_ids(
            model, tokenizer, ids, mask, cfg, greedy=greedy, temperature=temperature, synced=synced
        )
        return out.tolist()

    return sample


def _left_pad(rows: list[list[int]], pad: int, device) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def to_batch(trajectories: Sequence[Trajectory], tokenizer, device) -> RolloutBatch:
    """The trajectories as one batch: prompts left-padded, the rest right-padded; the loss
    mask covers sampled tokens, the attention mask every real token; the sampler's log-probs
    (0 on appended tokens, which the loss mask drops) when every trajectory has them."""
    pad = tokenizer.pad_token_id
    prompt_ids, prompt_mask = _left_pad([t.prompt for t in trajectories], pad, device)
    length = max(max((len(t.ids) for t in trajectories), default=1), 1)
    n = len(trajectories)
    ids = torch.full((n, length), pad, dtype=torch.long)
    loss = torch.zeros((n, length))
    attention = torch.zeros((n, length))
    reported = bool(trajectories) and all(t.logprobs is not None for t in trajectories)
    logprobs = torch.zeros((n, length)) if reported else None
    for i, t in enumerate(trajectories):
        ids[i, : len(t.ids)] = torch.tensor(t.ids, dtype=torch.long)
        loss[i, : len(t.ids)] = torch.tensor(t.sampled, dtype=torch.float)
        attention[i, : len(t.ids)] = 1.0
        if logprobs is not None:
            logprobs[i, : len(t.ids)] = torch.tensor(t.logprobs, dtype=torch.float)
    texts = tokenizer.batch_decode([t.ids for t in trajectories], skip_special_tokens=True)
    return RolloutBatch(
        prompt_ids, prompt_mask, ids.to(device), loss.to(device), texts,
        logprobs=None if logprobs is None else logprobs.to(device),
        attention=attention.to(device),
    )  # fmt: skip


def terms(trajectories: Sequence[Trajectory]) -> Tensor:
    """``[N, 4]`` each trajectory's :data:`TERMS`."""
    return torch.tensor(
        [[t.episode_return, t.turns, t.tool_calls, float(t.success)] for t in trajectories],
        dtype=torch.float,
    )


def play_batch(learner, examples: Sequence[Example], episodes: Episodes):
    """A training step's rollout: ``group_size`` episodes from each example's seed, as
    ``(batch, returns [N], terms [N, 4])``."""
    seeds = [int(ex.question) for ex in examples]
    played = play(learner, episodes, seeds, repeats=learner.algorithm.group_size)
    values = terms(played)
    return to_batch(played, learner.tokenizer, learner.device), values[:, 0].clone(), values


def evaluate_episodes(
    learner, examples: Sequence[Example], episodes: Episodes, temperature: float, batch_size: int
) -> float:
    """The mean return of one episode per held-out seed (greedy when ``temperature`` is 0),
    split across ranks as the row evaluation is."""
    return episode_figures(learner, examples, episodes, temperature, batch_size)["return"]


def episode_figures(
    learner, examples: Sequence[Example], episodes: Episodes, temperature: float = 0.0,
    batch_size: int = 64,
) -> dict[str, float]:  # fmt: skip
    """Held-out means over every rank of :data:`TERMS`, and ``success_turns``: the mean
    replies of the episodes that succeeded (0 when none did)."""
    set_mode(learner.model, False)
    mine = list(examples)[learner.rank :: learner.world_size]
    calls = math.ceil(math.ceil(len(examples) / learner.world_size) / batch_size)
    sums = torch.zeros(len(TERMS) + 2)
    for call in range(calls):
        chunk = mine[call * batch_size : (call + 1) * batch_size]
        seeds = [int(ex.question) for ex in (chunk or list(examples)[:1])]
        played = play(
            learner, episodes, seeds, greedy=temperature == 0, temperature=temperature or None
        )
        if chunk:
            values = terms(played)
            won = values[:, 3] > 0
            extra = torch.tensor([float((values[:, 1] * won).sum()), float(len(values))])
            sums += torch.cat([values.sum(dim=0), extra])
    totals = all_reduce(sums.tolist())
    count = max(totals[-1], 1.0)
    figures = {name: totals[i] / count for i, name in enumerate(TERMS)}
    figures["success_turns"] = totals[4] / max(totals[3], 1.0)
    return figures
