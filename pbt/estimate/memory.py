"""A member's peak GPU memory per rank, predicted before launch from the model's shape (its
``config.json``, read by :mod:`pbt.estimate.model_shape`) and the manifest (``pbt
estimate-memory``; ``pbt check`` warns when it exceeds the GPU).

The arithmetic, first principles, for a Llama-style decoder (Qwen2/2.5/3, Llama, Mistral: RMSNorm,
grouped-query attention through SDPA, a gated MLP), LoRA on its projections, on CUDA:

- **Persistent**: base weights (``model.dtype``; ``auto`` is bfloat16 on CUDA), divided by the
  ranks under FSDP2 (with ``model.quantization``, the blocks' projections in 4 bits plus their
  quantization constants, see :func:`quantized_bytes_per_weight`); the adapter (PPO: two, and a
  value head) in float32 with its gradients and AdamW's two moments (16 bytes a parameter, 8
  when FSDP2 keeps the moments on the host), plus a half-precision copy each pass uses; the
  static decoder's KV cache, which it keeps.
- **Training** (at the start of backward, where every saved activation is still held):
  activations per token per layer, from what autograd saves (counted on the CPU with
  ``saved_tensors_hooks``; see :func:`layer_bytes`) times ``micro_batch x (prompt +
  max_output_tokens)`` tokens times layers; the lean log-prob path's logits, about
  :data:`LOGIT_COPIES_IN_FORWARD` float32 copies of one chunk of at most
  :data:`LOGIT_CHUNK_BYTES` and each completion row's float32 gradient, which a frozen output
  layer forms in the forward pass (:data:`LOGIT_COPIES` copies where the logits are recomputed
  in backward; the full ``[N, T, V]`` logits where the lean path does not apply); under FSDP2
  two blocks and the
  output layer gathered at once; a 4-bit base's weights of one block dequantized in flight.
  With activation checkpointing or offloading, the saved activations shrink to what stays on
  the device, and a block's backward working set (recomputed with the MLP's gradients beside
  it, or brought back from the host) counts only where it exceeds the logits: the output
  layer's backward, where the logits live, ends before the first block's begins.
- **Rollout**: the KV cache of ``prompts_per_step x group_size / ranks`` sequences of prompt +
  completion (``generate``'s grows to it; the static decoder's is persistent, rounded up to
  :data:`STATIC_LENGTH_BUCKET`), or vLLM's ``gpu_memory_utilization`` share of the GPU (only
  while rollouts run when it sleeps during training).

peak = persistent + max(training, rollout); a GPU holds ``launch.members_per_gpu`` members, each
a process with its own base and :data:`CUDA_CONTEXT_GIB` of CUDA context outside torch's count.

A long-lived worker batching K members (``launch.members_per_batch``, where
:attr:`~pbt.config.Manifest.worker_batch` says a worker does) is one such process: one base, the
adapter slot, each member's adapter and AdamW moments (12 bytes a parameter), the stacked
adapters its per-row kernels read (4), and the static cache and sampling logits of the K
members' rows. With ``launch.batched_train`` a training forward takes the K members'
micro-batches: per token, the adapters' inputs shared and the stacked kernel's products every
member's ``r`` wide (counted on the CPU through the per-row kernels, exactly, by the tests),
plus the stacked adapters' gradients and the copies a forward keeps of them. The batch's
terms are first principles and CPU counts; no GPU peak of a batched worker has been compared.

Checked against the H200 figures of ``bench/RESULTS.md`` (allocator peaks, random-weight
Qwen2.5 shapes, LoRA r 16 on every projection, prompt 64 + completion 448 tokens): the train step
at 0.5B x 16 sequences, mixed precision, measured 14.3 GiB, estimated 14.3; 1.5B x 16: 28.7
measured, 28.7 estimated; the 7B member under FSDP2 on 2 ranks (micro-batch 4): 22.3 measured,
22.4 estimated (tests/unit/estimate/test_memory_estimate.py keeps them within 3%). The activation term per
layer is exact on the CPU, where the tests count what autograd saves (on a 4-bit base too:
its matmuls save nothing of their own, tests/unit/algorithms/test_qlora.py). Members of the 0.5B shape
at 8 prompts x 8 completions x 32 tokens (static decoder) peaked at 2.4-2.8 GiB: the estimate
gives 2.3-2.7 GiB for prompts of 32-64 tokens if those runs took micro-batches of 8 sequences,
and 8.7-11.5 GiB if each forward took all 64 (their micro-batch is not recorded).

The activation knobs and a 4-bit base against the H200 (``bench/activation_memory.py``, 64 +
4,032 tokens a sequence, LoRA r 16, mixed precision; tests/unit/estimate/test_memory_estimate.py feeds the
estimate each workload): at 0.5B (4 sequences) and 1.5B (4) every row of plain, checkpointing,
offloading and both, on a half base and on a 4-bit one, within 3% with the frozen head's logits
recomputed in backward, and within 4.2% with its gradient formed in forward, the default
(``GRADIENT_IN_FORWARD``; the recompute's rows at 1.5B: plain 52.21 GiB
measured, 52.26 estimated; checkpointing 7.20 and 7.13; offloading 5.25 and 5.23; both 6.22 and
6.07; 4-bit with both 4.45 and 4.35); at 7B (2 sequences) within 8% (4-bit with offloading 7.86
and 8.41, the widest); the 110B shape with every knob on 76.52 and 78.77. A 4-bit base holds
what a half one does beside its weights: bitsandbytes' matmul saves only its packed weight and
dequantizes into a temporary each time. The first 4-bit rows measured wider gaps, which the
allocator's history showed to be the earlier modes' tensors still alive in the same process, not
a 4-bit term (bench/RESULTS.md). Those rows ran peft's generic LoRA layer (the bench quantizes
in place); a member's 4-bit layer shares the adapters' inputs, which the estimate counts but no
GPU has measured.

Not modelled: ``training.compile``, which fuses part of the activations away (11.5 GiB measured
at 0.5B against 14.3 eager: the estimate is an upper bound there), mixture-of-experts blocks,
the allocator's fragmentation, and transient buffers of a rollout's prefill.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pbt.config import RL_ALGORITHMS, Manifest
from pbt.config.sections.fsdp import FSDPConfig
from pbt.estimate.model_shape import PROJECTIONS, ModelShape

GIB = 2**30
CUDA_CONTEXT_GIB = 0.5
"""What a CUDA process holds outside torch's allocator (context, kernels, cuBLAS workspace)."""
DEFAULT_GPU_GIB = 140.0
"""An H200 as CUDA reports it (141 GB)."""
DEFAULT_PROMPT_TOKENS = 256
"""Prompt length assumed when the command is not told (a manifest does not bound prompts)."""
LOGIT_CHUNK_BYTES = 512 * 2**20
"""Float32 logits per chunk of the lean log-prob path (``pbt.algorithms.rollout.hf``)."""
LOGIT_COPIES = 4
"""Chunk-sized float32 tensors alive at once when the chunk's logits are recomputed in the
backward pass: the logits, their tempered copy, the softmax and its gradient."""
LOGIT_COPIES_IN_FORWARD = 2
"""The same when a frozen output layer's chunk forms its rows' gradient in the forward pass
(in place, over the logits): the logits and the log-sum-exp's temporary."""
STATIC_LENGTH_BUCKET = 64
"""The static decoder rounds its cache length up to this (``pbt.algorithms.rollout.static``)."""
OFFLOAD_PREFETCH_BYTES = 2**28
"""Offloaded activations prefetched ahead of backward (``pbt.algorithms.runtime.activations``)."""
EVAL_BATCH = 64
"""Prompts decoded at once in evaluation (per rank)."""
QUANT_BLOCK = 64
"""Weights per absmax constant of bitsandbytes' 4-bit quantization."""
DOUBLE_QUANT_BLOCK = 256
"""Absmax constants per float32 second-level constant under double quantization."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What a manifest decides about one rank's memory (:func:`plan_from_manifest`); the
    knobs of :func:`advice` are changes to it."""

    ranks: int = 1
    fsdp: bool = False
    weights_on_host: bool = False
    """FSDP2's ``cpu_offload``: sharded weights live in host memory."""
    moments_on_host: bool = False
    """FSDP2's ``optim_cpu_offload``: Adam's moments live in host memory between steps."""
    weight_bytes: int = 2
    """Bytes of a base weight: 2 for ``model.dtype`` bfloat16/float16 (``auto`` on CUDA), 4
    for float32."""
    autocast: bool = True
    """``training.mixed_precision`` applies (a half base, no FSDP2)."""
    micro_batch: int = 1
    """Examples per training forward on a rank (``algorithm.micro_batch_size``, or the
    rank's mini-batch)."""
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    completion_tokens: int = 64
    rollouts: int = 0
    """Sequences one rank decodes at once in training (0: the algorithm samples nothing)."""
    eval_rollouts: int = 0
    engine: str = "hf"
    vllm_share: float = 0.0
    vllm_sleeps: bool = True
    members_per_gpu: int = 1
    checkpointing: bool = False
    offloading: bool = False
    lora_r: int = 8
    adapted: tuple[str, ...] = PROJECTIONS
    """The block projections (and ``lm_head``) LoRA adapts."""
    adapters: int = 1
    """Adapters trained (PPO's critic is a second one)."""
    per_example: int = 1
    """Sequences per example in a forward (DPO: the chosen and the rejected reply)."""
    quantized: bool = False
    """``model.quantization``: the blocks' projections are 4-bit (QLoRA)."""
    double_quant: bool = True
    compute_bytes: int = 2
    """Bytes of the dtype a 4-bit layer dequantizes its weight to (``compute_dtype``)."""
    generic_lora_on_4bit: bool = False
    """The 4-bit projections carry peft's generic LoRA layer, as after the bench's in-place
    quantization, not its 4-bit one (what ``model.quantization`` loads); only the 4-bit one
    passes the adapters its half input as it is under autocast."""
    head_gradient_in_forward: bool = True
    """A frozen output layer's rows get their gradient in the forward pass, beside the
    log-probs (``GRADIENT_IN_FORWARD`` of ``pbt.algorithms.rollout.hf``); off, its logits are
    recomputed in the backward pass."""
    members_per_batch: int = 1
    """Members one long-lived worker hosts on its base and samples as one batch (the
    manifest's :attr:`~pbt.config.Manifest.worker_batch`): the plan is then a worker's."""
    batched_train: bool = False
    """``launch.batched_train``: the batch's updates in one forward a micro-batch too."""
    stacked: bool = True
    """The batch's per-row LoRA kernel is ``stacked`` (``launch.lora_kernel``; ``auto`` is
    stacked on a GPU), whose inner products are every member's ``r`` wide."""

    @property
    def together(self) -> int:
        """Members whose rows one training forward takes."""
        return self.members_per_batch if self.batched_train else 1

    @property
    def sequence(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def plan_from_manifest(manifest: Manifest, prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> Plan:
    """The :class:`Plan` of ``manifest``'s members, on CUDA, with prompts of ``prompt_tokens``."""
    algo, launch, training = manifest.algorithm, manifest.launch, manifest.training
    ranks = launch.ranks
    fsdp = FSDPConfig.from_value(manifest.distributed.fsdp)
    half = manifest.model.dtype != "float32"
    mini = (algo.mini_batch_size or algo.batch_completions) // ranks
    micro = min(algo.micro_batch_size or mini, mini)
    rl = algo.name in RL_ALGORITHMS
    vllm = manifest.rollout.vllm
    quant = manifest.model.quantization
    return Plan(
        ranks=ranks,
        fsdp=fsdp is not None,
        weights_on_host=fsdp is not None and fsdp.cpu_offload,
        moments_on_host=fsdp is not None and (fsdp.optim_cpu_offload or fsdp.cpu_offload),
        weight_bytes=2 if half else 4,
        autocast=half and training.mixed_precision and fsdp is None,
        micro_batch=max(1, micro),
        prompt_tokens=prompt_tokens,
        completion_tokens=manifest.rollout.max_output_tokens,
        rollouts=algo.batch_completions // ranks if rl else 0,
        eval_rollouts=min(EVAL_BATCH, math.ceil(manifest.task.eval_size / ranks)) if rl else 0,
        engine=manifest.rollout.engine,
        vllm_share=vllm.gpu_memory_utilization if manifest.rollout.engine == "vllm" else 0.0,
        vllm_sleeps=vllm.sleep_mode,
        members_per_gpu=launch.members_per_gpu,
        checkpointing=training.activation_checkpointing,
        offloading=training.activation_offloading,
        lora_r=manifest.lora.r,
        adapted=_adapted(manifest.lora.target_modules),
        adapters=2 if algo.name == "PPO" else 1,
        per_example=2 if algo.name == "DPO" else 1,
        quantized=quant is not None,
        double_quant=quant is None or quant.double_quant,
        compute_bytes=4 if quant is not None and quant.compute_dtype == "float32" else 2,
        members_per_batch=manifest.worker_batch,
        batched_train=launch.batched_train
        and manifest.worker_batch > 1
        and not manifest.learns_apart(),
        stacked=launch.lora_kernel != "segmented",
    )


def _adapted(targets: list[str] | str) -> tuple[str, ...]:
    if targets == "all-linear":
        return PROJECTIONS
    names = [targets] if isinstance(targets, str) else targets
    known = (*PROJECTIONS, "lm_head")
    return tuple(p for p in known if any(n == p or n.endswith(f".{p}") for n in names))


@dataclass(frozen=True, slots=True)
class Term:
    """One line of the estimate: what holds memory, how much, and how it was counted."""

    name: str
    bytes: float
    how: str


@dataclass(frozen=True, slots=True)
class Estimate:
    """A member's memory on one rank, by phase (bytes), and what a GPU holds."""

    persistent: list[Term]
    training: list[Term]
    rollout: list[Term]
    host: list[Term]
    """Host memory each rank of the member holds on top of its process (offloads)."""
    members_per_gpu: int

    @property
    def peak(self) -> float:
        """Peak allocated on one rank: persistent + the larger phase."""
        return sum(t.bytes for t in self.persistent) + max(
            sum(t.bytes for t in self.training), sum(t.bytes for t in self.rollout)
        )

    @property
    def phase(self) -> str:
        """The phase that sets the peak."""
        rollout = sum(t.bytes for t in self.rollout)
        return "rollout" if rollout > sum(t.bytes for t in self.training) else "training"

    @property
    def per_gpu(self) -> float:
        """What one GPU holds: every member's peak and CUDA context."""
        return self.members_per_gpu * (self.peak + CUDA_CONTEXT_GIB * GIB)


def layer_bytes(shape: ModelShape, plan: Plan) -> int:
    """Bytes one transformer block saves for backward, per token, in a training forward.

    What autograd keeps (frozen base weights need no gradient, so a base projection saves none
    of its input; a LoRA projection saves its input for ``lora_A`` and ``lora_A``'s output for
    ``lora_B``):

    - two RMSNorms: a float32 copy of the hidden state and its reciprocal RMS each
      (``4 (H + 1)``), and Qwen3's query and key norms likewise per head;
    - attention: SDPA's queries, keys, values and output in the compute dtype, and its float32
      log-sum-exp per head;
    - the MLP: the gate's and the up projection's outputs and the activation's output (``3 I``);
    - the adapters: each adapted projection's ``r`` outputs of ``lora_A``, and its input. A
      float32 adapter on a half base (mixed precision) casts its input, so every adapted
      projection keeps its own copy; otherwise the inputs are shared: one normed hidden state
      for q, k, v, one for gate and up, and the MLP's product for down (o's input is SDPA's
      output, already counted). peft's 4-bit LoRA layer skips that cast under autocast, so
      on a 4-bit base with mixed precision the inputs are shared too; so do the per-row
      kernels of a batched train step (:mod:`pbt.algorithms.runtime.lora_batch`), whose
      stacked kernel keeps every member's ``r`` columns of ``lora_A``'s output (masked) for
      each row.
    """
    b = 2 if plan.weight_bytes == 2 else 4
    half_adapter = plan.weight_bytes == 2 and (plan.fsdp or plan.autocast)
    a = 2 if half_adapter else 4
    uncast = plan.quantized and plan.autocast and not plan.generic_lora_on_4bit
    uncast |= plan.together > 1 and plan.autocast  # the per-row kernels skip the cast too
    copies = plan.weight_bytes == 2 and not plan.fsdp and not uncast
    h, i, q, kv = shape.hidden, shape.intermediate, shape.q_width, shape.kv_width
    adapted = [p for p in plan.adapted if p in PROJECTIONS]
    norms = 2 * 4 * (h + 1) + (4 * (q + kv + shape.heads + shape.kv_heads) if shape.qk_norm else 0)
    attention = b * (2 * q + 2 * kv) + 4 * shape.heads
    mlp = b * 3 * i
    wide = plan.together if plan.stacked else 1  # the stacked kernel's every-member products
    lora_out = a * plan.lora_r * wide * len(adapted)
    if copies:
        lora_in = a * sum(shape.projections()[p][0] for p in adapted)
    else:
        groups = {("q_proj", "k_proj", "v_proj"): h, ("gate_proj", "up_proj"): h, ("down_proj",): i}
        lora_in = b * sum(w for group, w in groups.items() if any(p in adapted for p in group))
    return norms + attention + mlp + lora_out + lora_in


def mlp_gradient_bytes(shape: ModelShape, plan: Plan) -> int:
    """Bytes per token of the gradients alive at once in a block's backward, on top of the
    block's saved tensors: the MLP's, which backward reaches first: the gradient of the down
    projection's input, then those of the activation's output and of the up projection's
    output (``3 I`` in the compute dtype). Counted on the CPU (``bench/activation_memory.py``'s
    workload at the 1.5B widths, one block recomputed: 6.0 x ``I`` bytes a token beyond the
    saved tensors, at two intermediate sizes). Plain training never notices them (the logits
    of the output layer's backward are larger and gone first); a recomputed block's backward
    does."""
    b = 2 if plan.weight_bytes == 2 else 4
    return b * 3 * shape.intermediate


def adapter_params(shape: ModelShape, plan: Plan) -> int:
    """Trainable parameters: ``r x (in + out)`` per adapted layer, per adapter; PPO's value
    head too."""
    per_layer = sum(
        plan.lora_r * sum(shape.projections()[p]) for p in plan.adapted if p != "lm_head"
    )
    head = plan.lora_r * (shape.hidden + shape.vocab) if "lm_head" in plan.adapted else 0
    value_head = shape.hidden + 1 if plan.adapters > 1 else 0
    return plan.adapters * (shape.layers * per_layer + head) + value_head


def quantized_params(shape: ModelShape, plan: Plan) -> int:
    """Weights a 4-bit base stores in 4 bits: every block's projections (bitsandbytes leaves
    the embeddings, the output layer, the norms and the biases as they are)."""
    if not plan.quantized:
        return 0
    return shape.layers * sum(a * b for a, b in shape.projections().values())


def quantized_bytes_per_weight(plan: Plan) -> float:
    """Half a byte a weight, plus its share of the quantization constants: a float32 absmax
    per :data:`QUANT_BLOCK` weights, or, double-quantized, an 8-bit absmax and a float32
    constant per :data:`DOUBLE_QUANT_BLOCK` of those."""
    if plan.double_quant:
        return 0.5 + (1 + 4 / DOUBLE_QUANT_BLOCK) / QUANT_BLOCK
    return 0.5 + 4 / QUANT_BLOCK


def base_weight_bytes(shape: ModelShape, plan: Plan) -> float:
    """Bytes of the whole base: 4-bit projections (QLoRA) and the rest at ``weight_bytes``."""
    quantized = quantized_params(shape, plan)
    rest = shape.params() - quantized
    return quantized * quantized_bytes_per_weight(plan) + rest * plan.weight_bytes


def _dequantized_in_flight(shape: ModelShape, plan: Plan) -> list[Term]:
    """A 4-bit layer dequantizes its weight for each matmul (forward and backward): one
    block's projections in the compute dtype at most, freed as each matmul ends."""
    if not plan.quantized:
        return []
    block = sum(a * b for a, b in shape.projections().values())
    how = f"one block's projections ({count_text(block)}) x {plan.compute_bytes} bytes"
    return [Term("dequantized weights in flight", block * plan.compute_bytes, how)]


def estimate(shape: ModelShape, plan: Plan, gpu_bytes: float = DEFAULT_GPU_GIB * GIB) -> Estimate:
    """The memory of one rank of a member of ``plan`` on a GPU of ``gpu_bytes`` (which only
    vLLM's share depends on)."""
    vllm = plan.vllm_share * gpu_bytes
    persistent = [*_persistent(shape, plan), *_static_cache(shape, plan)]
    rollout = _rollout(shape, plan)
    if rollout:
        rollout += _dequantized_in_flight(shape, plan)
    if vllm and plan.vllm_sleeps:
        rollout.append(
            Term("vLLM engine", vllm, f"{plan.vllm_share:g} of the GPU, asleep in training")
        )
    elif vllm:
        persistent.append(Term("vLLM engine", vllm, f"{plan.vllm_share:g} of the GPU, always"))
    training, host = _training(shape, plan)
    return Estimate(persistent, training, rollout, host, plan.members_per_gpu)


def _persistent(shape: ModelShape, plan: Plan) -> list[Term]:
    share = plan.ranks if plan.fsdp else 1
    split = f" / {share} ranks" if share > 1 else ""
    params = shape.params()
    terms = []
    if not plan.weights_on_host and plan.quantized:
        quantized = quantized_params(shape, plan)
        per = quantized_bytes_per_weight(plan)
        double = "double-quantized " if plan.double_quant else ""
        how = (
            f"{count_text(quantized)} 4-bit x {per:.4f} bytes (with {double}constants), "
            f"{count_text(params - quantized)} x {plan.weight_bytes}{split}"
        )
        terms.append(Term("base weights", base_weight_bytes(shape, plan) / share, how))
    elif not plan.weights_on_host:
        how = f"{count_text(params)} parameters x {plan.weight_bytes} bytes{split}"
        terms.append(Term("base weights", params * plan.weight_bytes / share, how))
    n = adapter_params(shape, plan)
    k = plan.members_per_batch
    parts = ["float32 weight 4", "gradient 4"]
    parts += [] if plan.moments_on_host or k > 1 else ["AdamW moments 8"]
    parts += ["half copy 2"] if plan.autocast else []
    per = sum(int(p.rsplit(" ", 1)[1]) for p in parts)
    how = f"{count_text(n)} parameters x {per} bytes ({', '.join(parts)}){split}"
    if k == 1:
        terms.append(Term("adapter, gradients, optimizer", n * per / share, how))
        return terms
    terms.append(Term("adapter slot, gradients", n * per, how))
    how = f"{k} x {count_text(n)} parameters x 12 bytes (float32 weight 4, AdamW moments 8)"
    terms.append(Term(f"{k} members' adapters, optimizers", k * n * 12, how))
    how = f"{k} x {count_text(n)} parameters x 4 bytes (every member's A and B, float32)"
    terms.append(Term("stacked adapters of the batch", k * n * 4, how))
    return terms


def _kv_bytes_per_token(shape: ModelShape, plan: Plan) -> int:
    return 2 * shape.layers * shape.kv_width * plan.weight_bytes


def _static_cache(shape: ModelShape, plan: Plan) -> list[Term]:
    """The static decoder keeps the cache (and graph) of each batch shape it has decoded."""
    if plan.engine != "static" or not plan.rollouts:
        return []
    length = -(-plan.sequence // STATIC_LENGTH_BUCKET) * STATIC_LENGTH_BUCKET
    k = plan.members_per_batch
    rows = k * (plan.rollouts + plan.eval_rollouts)
    how = f"({plan.rollouts} + {plan.eval_rollouts} eval) sequences x {length} tokens, kept"
    how = how if k == 1 else f"{k} members x {how}"
    how += " (up to 4 shapes are)"
    return [Term("static KV cache", rows * length * _kv_bytes_per_token(shape, plan), how)]


def _rollout(shape: ModelShape, plan: Plan) -> list[Term]:
    rows = plan.members_per_batch * max(plan.rollouts, plan.eval_rollouts)
    if not rows or plan.engine == "vllm":
        return []
    terms = []
    if plan.engine == "hf":
        how = f"{rows} sequences x {plan.sequence} tokens"
        terms.append(Term("KV cache", rows * plan.sequence * _kv_bytes_per_token(shape, plan), how))
    how = f"{rows} rows x {shape.vocab} vocabulary x 3 float32 copies"
    terms.append(Term("sampling logits", rows * shape.vocab * 4 * 3, how))
    return terms


def _training(shape: ModelShape, plan: Plan) -> tuple[list[Term], list[Term]]:
    """The training phase's device terms, and the host memory that offloading takes.

    The backward pass starts with the output layer (the lean path recomputes its logit chunks
    there) and only then goes through the blocks, so the logits and a block's backward working
    set (a recomputed block, or one brought back from the host) are never held at once: what
    the saved activations leave held counts once, plus the larger of the two.
    """
    host: list[Term] = []
    held, working = _activations(shape, plan, host)
    logits = _logits(shape, plan)
    terms = [held, logits]
    if plan.together > 1:
        n, k = adapter_params(shape, plan), plan.together
        how = f"{k} x {count_text(n)} parameters x 4 bytes"
        terms.append(Term("stacked adapters' gradients", k * n * 4, how))
        if plan.autocast:  # the products' half copies of every member's A and B
            how = f"{k} x {count_text(n)} parameters x 2 bytes, a forward's"
            terms.append(Term("stacked adapters' half copies", k * n * 2, how))
        elif plan.stacked:  # every member's B side by side, a float32 copy a forward keeps
            b = shape.layers * sum(
                plan.lora_r * shape.projections()[p][1] for p in plan.adapted if p in PROJECTIONS
            )
            how = f"{k} x {count_text(b)} parameters of B x 4 bytes, a forward's"
            terms.append(Term("stacked B, side by side", k * b * 4, how))
    if working is not None and working.bytes > logits.bytes:
        how = f"{working.how} ({working.bytes / GIB:.2f} GiB), beyond the logits' memory it reuses"
        terms.append(Term("backward working set", working.bytes - logits.bytes, how))
    terms += _dequantized_in_flight(shape, plan)
    if plan.fsdp:
        block = shape.block_params()
        block_bytes = block * 2
        if plan.quantized:
            matrices = sum(a * b for a, b in shape.projections().values())
            block_bytes = matrices * quantized_bytes_per_weight(plan) + (block - matrices) * 2
        gathered = 2 * block_bytes + shape.vocab * shape.hidden * 2
        how = "two blocks and the output layer unsharded at once, bfloat16"
        how += " (the blocks' projections 4-bit)" if plan.quantized else ""
        terms.append(Term("FSDP2 gathered weights", gathered, how))
    if plan.weights_on_host:
        bytes_ = base_weight_bytes(shape, plan) / plan.ranks
        host.append(Term("base weights (FSDP2 cpu_offload)", bytes_, "this rank's shards"))
    if plan.moments_on_host:
        moments = adapter_params(shape, plan) * 8 / plan.ranks
        host.append(Term("AdamW moments (FSDP2 optim_cpu_offload)", moments, "this rank's shards"))
    return terms, host


def _activations(shape: ModelShape, plan: Plan, host: list[Term]) -> tuple[Term, Term | None]:
    """Saved activations held on the device when the backward pass starts, and the working
    set of one block's backward on top of them (None: nothing beyond what is held); what
    offloading moves to the host is appended to ``host``.

    - plain: every layer's saved tensors, the final norm's input and the head's input;
    - checkpointing: each block's input; in backward one block recomputed at a time, with the
      MLP's gradients (:func:`mlp_gradient_bytes`) beside its saved tensors;
    - offloading: the head's input (a view, never offloaded); the copies still in flight to
      the host do not count, since the CUDA allocator counts a tensor free when it is
      released, even while the side stream still reads it (the H200's allocator history shows
      nothing of the blocks held at the peak, with a bf16 base or a 4-bit one). In backward
      one block brought back and the prefetch;
    - both: the head's input and the latest block input in flight; in backward one block
      recomputed from its input brought back, with the MLP's gradients, and the prefetch.
    """
    sequences = plan.micro_batch * plan.per_example * plan.together
    tokens = sequences * plan.sequence
    layer = layer_bytes(shape, plan) * tokens
    block_input = shape.hidden * plan.weight_bytes * tokens
    head_input = shape.hidden * plan.weight_bytes * tokens
    outside = (4 + plan.weight_bytes) * shape.hidden * tokens  # final norm, the head's input
    count = f"{sequences} x {plan.sequence} tokens"
    every = f"{layer_bytes(shape, plan):,} bytes/token x {count} x {shape.layers} layers"
    held = shape.layers * layer + outside  # what plain training holds
    recomputed = "one block recomputed, with the MLP's gradients"
    grads = mlp_gradient_bytes(shape, plan) * tokens
    if plan.checkpointing and plan.offloading:
        inputs = shape.layers * block_input
        device = head_input + block_input
        how = "the head's input and the latest block input in flight; block inputs on the host"
        prefetch = min(OFFLOAD_PREFETCH_BYTES, inputs)
        working = Term("", layer + grads + block_input + prefetch, recomputed)
        host.append(Term("offloaded block inputs", inputs + outside, count))
    elif plan.checkpointing:
        device = shape.layers * block_input + outside
        how = f"each block's input ({shape.hidden} x {plan.weight_bytes} bytes/token)"
        working = Term("", layer + grads, recomputed)
    elif plan.offloading:
        device = min(held, head_input)
        how = "the head's input; every block's tensors on the host"
        back = min(layer + OFFLOAD_PREFETCH_BYTES, held - device)
        working = Term("", back, "one block brought back and the prefetch")
        host.append(Term("offloaded activations", held, every))
    else:
        device, how, working = held, every, None
    return Term("activations", device, how), working


def _logits(shape: ModelShape, plan: Plan) -> Term:
    rows = plan.micro_batch * plan.per_example * plan.together * plan.completion_tokens
    if not shape.softcapped and "lm_head" not in plan.adapted:
        held = min(rows, max(64, LOGIT_CHUNK_BYTES // (4 * shape.vocab)))
        chunk = f"a chunk of {held} rows x {shape.vocab} vocabulary"
        if not plan.head_gradient_in_forward:
            how = f"{LOGIT_COPIES} float32 copies of {chunk}"
            return Term("log-prob logits", LOGIT_COPIES * held * shape.vocab * 4, how)
        gradient = rows * shape.hidden * 4  # each row's gradient, float32, until the backward
        how = f"{LOGIT_COPIES_IN_FORWARD} float32 copies of {chunk}, and the rows' gradients"
        return Term(
            "log-prob logits", LOGIT_COPIES_IN_FORWARD * held * shape.vocab * 4 + gradient, how
        )
    tokens = plan.micro_batch * plan.per_example * plan.together * plan.sequence
    full = tokens * shape.vocab * plan.weight_bytes + 3 * rows * shape.vocab * 4
    why = "an adapted output layer" if "lm_head" in plan.adapted else "post-processed logits"
    return Term("logits", full, f"the full logits ({why}: no lean log-prob path)")


def count_text(n: float) -> str:
    """``n`` in words of thousands, millions or billions: ``494.03M``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


@dataclass(frozen=True, slots=True)
class Knob:
    """A change that lowers the estimate: the manifest setting and the estimate with it."""

    setting: str
    estimate: Estimate

    def fits(self, gpu_bytes: float) -> bool:
        return self.estimate.per_gpu <= gpu_bytes


def advice(shape: ModelShape, plan: Plan, gpu_bytes: float, gpus: int = 1) -> list[Knob]:
    """Each knob that lowers the estimate of ``plan``, cheapest first, with the estimate it
    gives: a smaller micro-batch, activation checkpointing, activation offloading, fewer
    members per GPU, a smaller vLLM share, FSDP2 over twice the GPUs (when members have
    ``gpus`` > 0), a 4-bit base (which, unlike the others, changes what is trained: the adapter
    learns on the quantized weights), and every activation knob at once."""

    def knob(setting: str, **changes: object) -> Knob:
        return Knob(setting, estimate(shape, dataclasses.replace(plan, **changes), gpu_bytes))

    def fits(k: Knob) -> bool:
        return k.fits(gpu_bytes)

    knobs = []
    smaller = [m for m in range(plan.micro_batch - 1, 0, -1) if plan.micro_batch % m == 0]
    if smaller:
        tries = [knob(f"algorithm.micro_batch_size: {m}", micro_batch=m) for m in smaller]
        knobs.append(next((k for k in tries if fits(k)), tries[-1]))
    if not plan.checkpointing:
        knobs.append(knob("training.activation_checkpointing: true", checkpointing=True))
    if not plan.offloading:
        knobs.append(knob("training.activation_offloading: true", offloading=True))
    if plan.members_per_gpu > 1:
        tries = [
            knob(f"launch.members_per_gpu: {k}", members_per_gpu=k)
            for k in range(plan.members_per_gpu - 1, 0, -1)
        ]
        knobs.append(next((k for k in tries if fits(k)), tries[-1]))
    if plan.members_per_batch > 1:
        tries = [
            knob(f"launch.members_per_batch: {k}", members_per_batch=k)
            for k in range(plan.members_per_batch - 1, 0, -1)
        ]
        knobs.append(next((k for k in tries if fits(k)), tries[-1]))
    if plan.vllm_share > 0.1:
        shares = [s / 20 for s in range(round(plan.vllm_share * 20) - 1, 1, -1)]
        tries = [knob(f"rollout.vllm.gpu_memory_utilization: {s:g}", vllm_share=s) for s in shares]
        if tries:
            knobs.append(next((k for k in tries if fits(k)), tries[-1]))
    if gpus:
        setting = f"distributed.fsdp: true, launch.gpus_per_member: {2 * gpus}"
        sharded = {"fsdp": True, "ranks": 2 * plan.ranks, "autocast": False}
        if plan.engine == "static":  # a sharded model cannot be captured
            setting, sharded["engine"] = f"{setting}, rollout.engine: hf", "hf"
        knobs.append(knob(setting, **sharded))
    if not plan.quantized and plan.engine != "vllm":  # vLLM would load its own unquantized copy
        knobs.append(knob("model.quantization: {quant_type: nf4} (QLoRA)", quantized=True))
    if smaller and not (plan.checkpointing and plan.offloading):
        setting = "algorithm.micro_batch_size: 1 with both activation knobs"
        knobs.append(knob(setting, micro_batch=1, checkpointing=True, offloading=True))
    now = estimate(shape, plan, gpu_bytes).per_gpu
    return [k for k in knobs if k.estimate.per_gpu < now]
