"""Run by tests/integration/test_vllm_multiturn.py in its own process: multi-turn episodes
through the vLLM engine against the same episodes through Hugging Face ``generate``.

One member on the tiny model with ``rollout.engine: vllm`` and the guess-the-number game (its
adapter set to random values, so replies vary). Writes what it saw to OUT as JSON:

- greedy episodes from vLLM and from ``generate`` on the same seeds: ids, loss masks, turns;
- sampled episodes from vLLM: whether each trajectory's sampled tokens are exactly the ids the
  engine returned, turn by turn; the engine's log-probs of them against the trainer's;
- each turn's prompt tokens and how many of them the engine found in its prefix cache;
- after the adapter changes and is reloaded in place, the same seeds' episodes again: their
  log-probs against the trainer's (the prefix cache must not serve the old adapter's blocks).

    vllm_multiturn_driver.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import small_sections

from pbt.algorithms.envs.episodes import play, sampler_for, to_batch
from pbt.algorithms.rollout.hf import sequence_logprobs
from pbt.algorithms.runtime.member import Member
from pbt.config.read.loader import manifest_from_dict

CPU = torch.device("cpu")
TEMPERATURE = 1.0


def recording(learner, greedy: bool):
    """The learner's engine as a sampler that also keeps every reply it returned, and each
    call's prompt tokens and prefix-cache hits."""
    inner, seen, cache = sampler_for(learner, greedy, None if greedy else TEMPERATURE), [], []
    engine = learner.engine

    def sample(contexts, max_new):
        before = (engine.prompt_tokens, engine.cached_tokens)
        replies, logprobs = inner(contexts, max_new)
        seen.append([list(r) for r in replies])
        cache.append((engine.prompt_tokens - before[0], engine.cached_tokens - before[1]))
        return replies, logprobs

    return sample, seen, cache


def layout(trajectories) -> dict:
    return {
        "ids": [t.ids for t in trajectories],
        "sampled": [t.sampled for t in trajectories],
        "turns": [t.turns for t in trajectories],
        "rewards": [t.rewards for t in trajectories],
    }


def sampled_runs(t) -> list[list[int]]:
    """The trajectory's maximal runs of sampled tokens: one per reply."""
    runs, run = [], []
    for token, sampled in zip(t.ids, t.sampled, strict=True):
        if sampled:
            run.append(token)
        elif run:
            runs, run = [*runs, run], []
    return runs + ([run] if run else [])


def kept_as_sampled(trajectories, seen, eos: int) -> bool:
    """Turn ``k``'s sampling call served the episodes with more than ``k`` turns, in order;
    each one's ``k``-th sampled run is that call's reply (through EOS; shorter only where the
    token budget cut it), never re-tokenized."""
    runs = [sampled_runs(t) for t in trajectories]
    if any(len(r) != t.turns for r, t in zip(runs, trajectories, strict=True)):
        return False
    for k, call in enumerate(seen):
        live = [i for i, t in enumerate(trajectories) if t.turns > k]
        for i, reply in zip(live, call, strict=False):
            reply = reply[: reply.index(eos) + 1] if eos in reply else reply
            if not runs[i][k] or reply[: len(runs[i][k])] != runs[i][k]:
                return False
    return True


def randomize(learner, seed: int) -> None:
    """Random adapter values (so replies vary), marked for the engine to reload."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.named_params:
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "lora_B" in name else 0.2))
    learner.adapter_stale = True


def logprob_gap(learner, trajectories) -> tuple[int, float]:
    """Sampled tokens, and the largest gap between the trainer's and the engine's log-probs."""
    batch = to_batch(trajectories, learner.tokenizer, CPU)
    with torch.no_grad():
        trainer = sequence_logprobs(learner.model, batch, TEMPERATURE)
    mask = batch.completion_mask.bool()
    return int(mask.sum()), float((trainer - batch.logprobs)[mask].abs().max())


def main() -> None:
    out = Path(sys.argv[1])
    sections = small_sections(
        out.parent,
        task={"env": {"class": "builtin:guess_number", "max_turns": 3}, "name": None},
        # blocks of 32 tokens (CPU's default is 128): the tiny episodes fill whole blocks,
        # which is what the prefix cache reuses
        rollout={
            "engine": "vllm",
            "max_output_tokens": 8,
            "vllm": {"engine_kwargs": {"block_size": 32}},
        },
        algorithm={"group_size": 4, "prompts_per_step": 2},
    )
    member = Member(manifest_from_dict(sections, base_dir=out.parent), CPU)
    learner, episodes = member.learner, member.task.reward
    engine = learner.engine
    randomize(learner, seed=0)
    seeds = [int(ex.question) for ex in member.task.eval[:4]]
    eos = learner.tokenizer.eos_token_id
    report: dict = {}

    sample, seen, _ = recording(learner, greedy=True)
    greedy = play(learner, episodes, seeds, greedy=True, sampler=sample)
    report["vllm_greedy"] = layout(greedy)
    report["greedy_kept"] = kept_as_sampled(greedy, seen, eos)
    learner.engine = None  # the same member through generate
    report["hf_greedy"] = layout(play(learner, episodes, seeds, greedy=True))
    learner.engine = engine

    engine.llm.reset_prefix_cache()  # the first turn then finds nothing: the greedy run's
    sample, seen, cache = recording(learner, greedy=False)
    played = play(learner, episodes, seeds[:2], repeats=4, sampler=sample)
    report["sampled_kept"] = kept_as_sampled(played, seen, eos)
    report["sampled_turns"] = [t.turns for t in played]
    report["cache_per_call"] = cache  # (prompt tokens, of which found in the prefix cache)
    report["logprob_tokens"], report["logprob_max_gap"] = logprob_gap(learner, played)

    # the adapter changes (as an optimizer step changes it) and is reloaded in place: the same
    # seeds' episodes must be sampled with the new weights, not from blocks the prefix cache
    # kept from the old ones
    randomize(learner, seed=1)
    played = play(learner, episodes, seeds[:2], repeats=4, temperature=TEMPERATURE)
    report["reloaded_tokens"], report["reloaded_max_gap"] = logprob_gap(learner, played)

    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
