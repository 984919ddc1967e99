"""Token-in/token-out trajectories: what the model sampled, kept as sampled.

A trajectory is one token sequence: the first prompt (the chat template over the system turn,
the tools and the first observation, tokenized once), then each turn's sampled ids exactly as
the sampler returned them, then each observation's ids. An observation is tokenized once, on
its own, within the chat template's turn boundaries (:class:`TurnTemplate`): the text the
template writes after an assistant turn's end-of-turn token, for that one message, through the
next generation prompt. The conversation is never decoded and re-encoded, so the trainer scores
exactly the tokens the model produced (BPE is not a bijection: decoding ``["hel", "lo"]`` and
encoding again may give ``["hello"]``).

Only sampled tokens are trained on (``sampled`` is the loss mask); observation and tool-result
tokens, and an end-of-turn token the trainer had to add, are attended to but masked out.

Truncation rule: the budget is ``task.env.max_episode_tokens``, counted from the end of the
first prompt (sampled, observation and added tokens together), and no trajectory exceeds it. A
turn samples at most ``min(rollout.max_output_tokens, budget left - 1)`` tokens; a reply cut off
before its end-of-turn token gets that token appended (masked), in the one token kept back. An
observation that would not leave room for one sampled token and that EOS ends the episode as
truncated: its reward counts, its tokens are not appended. An episode that reaches
``max_turns`` replies ends truncated too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pbt.config.errors import ConfigError

PROBE_REPLY = "x"
"""An assistant turn's stand-in content when the template is asked what follows one."""


class TurnTemplate:
    """The chat template's turn boundaries, for token ids appended one message at a time.

    Args:
        tokenizer: the model's tokenizer, with a chat template and an EOS token that ends an
            assistant turn.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token

    def prompt_ids(self, messages: list[dict[str, str]], tools: list | None = None) -> list[int]:
        """The first prompt, through the generation prompt, tokenized once."""
        text = self._render(messages, tools, generation=True)
        return self._encode(text)

    def observation_ids(
        self, messages: list[dict[str, str]], observation: dict[str, str], tools: list | None
    ) -> list[int]:
        """The ids that follow an assistant turn's end-of-turn token for ``observation`` (a
        ``user`` or ``tool`` message): the template's text between that token and the next
        generation prompt's end. ``messages`` are the conversation's opening turns (their
        content does not change the boundary text of templates that are stateless)."""
        before = [*messages, {"role": "assistant", "content": PROBE_REPLY}]
        closed = self._render(before, tools, generation=False)
        after = self._render([*before, observation], tools, generation=True)
        start = closed.rfind(PROBE_REPLY)
        end = closed.find(self.eos_text, start + len(PROBE_REPLY)) if start >= 0 else -1
        if end < 0 or after[: end + len(self.eos_text)] != closed[: end + len(self.eos_text)]:
            raise ConfigError(
                [
                    f"the chat template does not end an assistant turn with the EOS token "
                    f"{self.eos_text!r}, or rewrites earlier turns when one is added; a "
                    "multi-turn environment needs a template whose turns append; set "
                    "model.name to a chat model with such a template"
                ]
            )
        return self._encode(after[end + len(self.eos_text) :])

    def _render(self, messages, tools, generation: bool) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation, **kwargs
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(slots=True)
class Trajectory:
    """One episode as tokens, rewards and counts.

    ``ids`` follow ``prompt``; ``sampled[i]`` says whether ``ids[i]`` was sampled by the model
    (trained on) or appended by the trainer (an observation, a tool result, a closing EOS).
    """

    seed: int
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    """Each step's reward (tool turns give 0)."""
    turns: int = 0
    tool_calls: int = 0
    done: bool = False
    truncated: bool = False
    success: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    logprobs: list[float] | None = None
    """The sampler's log-prob of each of ``ids`` where it reports them (vLLM; 0.0 on appended
    tokens); None otherwise. Set by the first reply."""

    @property
    def context(self) -> list[int]:
        """Every token so far: what the next turn is sampled from."""
        return self.prompt + self.ids

    @property
    def episode_return(self) -> float:
        """The sum of the per-turn rewards (the final one included)."""
        return float(sum(self.rewards))

    def add_reply(self, ids: list[int], eos_id: int, logprobs: list[float] | None = None) -> None:
        """A turn's sampled ids, as sampled (with the sampler's log-prob of each, if it gave
        them); an EOS appended (masked) if the reply was cut."""
        if logprobs is not None and self.logprobs is None and not self.ids:
            self.logprobs = []
        if self.logprobs is not None:
            self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.ids += ids
        self.sampled += [True] * len(ids)
        if not ids or ids[-1] != eos_id:
            self._append([eos_id])
        self.turns += 1

    def _append(self, ids: list[int]) -> None:
        self.ids += ids
        self.sampled += [False] * len(ids)
        if self.logprobs is not None:
            self.logprobs += [0.0] * len(ids)

    def add_observation(self, ids: list[int]) -> None:
        """An observation's ids (masked out of the loss)."""
        self._append(ids)
