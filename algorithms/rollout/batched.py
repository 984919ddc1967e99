"""Several members' rollouts in one batch on one shared base model.

Every member's prompts go into one left-padded batch, its rows contiguous (a segment); each
row runs through its own member's LoRA adapter (:mod:`pbt.algorithms.runtime.lora_batch`) and is
sampled with its own member's temperature, top-k and top-p, drawing from its own member's
random stream (a ``torch.Generator`` per member). A member's completions equal what it samples
alone through the same engine from the same stream state (token for token in float32 on the
CPU, where the logits differ at most by a BLAS's rounding of a larger batch, about 1e-6; bf16
on a GPU flips near-ties), and its stream ends where its solo rollout would leave it:

- ``static``: the decoder of :mod:`pbt.algorithms.rollout.static` with the sampling done one
  segment at a time (a loop over members with bounds fixed per layout, so the decode step is
  still one CUDA graph; the member generators are registered with it). The batch decodes
  until every member is done; a member alone stops at the first check after its own rows
  ended, so its completions are cut there and its stream is wound forward by exactly the
  draws its solo rollout makes.
- ``hf``: Hugging Face ``generate`` in greedy mode with one logits processor that samples each
  segment as ``generate`` would sample that member alone (its warpers, then ``multinomial``
  from the member's generator) and stops drawing for a member once its rows have ended, as its
  solo ``generate`` would have stopped.

The engines share the caller's batch layout: a graph is captured per layout (members' row
counts and sampling modes), as per batch shape in the solo decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pbt.algorithms.data.examples import Chat
from pbt.algorithms.rollout.hf import RolloutBatch, _batch, chat_prompts
from pbt.algorithms.rollout.static import (
    CHECK_EVERY,
    KEPT_SHAPES,
    LENGTH_BUCKET,
    Sampling,
    StaticDecoder,
    _State,
    pick_tokens,
)
from pbt.algorithms.runtime.lora_batch import RowAdapters, Segment, segments_of
from pbt.config import RolloutConfig


@dataclass(slots=True)
class MemberRollout:
    """What one member asks of a batched rollout."""

    slot: int
    """The member's slot in the :class:`~pbt.algorithms.runtime.lora_batch.RowAdapters`."""
    questions: Sequence[Chat]
    repeats: int
    """Completions per question (rows grouped by question)."""
    generator: torch.Generator
    """The member's random stream; advanced as the member's solo rollout would advance it."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False

    @property
    def sampling(self) -> Sampling:
        """The static decoder's sampling mode for this member."""
        sampled = not self.greedy and self.temperature > 0
        return Sampling(not sampled, self.top_k, self.top_p)


@torch.no_grad()
def generate_batched(
    model,
    tokenizer,
    adapters: RowAdapters,
    members: Sequence[MemberRollout],
    cfg: RolloutConfig,
    *,
    kernel: str = "segmented",
) -> list[RolloutBatch]:
    """One rollout batch per member, all sampled in one batch (``cfg.engine``: ``static`` or
    ``hf``); the members' ``temperature``, ``top_k`` and ``top_p`` stand in for ``cfg``'s."""
    texts = [
        p for m in members for p in chat_prompts(tokenizer, m.questions) for _ in range(m.repeats)
    ]
    device = next(model.parameters()).device
    enc = tokenizer(
        texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
    )
    prompt_ids, prompt_mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    sizes = [len(m.questions) * m.repeats for m in members]
    segments = tuple(
        Segment(s.start, s.stop, members[i].slot)
        for i, s in enumerate(segments_of(sizes))
        if s.stop > s.start
    )
    if len(segments) != len(members):
        raise ValueError("every member of a batched rollout needs at least one question")
    kernel = adapters.kernel(segments, kernel)  # the decoder's graphs are kept by kernel
    with adapters.rows(segments, kernel):
        if cfg.engine == "static":
            decoder = batched_decoder_for(model, tokenizer, cfg)
            completions, lengths = decoder.generate_rows(
                prompt_ids,
                prompt_mask,
                segments,
                members,
                cfg,
                kernel=kernel,
                autocast_dtype=getattr(model, "pbt_autocast_dtype", None),
            )
        elif cfg.engine == "hf":
            completions, lengths = _hf_rows(
                model, tokenizer, prompt_ids, prompt_mask, segments, members, cfg
            )
        else:
            raise ValueError(f"batched rollouts run on the static or hf engine, not {cfg.engine!r}")
    out = []
    for s, length in zip(segments, lengths, strict=True):
        rows = slice(s.start, s.stop)
        ids, mask = _unpad_left(prompt_ids[rows], prompt_mask[rows])
        out.append(_batch(tokenizer, ids, mask, completions[rows, :length]))
    return out


def _hf_rows(model, tokenizer, prompt_ids, prompt_mask, segments, members, cfg):
    """``generate`` over the whole batch, greedy, with :class:`_RowSampler` doing the sampling."""
    from transformers import LogitsProcessorList

    sampler = _RowSampler(segments, members, prompt_ids.shape[1], tokenizer.eos_token_id)
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        max_new_tokens=cfg.max_output_tokens,
        min_new_tokens=cfg.min_output_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        logits_processor=LogitsProcessorList([sampler]),
    )
    completions = out[:, prompt_ids.shape[1] :]
    return completions, [sampler.lengths[i] for i in range(len(segments))]


class _RowSampler:
    """A logits processor that samples each member's rows as ``generate`` samples them alone
    (temperature, top-k, top-p warpers as ``generate`` adds them, then ``multinomial`` from
    the member's generator) and returns scores whose argmax is the sampled token. A member
    whose rows have all ended draws no more: its solo ``generate`` would have stopped."""

    def __init__(self, segments, members, width: int, eos_id: int) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.segments, self.members, self.width, self.eos_id = segments, members, width, eos_id
        self.warpers = []
        for m in members:
            warpers = []
            if not m.sampling.greedy:
                if m.temperature != 1.0:
                    warpers.append(TemperatureLogitsWarper(m.temperature))
                if m.top_k:
                    warpers.append(TopKLogitsWarper(m.top_k))
                if m.top_p < 1.0:
                    warpers.append(TopPLogitsWarper(m.top_p))
            self.warpers.append(warpers)
        self.lengths: dict[int, int] = {}

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        chosen = scores.argmax(dim=-1)
        generated = input_ids[:, self.width :]
        for i, (s, m) in enumerate(zip(self.segments, self.members, strict=True)):
            rows = slice(s.start, s.stop)
            if bool((generated[rows] == self.eos_id).any(dim=1).all()):
                self.lengths.setdefault(i, generated.shape[1])
                continue
            self.lengths[i] = generated.shape[1] + 1
            if m.sampling.greedy:
                continue
            part = scores[rows]
            for warper in self.warpers[i]:
                part = warper(input_ids[rows], part)
            probs = torch.nn.functional.softmax(part, dim=-1)
            chosen[rows] = torch.multinomial(probs, 1, generator=m.generator).squeeze(1)
        picked = torch.full_like(scores, -torch.inf)
        return picked.scatter_(1, chosen[:, None], 0.0)


def _unpad_left(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The prompt columns some row of this member uses: the width its solo batch has."""
    used = mask.any(dim=0)
    left = int(used.long().argmax()) if bool(used.any()) else 0
    return ids[:, left:], mask[:, left:]


class BatchedDecoder(StaticDecoder):
    """The static decoder over a batch of several members' segments: per-segment sampling
    settings and generators; one per model, kept by :func:`batched_decoder_for`."""

    def generate_rows(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        segments: tuple[Segment, ...],
        members: Sequence[MemberRollout],
        cfg: RolloutConfig,
        *,
        kernel: str,
        autocast_dtype: torch.dtype | None = None,
    ) -> tuple[Tensor, list[int]]:
        """``[B, T]`` completion ids and, per member, the length its solo rollout returns."""
        batch, width = prompt_ids.shape
        max_new = cfg.max_output_tokens
        length = -(-(width + max_new) // LENGTH_BUCKET) * LENGTH_BUCKET
        samplings = tuple(m.sampling for m in members)
        made = getattr(self.model, "pbt_row_adapters_made", 0)  # the stacked tensors' set
        key = (batch, length, max_new, segments, samplings, kernel, autocast_dtype, made)
        state = self._states.pop(key, None)
        start_states = [m.generator.get_state() for m in members]
        with self._context(autocast_dtype):
            if state is None:
                while len(self._states) >= KEPT_SHAPES:
                    self._states.pop(next(iter(self._states)))
                state = _RowState(self.model, batch, length, max_new, self.device, len(members))
                state.plan = _Plan(segments, samplings, state.generators)
                _set_states(state.generators, start_states)
                if self.cuda_graphs:
                    self._capture_rows(state, start_states)
            self._states[key] = state
            # the layout's own generators, which a captured graph draws from, take the
            # members' streams for the call and give them back after it
            _set_states(state.generators, start_states)
            state.cache.reset()
            for t, m in zip(state.temperatures, members, strict=True):
                t.fill_(m.temperature if not m.sampling.greedy else 1.0)
            self._prefill_rows(state, prompt_ids, prompt_mask, cfg.min_output_tokens)
            lengths = self._decode_rows(state, max_new)
        steps = max(lengths)
        for m, own, start, s, n in zip(
            members, state.generators, start_states, segments, lengths, strict=True
        ):
            if n < steps and not m.sampling.greedy:  # it drew ``steps`` times; alone, ``n``
                _wind(own, start, n, (s.stop - s.start, state.vocab), self.device)
            m.generator.set_state(own.get_state())
        return state.out[:, :steps].clone(), lengths

    def _decode_rows(self, state: _RowState, max_new: int) -> list[int]:
        lengths: list[int | None] = [None] * len(state.temperatures)
        steps = 1
        while steps < max_new:
            if steps % CHECK_EVERY == 0:
                done = torch.stack(
                    [state.done[s.start : s.stop].all() for s in state.plan.segments]
                )
                for i, flag in enumerate(done.tolist()):
                    if flag and lengths[i] is None:
                        lengths[i] = steps
                if all(n is not None for n in lengths):
                    break
            if state.graph is not None:
                state.graph.replay()
            else:
                self._row_step(state)
            steps += 1
        return [steps if n is None else n for n in lengths]

    def _pick(self, state: _RowState, logits: Tensor, suppress: Tensor) -> Tensor:
        parts = []
        plan = state.plan
        suppress = suppress.expand(logits.shape[0])
        for s, sampling, temp, g in zip(
            plan.segments, plan.samplings, state.temperatures, plan.generators, strict=True
        ):
            rows = slice(s.start, s.stop)
            parts.append(pick_tokens(logits[rows], sampling, temp, self.eos_id, suppress[rows], g))
        return torch.cat(parts)

    def _prefill_rows(self, state: _RowState, prompt_ids, prompt_mask, min_new: int) -> None:
        # the solo prefill with every row's sampling through _pick; a greedy Sampling makes
        # the solo prefill draw nothing, so the picks here are the only draws
        super()._prefill(state, prompt_ids, prompt_mask, Sampling(True), 1.0, min_new)
        state.vocab = state.logits.shape[-1]
        token = self._pick(state, state.logits, state.min_new > 0)
        state.out[:, 0] = token
        state.done.copy_(token == self.eos_id)
        state.token.copy_(token[:, None])

    def _forward(self, state, ids, mask, positions, start):
        state.logits = super()._forward(state, ids, mask, positions, start)
        return state.logits

    def _row_step(self, state: _RowState) -> None:
        """:meth:`StaticDecoder._decode_step` with each segment sampled by its member."""
        mask = state.attend & (state.columns <= state.cache_position)
        logits = self._forward(
            state, state.token, mask[:, None, None, :], state.position, state.cache_position
        )
        token = self._pick(state, logits, state.step < state.min_new)
        token = torch.where(state.done, torch.full_like(token, self.pad_id), token)
        state.out.index_copy_(1, state.step.clamp(max=state.max_new - 1), token[:, None])
        state.done.logical_or_(token == self.eos_id)
        state.token.copy_(token[:, None])
        state.position.add_(1)
        state.cache_position.add_(1)
        state.step.add_(1)

    def _capture_rows(self, state: _RowState, start_states: list[Tensor]) -> None:
        """:meth:`StaticDecoder._capture` for the row step, the member generators registered
        with the graph and put back where they were before the warm-up."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.random.fork_rng(devices=[self.device]), torch.cuda.stream(stream):
            for _ in range(3):
                self._row_step(state)
        torch.cuda.current_stream().wait_stream(stream)
        state.graph = torch.cuda.CUDAGraph()
        for g in state.generators:
            state.graph.register_generator_state(g)
        with torch.cuda.graph(state.graph):
            self._row_step(state)
        _set_states(state.generators, start_states)
        self.captures += 1


@dataclass(slots=True)
class _Plan:
    segments: tuple[Segment, ...]
    samplings: tuple[Sampling, ...]
    generators: list[torch.Generator]


class _RowState(_State):
    """The static buffers of one batch layout, with a temperature per member."""

    def __init__(self, model, batch, length, max_new, device, members: int) -> None:
        super().__init__(model, batch, length, max_new, device)
        self.temperatures = [
            torch.ones(1, dtype=torch.float32, device=device) for _ in range(members)
        ]
        self.generators = [torch.Generator(device=device) for _ in range(members)]
        """The layout's own generator per member: a captured graph draws from these."""
        self.plan: _Plan | None = None
        self.logits: Tensor | None = None
        self.vocab = 0


def _set_states(generators: list[torch.Generator], states: list[Tensor]) -> None:
    for g, state in zip(generators, states, strict=True):
        g.set_state(state)


def _wind(generator: torch.Generator, start: Tensor, draws: int, shape, device) -> None:
    """Put ``generator`` where ``draws`` exponential races over ``shape`` leave it from ``start``:
    where the member's solo rollout, which stops early, leaves its stream."""
    generator.set_state(start)
    scratch = torch.empty(shape, dtype=torch.float32, device=device)
    for _ in range(draws):
        scratch.exponential_(1, generator=generator)


def batched_decoder_for(model, tokenizer, cfg: RolloutConfig) -> BatchedDecoder:
    """The model's :class:`BatchedDecoder`, made on first use and kept on the model."""
    decoder = getattr(model, "pbt_batched_decoder", None)
    graphs = cfg.cuda_graphs and next(model.parameters()).device.type == "cuda"
    if decoder is None or (decoder.cuda_graphs, decoder.compile) != (graphs, cfg.compile):
        decoder = BatchedDecoder(
            model,
            pad_id=tokenizer.pad_token_id,
            eos_id=tokenizer.eos_token_id,
            cuda_graphs=cfg.cuda_graphs,
            compile=cfg.compile,
        )
        model.pbt_batched_decoder = decoder
    return decoder
