"""Rollouts through a static KV cache, each decode step replayed as one CUDA graph.

``rollout.engine: static`` samples with transformers' own model forward and ``StaticCache``,
and PyTorch's CUDA graphs; it is not an inference engine of its own. What makes it fast is
what Hugging Face ``generate`` spends its time on at large batch: launching a few thousand
small kernels from Python for every token. Here:

- the prompt is prefilled eagerly, in one forward, into a preallocated cache;
- a decode step (forward of one token per row, temperature / top-k / top-p / min-length
  processing, sampling, the end-of-sequence bookkeeping, the counters' increments) is
  captured once per batch shape as a CUDA graph and replayed for every token: one launch;
- sampling happens on the device (exponential race, i.e. Gumbel-max), drawing from torch's
  global CUDA generator, which the trainer seeds and checkpoints;
- the host looks at the device only every :data:`CHECK_EVERY` tokens, to stop once every row
  has ended.

Cache lengths are rounded up to :data:`LENGTH_BUCKET` tokens, so prompts of different widths
reuse one graph. Graphs hold the addresses of the model's parameters: adapters are loaded,
stepped and swapped in place everywhere in this package, so a graph stays valid for the life
of the model. On CPU (or with ``rollout.cuda_graphs: false``) the same step runs eagerly,
which is what the greedy-equality tests against ``generate`` exercise on any machine.

The attention mask is passed as a prepared 4D boolean mask: position ids come from the prompt
mask exactly as :func:`~pbt.algorithms.rollout.hf.sequence_logprobs` computes them, so the trainer
scores the tokens the sampler saw. A sharded (FSDP2) model cannot be captured; the manifest
refuses the engine there.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch import Tensor

CHECK_EVERY = 16
"""Decode steps between the host's checks that every row has ended."""
LENGTH_BUCKET = 64
"""Cache lengths are rounded up to a multiple of this."""
KEPT_SHAPES = 4
"""Batch shapes whose cache and graph a decoder keeps; the least recently used goes first."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the next token is picked: greedy, or sampled after temperature, top-k and top-p."""

    greedy: bool
    top_k: int = 0
    top_p: float = 1.0


def pick_tokens(
    logits: Tensor,
    sampling: Sampling,
    temperature: Tensor,
    eos_id: int,
    suppress_eos: Tensor,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``[B]`` next tokens from ``[B, V]`` logits, in the order Hugging Face applies its
    processors: end-of-sequence suppressed while ``suppress_eos``, then temperature, top-k,
    top-p. Sampling is an exponential race (``argmax p / E``, ``E ~ Exp(1)``), which draws each
    token with probability ``p`` and needs no host synchronisation; the draws come from
    ``generator`` (torch's global one when None)."""
    logits = logits.float()
    eos = logits[:, eos_id]
    logits[:, eos_id] = torch.where(suppress_eos, torch.full_like(eos, -torch.inf), eos)
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if sampling.top_p < 1.0:
        ordered, index = torch.sort(logits, dim=-1)  # ascending, as HF's top-p warper
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(1, index, drop), -torch.inf)
    probs = logits.softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(dim=-1)


ATTENTION = "pbt_grouped_decode"
"""The name :func:`grouped_decode_attention` is registered under with transformers'
``AttentionInterface`` while the decoder runs."""


def grouped_decode_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA for one query token per row without repeating the cache's key/value heads.

    With a mask, transformers' SDPA path copies every key and value head group-size times
    before attending (``repeat_kv``): at a 256-row batch that copy, not the attention, is the
    decode step's largest memory traffic. One query token per row lets the query heads that
    share a key/value head stand in the query-length axis instead: ``[B, kv, group, d]``
    attends ``[B, kv, L, d]`` with the ``[B, 1, 1, L]`` mask broadcast, the same arithmetic.
    Any other shape goes to transformers' own SDPA attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if length != 1 or heads == kv_heads or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    grouped = query.view(rows, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling")
    )
    return out.reshape(rows, heads, 1, dim).transpose(1, 2), None


class _State:
    """The static buffers of one batch shape: the cache, the decode step's inputs and
    counters, and the tokens it writes. A captured graph reads and writes exactly these."""

    def __init__(self, model, batch: int, length: int, max_new: int, device: torch.device):
        from transformers import StaticCache

        self.length, self.max_new = length, max_new
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        long = {"dtype": torch.long, "device": device}
        self.token = torch.zeros((batch, 1), **long)
        self.position = torch.zeros((batch, 1), **long)
        self.cache_position = torch.zeros(1, **long)
        self.step = torch.zeros(1, **long)
        self.min_new = torch.zeros(1, **long)
        self.temperature = torch.ones(1, dtype=torch.float32, device=device)
        self.attend = torch.ones((batch, length), dtype=torch.bool, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.out = torch.zeros((batch, max_new), **long)
        self.columns = torch.arange(length, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None


class StaticDecoder:
    """Samples completions for ``model`` (a causal LM, peft-wrapped or not) through a static
    cache; one per model, kept by :func:`decoder_for`."""

    def __init__(
        self, model, *, pad_id: int, eos_id: int, cuda_graphs: bool = True, compile: bool = False
    ):
        self.model = model
        self.pad_id, self.eos_id = pad_id, eos_id
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._takes_cache_position = (
            "cache_position"
            in inspect.signature(
                base.model.forward if hasattr(base, "model") else base.forward
            ).parameters
        )
        self.device = next(model.parameters()).device
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.config = base.config
        self.compile = compile
        self._step = (
            torch.compile(self._decode_step, dynamic=False) if compile else self._decode_step
        )
        self._states: dict[tuple, _State] = {}
        self.captures = 0
        """Graphs captured so far (one per batch shape and sampling mode)."""

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        sampling: Sampling,
        temperature: float = 1.0,
        autocast_dtype: torch.dtype | None = None,
    ) -> Tensor:
        """``[B, T]`` completion ids (``T <= max_new_tokens``), every token after a row's
        first end-of-sequence token set to padding."""
        batch, width = prompt_ids.shape
        length = -(-(width + max_new_tokens) // LENGTH_BUCKET) * LENGTH_BUCKET
        key = (batch, length, max_new_tokens, sampling, autocast_dtype)
        state = self._states.pop(key, None)
        with self._context(autocast_dtype):
            if state is None:
                while len(self._states) >= KEPT_SHAPES:  # free the oldest cache and graph
                    self._states.pop(next(iter(self._states)))
                state = _State(self.model, batch, length, max_new_tokens, self.device)
                if self.cuda_graphs:
                    self._capture(state, sampling)
            self._states[key] = state  # the most recently used, last
            state.cache.reset()
            self._prefill(state, prompt_ids, prompt_mask, sampling, temperature, min_new_tokens)
            steps = 1
            while steps < max_new_tokens:
                if steps % CHECK_EVERY == 0 and bool(state.done.all()):
                    break
                if state.graph is not None:
                    state.graph.replay()
                else:
                    self._step(state, sampling)
                steps += 1
        return state.out[:, :steps].clone()

    def _context(self, autocast_dtype: torch.dtype | None) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if not self.compile:  # a decoder compiled for training (training.compile) runs eagerly
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        stack.enter_context(_attention(self.config))
        if autocast_dtype is not None:
            stack.enter_context(
                torch.autocast(self.device.type, dtype=autocast_dtype, cache_enabled=False)
            )
        return stack

    def _forward(self, state: _State, ids: Tensor, mask: Tensor, positions: Tensor, start: Tensor):
        kwargs = {}
        if self._takes_cache_position:
            kwargs["cache_position"] = start + torch.arange(ids.shape[1], device=ids.device)
        return self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=state.cache,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        ).logits[:, -1]

    def _prefill(self, state, prompt_ids, prompt_mask, sampling, temperature, min_new) -> None:
        batch, width = prompt_ids.shape
        real = prompt_mask.bool()
        state.attend.fill_(True)
        state.attend[:, :width] = real
        rows = torch.arange(width, device=self.device)
        causal = rows[None, :] <= rows[:, None]  # [P, L<=P]
        mask = torch.zeros((batch, 1, width, state.length), dtype=torch.bool, device=self.device)
        mask[:, 0, :, :width] = causal[None] & real[:, None, :]
        # a padding row attends to itself, so no row is empty (an empty row is NaN in SDPA)
        mask[:, 0, :, :width] |= torch.eye(width, dtype=torch.bool, device=self.device)[None]
        positions = (prompt_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        start = torch.zeros(1, dtype=torch.long, device=self.device)
        logits = self._forward(state, prompt_ids, mask, positions, start)
        state.temperature.fill_(temperature)
        state.min_new.fill_(min_new)
        token = pick_tokens(logits, sampling, state.temperature, self.eos_id, state.min_new > 0)
        state.out.fill_(self.pad_id)
        state.out[:, 0] = token
        state.done.copy_(token == self.eos_id)
        state.token.copy_(token[:, None])
        state.position.copy_(prompt_mask.long().sum(dim=1, keepdim=True))
        state.cache_position.fill_(width)
        state.step.fill_(1)

    def _decode_step(self, state: _State, sampling: Sampling) -> None:
        """One token for every row; everything it changes is one of ``state``'s buffers."""
        mask = state.attend & (state.columns <= state.cache_position)
        logits = self._forward(
            state, state.token, mask[:, None, None, :], state.position, state.cache_position
        )
        token = pick_tokens(
            logits, sampling, state.temperature, self.eos_id, state.step < state.min_new
        )
        token = torch.where(state.done, torch.full_like(token, self.pad_id), token)
        state.out.index_copy_(1, state.step.clamp(max=state.max_new - 1), token[:, None])
        state.done.logical_or_(token == self.eos_id)
        state.token.copy_(token[:, None])
        state.position.add_(1)
        state.cache_position.add_(1)
        state.step.add_(1)

    def _capture(self, state: _State, sampling: Sampling) -> None:
        """Warm the step up on a side stream, capture it, then clear what the warm-up wrote.

        The warm-up's draws are taken back (the CUDA generator is restored), so a rollout that
        captures a graph samples the same tokens as one that replays a graph captured earlier:
        a member gives the same result on a fresh worker and on a long-lived one."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.random.fork_rng(devices=[self.device]), torch.cuda.stream(stream):
            for _ in range(3):
                self._step(state, sampling)
        torch.cuda.current_stream().wait_stream(stream)
        state.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(state.graph):
            self._step(state, sampling)
        self.captures += 1


@contextlib.contextmanager
def _attention(config):
    """The model's attention set to :func:`grouped_decode_attention` for the decoder's passes."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, grouped_decode_attention)
    before = config._attn_implementation
    if before != "sdpa":  # eager, flash or a custom kernel: the model's own choice stands
        yield
        return
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def decoder_for(
    model, *, pad_id: int, eos_id: int, cuda_graphs: bool, compile: bool = False
) -> StaticDecoder:
    """The model's :class:`StaticDecoder`, made on first use and kept on the model."""
    decoder = getattr(model, "pbt_static_decoder", None)
    graphs = cuda_graphs and next(model.parameters()).device.type == "cuda"
    if decoder is None or (decoder.cuda_graphs, decoder.compile) != (graphs, compile):
        decoder = StaticDecoder(
            model, pad_id=pad_id, eos_id=eos_id, cuda_graphs=cuda_graphs, compile=compile
        )
        model.pbt_static_decoder = decoder
    return decoder
