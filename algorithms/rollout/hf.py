"""Rollouts through Hugging Face ``generate`` (or the static-cache decoder of
:mod:`pbt.algorithms.rollout.static`), and the log-prob forward pass that matches them.

Prompts are chat-templated and left-padded; completions are right-padded and their mask covers
every token up to and including the first end-of-sequence token. Positions are computed from
the attention mask in both ``generate`` and :func:`sequence_logprobs`, so the trainer scores
exactly the tokens the sampler saw.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pbt.algorithms.data.examples import Chat, as_messages
from pbt.algorithms.losses import token_logprobs
from pbt.algorithms.runtime.models import mixed_precision
from pbt.config import RolloutConfig


@dataclass(slots=True)
class RolloutBatch:
    """Prompts and their sampled completions, as token ids and text."""

    prompt_ids: Tensor
    """``[N, P]`` left-padded prompt ids."""
    prompt_mask: Tensor
    """``[N, P]`` 1 on real prompt tokens."""
    completion_ids: Tensor
    """``[N, C]`` right-padded completion ids."""
    completion_mask: Tensor
    """``[N, C]`` float, 1.0 up to and including the first EOS."""
    texts: list[str]
    """Decoded completions, special tokens removed."""
    logprobs: Tensor | None = None
    """``[N, C]`` the sampler's log-probs of the completion tokens when it reports them (vLLM),
    for the importance-sampling correction; None from ``generate``."""
    versions: Tensor | None = None
    """``[N]`` int64 (on the CPU): the adapter version each row was drawn with, from a dedicated
    engine (:mod:`pbt.algorithms.rollout.dedicated`); None when the trainer sampled itself."""
    attention: Tensor | None = None
    """``[N, C]`` 1 on every real completion token when that differs from the loss mask: a
    multi-turn trajectory's observation tokens are attended to but not trained on
    (:mod:`pbt.algorithms.envs`). None: the completion mask."""

    def completion_attention(self) -> Tensor:
        """``[N, C]`` long, 1 on the completion tokens the model attends to."""
        mask = self.completion_mask if self.attention is None else self.attention
        return mask.long()

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, index: Tensor | slice) -> RolloutBatch:
        """Rows ``index`` of the batch (texts follow)."""
        rows = range(len(self))[index] if isinstance(index, slice) else index.tolist()
        return RolloutBatch(
            self.prompt_ids[index],
            self.prompt_mask[index],
            self.completion_ids[index],
            self.completion_mask[index],
            [self.texts[i] for i in rows],
            None if self.logprobs is None else self.logprobs[index],
            None if self.versions is None else self.versions[_cpu(index)],
            None if self.attention is None else self.attention[index],
        )


def _cpu(index: Tensor | slice) -> Tensor | slice:
    return index.cpu() if isinstance(index, Tensor) else index


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch of the rows of ``batches``: prompts re-padded on the left, completions on the
    right, to the longest of each."""
    if len(batches) == 1:
        return batches[0]
    width = max(b.prompt_ids.shape[1] for b in batches)
    length = max(b.completion_ids.shape[1] for b in batches)

    def left(t: Tensor, value: float) -> Tensor:
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    def right(t: Tensor, value: float) -> Tensor:
        return torch.nn.functional.pad(t, (0, length - t.shape[1]), value=value)

    return RolloutBatch(
        torch.cat([left(b.prompt_ids, pad_id) for b in batches]),
        torch.cat([left(b.prompt_mask, 0) for b in batches]),
        torch.cat([right(b.completion_ids, pad_id) for b in batches]),
        torch.cat([right(b.completion_mask, 0.0) for b in batches]),
        [text for b in batches for text in b.texts],
        None
        if any(b.logprobs is None for b in batches)
        else torch.cat([right(b.logprobs, 0.0) for b in batches]),
        None
        if any(b.versions is None for b in batches)
        else torch.cat([b.versions for b in batches]),
        None
        if all(b.attention is None for b in batches)
        else torch.cat([right(b.completion_attention(), 0) for b in batches]),
    )


def chat_prompts(tokenizer, questions: Sequence[Chat]) -> list[str]:
    """Each prompt through the chat template, ready for the assistant's reply: a plain string
    as a single user turn, a list of turns (a system prompt first) as they are. A last
    ``assistant`` turn is a prefill: its text follows the template's generation prompt as is, so
    the completion continues it (and holds none of it)."""
    return [_chat_prompt(tokenizer, as_messages(q)) for q in questions]


def _chat_prompt(tokenizer, turns: list[dict[str, str]]) -> str:
    prefill = ""
    if turns and turns[-1]["role"] == "assistant":
        prefill, turns = turns[-1]["content"], turns[:-1]
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return text + prefill


@torch.no_grad()
def generate(
    model,
    tokenizer,
    questions: Sequence[Chat],
    cfg: RolloutConfig,
    *,
    repeats: int = 1,
    greedy: bool = False,
    temperature: float | None = None,
    synced: bool = False,
) -> RolloutBatch:
    """Sample ``repeats`` completions for each question (rows grouped by question).

    Sampling draws from torch's global generator, which the trainer seeds and checkpoints.
    ``synced`` keeps every rank decoding until all are done, as a sharded model requires.
    """
    texts = [p for p in chat_prompts(tokenizer, questions) for _ in range(repeats)]
    device = next(model.parameters()).device
    enc = tokenizer(
        texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
    )
    prompt_ids, prompt_mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    completion_ids = sample_ids(
        model, tokenizer, prompt_ids, prompt_mask, cfg,
        greedy=greedy, temperature=temperature, synced=synced,
    )  # fmt: skip
    return _batch(tokenizer, prompt_ids, prompt_mask, completion_ids)


@torch.no_grad()
def sample_ids(
    model,
    tokenizer,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    cfg: RolloutConfig,
    *,
    greedy: bool = False,
    temperature: float | None = None,
    synced: bool = False,
) -> Tensor:
    """``[N, C]`` sampled continuations of left-padded token ids ``prompt_ids`` (``[N, P]``), up
    to ``cfg.max_output_tokens`` each, through ``generate`` or the static-cache decoder; what
    follows an EOS is not masked here (:func:`completion_mask` marks it)."""
    temp = cfg.temperature if temperature is None else temperature
    sampling = not greedy and temp > 0
    if cfg.engine == "static" and not synced:
        return _static_generate(model, tokenizer, prompt_ids, prompt_mask, cfg, sampling, temp)
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        max_new_tokens=cfg.max_output_tokens,
        min_new_tokens=cfg.min_output_tokens,
        do_sample=sampling,
        temperature=temp if sampling else None,
        top_p=cfg.top_p if sampling else None,
        top_k=cfg.top_k if sampling else None,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        synced_gpus=synced,
    )
    return out[:, prompt_ids.shape[1] :]


def _static_generate(model, tokenizer, prompt_ids, prompt_mask, cfg, sampling: bool, temp: float):
    from pbt.algorithms.rollout.static import Sampling, decoder_for

    decoder = decoder_for(
        model,
        pad_id=tokenizer.pad_token_id,
        eos_id=tokenizer.eos_token_id,
        cuda_graphs=cfg.cuda_graphs,
        compile=cfg.compile,
    )
    return decoder.generate(
        prompt_ids,
        prompt_mask,
        max_new_tokens=cfg.max_output_tokens,
        min_new_tokens=cfg.min_output_tokens,
        sampling=Sampling(not sampling, cfg.top_k, cfg.top_p),
        temperature=temp if sampling else 1.0,
        autocast_dtype=getattr(model, "pbt_autocast_dtype", None),
    )


def _batch(tokenizer, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor):
    mask = completion_mask(completion_ids, tokenizer.eos_token_id)
    completion_ids = completion_ids.masked_fill(mask == 0, tokenizer.pad_token_id)
    decoded = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return RolloutBatch(prompt_ids, prompt_mask, completion_ids, mask, decoded)


def completion_mask(completion_ids: Tensor, eos_id: int) -> Tensor:
    """``[N, C]`` float mask: 1.0 through the first EOS (inclusive), 0.0 after it."""
    is_eos = completion_ids == eos_id
    after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return (~after_eos).float()


def sequence_logprobs(model, batch: RolloutBatch, temperature: float) -> Tensor:
    """Log-probs ``[N, C]`` of the batch's completion tokens under ``model``.

    Gradients flow when called outside ``torch.no_grad()``; the passes run under the model's
    mixed precision (see :func:`~pbt.algorithms.runtime.models.set_mixed_precision`). The lean path (a plain linear
    output layer, no logit post-processing): columns that are padding in every row are cut
    off first, and the output layer's logits are never held for the whole batch: each chunk of
    about :data:`LOGIT_CHUNK_BYTES` of float32 logits is computed, reduced to the target's
    log-prob and freed, and recomputed in the backward pass. Otherwise the full logits.
    """
    trimmed, right = trim_padding(batch)
    head = plain_output_layer(model)
    with mixed_precision(model):
        if head is None:
            logp = _full_logits_logprobs(model, trimmed, temperature)
        else:
            logp = _lean_logprobs(model, head, trimmed, temperature)
    return torch.nn.functional.pad(logp, (0, right)) if right else logp


def model_inputs(batch: RolloutBatch) -> tuple[Tensor, Tensor, Tensor]:
    """``(input ids, attention mask, position ids)``, each ``[N, P + C]``, of prompts and
    completions: positions count real tokens only, so left padding moves no row's positions."""
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention = torch.cat([batch.prompt_mask, batch.completion_attention()], dim=1)
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention, positions


def _full_logits_logprobs(model, batch: RolloutBatch, temperature: float) -> Tensor:
    input_ids, attention, positions = model_inputs(batch)
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits
    prompt_len = batch.prompt_ids.shape[1]
    # logits at position t predict token t + 1: the completion is predicted from prompt_len - 1 on.
    completion_logits = logits[:, prompt_len - 1 : -1]  # [N, C, V]
    return token_logprobs(completion_logits, batch.completion_ids, temperature)


LOGIT_CHUNK_BYTES = 512 * 2**20
"""Float32 logits held at once by the lean log-prob path."""
GRADIENT_IN_FORWARD = True
"""A frozen output layer's chunks compute their rows' gradient in the forward pass
(:class:`_FrozenHeadLogprobs`); off, they are recomputed in the backward pass as a trainable
layer's are (``bench/train_step.py`` measures both)."""


def _lean_logprobs(model, head: torch.nn.Linear, batch: RolloutBatch, temperature: float):
    """The output layer's forward swapped, for one call, for the chunked log-prob reduction:
    its result leaves the root module as ``logits`` (``[N, C]``), so under FSDP2 the layer's
    weight is gathered around it in the forward and again before the backward reaches it."""
    inputs = model_inputs(batch)
    targets = batch.completion_ids
    length = targets.shape[1]

    fused = getattr(model, "pbt_compiled", False)

    def forward(hidden: Tensor) -> Tensor:  # [N, C + 1, H]: the last C + 1 positions
        return chunked_token_logprobs(
            hidden[:, :-1], head.weight, head.bias, targets, temperature, fused=fused
        )

    return with_head_forward(model, head, forward, inputs, length + 1)


def with_head_forward(model, head: torch.nn.Linear, forward, inputs: tuple, keep: int) -> Tensor:
    """One call of ``model`` on ``inputs`` (ids, attention mask, positions) with its output
    layer's forward swapped for ``forward`` over the last ``keep`` positions' hidden states;
    what ``forward`` returns, as the output's ``logits``."""
    input_ids, attention, positions = inputs
    head.forward = forward
    try:
        out = model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            logits_to_keep=keep,
        )
    finally:
        del head.forward  # the class's forward again
    return out.logits


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    *,
    fused: bool = False,
) -> Tensor:
    """``token_logprobs(hidden @ weight.T + bias, targets, temperature)`` without holding the
    ``[N, C, V]`` logits: rows go through in chunks of about :data:`LOGIT_CHUNK_BYTES` of float32
    logits. When gradients are on, a frozen output layer's chunk leaves only the log-prob's
    gradient with respect to its rows (:class:`_FrozenHeadLogprobs`, a ``[rows, H]`` float32
    tensor, computed beside the log-probs); a trainable one's logits are recomputed in the
    backward pass (activation checkpointing). ``fused``: a frozen layer's elementwise work runs
    compiled (:func:`_fused_softmax_parts`; a model whose decoder is compiled asks for it)."""
    n, c, width = hidden.shape
    flat, wanted = hidden.reshape(n * c, width), targets.reshape(n * c)
    chunk = max(64, LOGIT_CHUNK_BYTES // (4 * weight.shape[0]))
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    frozen = GRADIENT_IN_FORWARD and not weight.requires_grad
    frozen = frozen and (bias is None or not bias.requires_grad)
    parts = []
    for start in range(0, n * c, chunk):
        args = (flat[start : start + chunk], weight, bias, wanted[start : start + chunk])
        if grads and frozen:
            parts.append(_FrozenHeadLogprobs.apply(*args, temperature, fused))
        elif grads:
            parts.append(
                torch.utils.checkpoint.checkpoint(
                    _chunk_logprobs, *args, temperature, use_reentrant=False
                )
            )
        else:
            parts.append(_chunk_logprobs(*args, temperature))
    return torch.cat(parts).view(n, c) if parts else hidden.new_zeros((n, c), dtype=torch.float32)


def _chunk_logprobs(hidden, weight, bias, targets, temperature: float) -> Tensor:
    return token_logprobs(torch.nn.functional.linear(hidden, weight, bias), targets, temperature)


class _FrozenHeadLogprobs(torch.autograd.Function):
    """One chunk's target log-probs through a frozen output layer, with their gradient with
    respect to the rows computed in the forward pass: ``d logp_i / d h_i = (onehot(t_i) -
    softmax_i) @ W / temperature``. A row's log-prob is a scalar, so the backward pass only
    scales that ``[rows, H]`` tensor by the incoming gradient, and the logits are formed once
    (two matmuls over the vocabulary a chunk, where recomputing them in backward takes three).
    The matmul with ``W`` runs in the logits' dtype, as autograd's backward of the linear layer
    would."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, fused: bool) -> Tensor:
        logits = torch.nn.functional.linear(hidden, weight, bias)
        compute = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(
            hidden.device.type
        ) else weight.dtype  # fmt: skip
        if fused:
            logp, probs = _fused_softmax_parts()(
                logits, targets, logits.new_tensor(1.0 / temperature, dtype=torch.float32), compute
            )
        else:
            scaled = logits.float()
            del logits
            if temperature != 1.0:
                scaled.div_(temperature)
            picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            lse = torch.logsumexp(scaled, dim=-1)
            logp = picked - lse
            probs = scaled.sub_(lse.unsqueeze(-1)).exp_().to(compute)  # softmax, in place
        # (onehot(t) - softmax) @ W = W[t] - softmax @ W
        rows = weight[targets].float() - (probs @ weight.to(compute)).float()
        if temperature != 1.0:
            rows.div_(temperature)
        ctx.save_for_backward(rows)
        ctx.dtype = hidden.dtype
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        (rows,) = ctx.saved_tensors
        grad = (rows * grad_logp.float().unsqueeze(-1)).to(ctx.dtype)
        return grad, None, None, None, None, None


def _softmax_parts(logits, targets, inverse_temperature, dtype) -> tuple[Tensor, Tensor]:
    """A chunk's target log-probs (float32) and its softmax (in ``dtype``) from its logits at
    a temperature: the elementwise work of :class:`_FrozenHeadLogprobs`, which
    :func:`_fused_softmax_parts` compiles into two passes over the logits."""
    scaled = logits.float() * inverse_temperature
    lse = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    return logp, torch.exp(scaled - lse.unsqueeze(-1)).to(dtype)


@functools.cache
def _fused_softmax_parts():
    """:func:`_softmax_parts` compiled (once a process; chunk rows dynamic): the eager version
    makes five passes over a chunk's float32 logits, this one reads the half-precision logits
    twice and writes the softmax once."""
    return torch.compile(_softmax_parts, dynamic=True)


def plain_output_layer(model) -> torch.nn.Linear | None:
    """The output layer when the lean path computes exactly what the model would: a plain
    ``nn.Linear`` (not adapted) whose logits the model returns unchanged."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    config = getattr(base, "config", None)
    post_processed = config is not None and (
        getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None)
    )
    adapted = hasattr(head, "lora_A")  # peft wraps an adapted layer; its weight is not all of it
    if post_processed or adapted or not isinstance(head, torch.nn.Linear):
        return None
    if "logits_to_keep" not in inspect.signature(base.forward).parameters:
        return None
    return head


def trim_padding(batch: RolloutBatch) -> tuple[RolloutBatch, int]:
    """The batch without prompt columns that are padding in every row (on the left) and
    completion columns that are masked in every row (on the right), and how many of those."""
    prompt_used = batch.prompt_mask.any(dim=0)
    left = int(prompt_used.long().argmax()) if bool(prompt_used.any()) else 0
    done = batch.completion_mask.any(dim=0)
    keep = int(done.nonzero().max()) + 1 if bool(done.any()) else 1
    right = batch.completion_ids.shape[1] - keep
    if not left and not right:
        return batch, 0
    return (
        RolloutBatch(
            batch.prompt_ids[:, left:],
            batch.prompt_mask[:, left:],
            batch.completion_ids[:, :keep],
            batch.completion_mask[:, :keep],
            batch.texts,
            None if batch.logprobs is None else batch.logprobs[:, :keep],
            batch.versions,
            None if batch.attention is None else batch.attention[:, :keep],
        ),
        right,
    )
