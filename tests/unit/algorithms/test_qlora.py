"""QLoRA: members on a 4-bit base (bitsandbytes' CPU backend). One member learns; 2-rank FSDP2
gives one rank's losses with half the base on each rank; a checkpoint moves from one rank to
two (data parallel), records the quantization and refuses another; ``export --merge`` gives
the model that was trained; library mode shares one quantized base; bad settings are named;
the memory estimate's terms hold for a 4-bit base."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import DRIVERS, small_sections

from pbt.config.errors import CheckpointError, ConfigError
from pbt.config.read.loader import manifest_from_dict

CPU = torch.device("cpu")
DRIVER = DRIVERS / "grpo_driver.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TOL = 2e-3
"""2-rank against 1-rank losses: the 4-bit layers compute in bfloat16, whose rounding differs
with the order of the sums (step 1 agrees to 1e-7; later steps to ~3e-4)."""
LEARN_QUANT = {
    "quant_type": "fp4",
    "compute_dtype": "float32",
    "double_quant": False,
    "storage_dtype": "uint8",
}
"""The learning test's options (the torchrun tests use the defaults: nf4, bfloat16 compute and
storage, double quantization); float32 compute makes the merged export exact."""


def _bitsandbytes_runs() -> str:
    """Why the QLoRA tests cannot run here ('' when they can)."""
    try:
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(64, 64, quant_type="nf4", quant_storage=torch.bfloat16)
        layer = layer.to("cpu")
        x = torch.randn(2, 64, requires_grad=True)
        layer(x).sum().backward()
    except Exception as err:  # not installed, or no backend for this machine
        return f"bitsandbytes cannot run a 4-bit layer here ({type(err).__name__}: {err})"
    return ""


pytestmark = pytest.mark.skipif(bool(_bitsandbytes_runs()), reason=_bitsandbytes_runs() or "-")


def _manifest(tmp_path: Path, quantization: dict | None, **more: dict):
    data = small_sections(tmp_path, **more)
    data["model"] = {**data["model"], "quantization": quantization}
    return manifest_from_dict(data, base_dir=tmp_path)


# -- one member -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def learned(tmp_path_factory: pytest.TempPathFactory):
    """A member on an fp4 base trained 12 steps of the letters task, saved."""
    from pbt.algorithms.runtime.member import Member

    tmp = tmp_path_factory.mktemp("qlora")
    manifest = _manifest(
        tmp,
        LEARN_QUANT,
        optim={"lr": 5e-3},
        algorithm={"group_size": 8, "prompts_per_step": 8},
        rollout={"max_output_tokens": 12},
        task={"name": "builtin:letters", "eval_size": 32},
    )
    member = Member(manifest, CPU)
    before = member.learner.evaluate(member.task.eval, member.task.reward)
    for _ in range(12):
        member.learner.train_step(member.task.train, member.task.reward)
    after = member.learner.evaluate(member.task.eval, member.task.reward)
    member.save(tmp / "ckpt")
    return member, before, after, tmp


def test_a_qlora_member_learns(learned):
    """The untrained adapter scores ~0.2 on the held-out letters; one letter repeated right
    scores 0.5. 12 steps must gain 0.15 (the unquantized base gains about 0.3)."""
    from bitsandbytes.nn import Linear4bit

    member, before, after, _ = learned
    layers = [m for m in member.model.modules() if isinstance(m, Linear4bit)]
    assert len(layers) == 7 * 2  # every projection of both blocks; the head stays as it is
    assert all(m.weight.dtype == torch.uint8 and m.weight.quant_type == "fp4" for m in layers)
    assert after > before + 0.15, (before, after)


def test_the_checkpoint_records_the_quantization_and_refuses_another(learned, tmp_path):
    from pbt.algorithms.runtime.checkpoint import load_checkpoint
    from pbt.algorithms.runtime.member import Member

    _, _, _, tmp = learned
    attrs = load_checkpoint(tmp / "ckpt")
    assert attrs["quantization"] == {"load_in_4bit": True, **LEARN_QUANT}
    from pbt.cli.checkpoints import inspect_text

    assert '  base quantization: {"load_in_4bit": true, "quant_type": "fp4"' in inspect_text(
        tmp / "ckpt"
    )
    plain = Member(_manifest(tmp, None), CPU)
    with pytest.raises(CheckpointError) as err:
        plain.load(tmp / "ckpt")
    text = str(err.value)
    assert "was trained on a 4-bit fp4 base (compute float32, storage uint8)" in text
    assert "this run loads an unquantized base" in text
    assert "set model.quantization to {load_in_4bit: true, quant_type: fp4," in text
    plain.save(tmp_path / "plain")
    other = Member(_manifest(tmp_path, {"quant_type": "nf4"}), CPU)
    with pytest.raises(CheckpointError, match="trained on an unquantized base, but this run"):
        other.load(tmp_path / "plain")
    with pytest.raises(CheckpointError, match=r"remove model\.quantization to resume it"):
        other.load(tmp_path / "plain")


def test_export_merge_gives_the_model_that_was_trained(learned, tmp_path):
    """Merged into the dequantized base, the adapter gives the quantized member's logits;
    merged into the original weights it would not (the 4-bit rounding is lost)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pbt.algorithms.builtin.tiny import tiny_model_dir
    from pbt.cli.checkpoints import export

    member, _, _, tmp = learned
    ids = member.tokenizer(["Write the letter q over and over."], return_tensors="pt")
    with torch.no_grad():
        trained = member.model(**ids).logits
    export(tmp / "ckpt", tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any(type(m).__name__ == "Linear4bit" for m in merged.modules())
    assert "quantization_config" not in json.loads((tmp_path / "merged/config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    naive = PeftModel.from_pretrained(base, tmp / "ckpt" / "adapter").merge_and_unload()
    with torch.no_grad():
        got, off = merged(**ids).logits, naive(**ids).logits
    torch.testing.assert_close(got, trained, atol=2e-4, rtol=1e-4)
    assert (off - trained).abs().max() > 50 * (got - trained).abs().max()


def test_library_mode_shares_one_quantized_base(tmp_path):
    from bitsandbytes.nn import Linear4bit

    from pbt.library.create import create_population

    sections = small_sections(tmp_path, population={"tournament_size": 2})
    sections["model"] = {**sections["model"], "quantization": {"quant_type": "nf4"}}
    pop = create_population(config=sections, population_size=2)
    for agent in pop:
        agent.train_step()
    shared = pop._shared()
    assert any(isinstance(m, Linear4bit) for m in shared.host.model.modules())
    assert set(shared.members) == {a.member_id for a in pop}
    memory = shared.memory_bytes()
    plain = create_population(
        config=small_sections(tmp_path / "p", population={"tournament_size": 2}), population_size=2
    )
    plain[0].train_step()
    assert memory["base"] < 0.75 * plain._shared().memory_bytes()["base"]


# -- ranks ------------------------------------------------------------------------------------


def _launch(out: Path, ranks: int, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(DRIVER)] if ranks == 1 else [TORCHRUN, "--nproc_per_node=2"]
    cmd += [] if ranks == 1 else ["--standalone", str(DRIVER)]
    cmd += [str(out), "--quantize", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _losses(out: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads(out.read_text())["losses"].items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One rank and 2-rank FSDP2, four steps each, checkpoints after step 2; then one rank's
    checkpoint resumed on two ranks, data parallel."""
    d = tmp_path_factory.mktemp("qdist")
    _launch(d / "one.json", 1, "--steps", "4", "--save-at", "2", str(d / "ckpt-one"))
    _launch(d / "fsdp.json", 2, "--steps", "4", "--fsdp", "--save-at", "2", str(d / "ckpt-fsdp"))
    _launch(d / "one-on-dp.json", 2, "--steps", "4", "--load", str(d / "ckpt-one"))
    return d


@pytest.mark.integration
def test_fsdp2_qlora_gives_one_ranks_losses(runs: Path):
    one, two = _losses(runs / "one.json"), _losses(runs / "fsdp.json")
    assert one.keys() == two.keys() == {1, 2, 3, 4}
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=TOL), step
    a, b = torch.load(runs / "one.json.pt"), torch.load(runs / "fsdp.json.pt")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-2, atol=2e-3)
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)
    # each rank holds half of the base, the packed 4-bit weights included
    held = {name: json.loads((runs / f"{name}.json").read_text())["base_bytes"] for name in
            ("one", "fsdp")}  # fmt: skip
    assert held["fsdp"] == pytest.approx(held["one"] / 2, rel=0.01)


@pytest.mark.integration
def test_qlora_checkpoints_move_between_world_sizes(runs: Path):
    from pbt.algorithms.runtime.checkpoint import load_checkpoint

    got, want = _losses(runs / "one-on-dp.json"), _losses(runs / "one.json")
    assert got.keys() == {3, 4}
    for step in got:
        assert got[step] == pytest.approx(want[step], abs=TOL), step
    a, b = load_checkpoint(runs / "ckpt-one"), load_checkpoint(runs / "ckpt-fsdp")
    assert (a["world_size"], b["world_size"]) == (1, 2)
    assert a["quantization"] == b["quantization"]
    assert a["quantization"]["quant_type"] == "nf4" and a["quantization"]["double_quant"]


# -- settings ---------------------------------------------------------------------------------


def test_quantization_settings_are_checked(tmp_path):
    bad = {
        "load_in_4bit": False,
        "quant_type": "nf3",
        "compute_dtype": "int8",
        "double_quant": "yes",
        "storage_dtype": "float8",
    }
    with pytest.raises(ConfigError) as err:
        _manifest(tmp_path, bad)
    text = str(err.value)
    assert "model.quantization.load_in_4bit (False) must be true" in text
    assert "remove the quantization section" in text
    assert "model.quantization.quant_type ('nf3') must be one of 'nf4', 'fp4'" in text
    assert "model.quantization.compute_dtype ('int8') must be one of 'bfloat16'" in text
    assert "model.quantization.double_quant ('yes') must be true or false" in text
    assert "model.quantization.storage_dtype ('float8') must be one of" in text
    with pytest.raises(ConfigError, match=r"model\.quantization\.quant_typ is not a known key"):
        _manifest(tmp_path, {"quant_typ": "nf4"})
    fsdp = {"distributed": {"fsdp": True}}
    with pytest.raises(ConfigError, match=r"storage_dtype \('uint8'\) must be 'bfloat16' with"):
        _manifest(tmp_path, {"storage_dtype": "uint8"}, **fsdp)
    with pytest.raises(ConfigError, match=r"rollout\.engine is 'vllm'"):
        _manifest(tmp_path, {}, rollout={"engine": "vllm"})
    manifest = _manifest(tmp_path, {})  # every default
    assert manifest.model.quantization.quant_type == "nf4"
    assert _manifest(tmp_path, None).model.quantization is None
    # what the memory estimate takes from it
    from pbt.estimate.memory import plan_from_manifest

    plan = plan_from_manifest(_manifest(tmp_path, {"compute_dtype": "float32"}))
    assert (plan.quantized, plan.double_quant, plan.compute_bytes) == (True, True, 4)
    assert not plan_from_manifest(_manifest(tmp_path, None)).quantized


def test_quantization_without_bitsandbytes_says_what_to_install(tmp_path, monkeypatch):
    from pbt.algorithms.runtime.models import bnb_config

    manifest = _manifest(tmp_path, {})
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what an absent package looks like
    with pytest.raises(ConfigError, match=r"pip install 'pbt-llm\[quant\]'"):
        _manifest(tmp_path, {})
    with pytest.raises(ConfigError, match=r"bitsandbytes, which is not installed"):
        bnb_config(manifest.model.quantization)


# -- the memory estimate and the bench --------------------------------------------------------


def test_quantizing_in_memory_gives_what_model_quantization_loads():
    """``quantize_blocks`` (what bench/activation_memory.py uses) quantizes a model built in
    memory in place; the layers and their 4-bit bytes are those ``model.quantization`` gives
    through ``from_pretrained``."""
    from bitsandbytes.nn import Linear4bit

    from pbt.algorithms.runtime.models import load_base_model, quantize_blocks
    from pbt.config import ModelConfig, QuantizationConfig

    loaded = load_base_model(ModelConfig(quantization=QuantizationConfig()), CPU)
    built = load_base_model(ModelConfig(), CPU)
    assert quantize_blocks(built, CPU) == 14
    ours = {n: m for n, m in built.named_modules() if isinstance(m, Linear4bit)}
    theirs = {n: m for n, m in loaded.named_modules() if isinstance(m, Linear4bit)}
    assert ours.keys() == theirs.keys()
    for name, module in ours.items():
        packed = module.weight.data.view(torch.uint8)  # the bytes: as bfloat16 some are NaN
        assert torch.equal(packed, theirs[name].weight.data.view(torch.uint8)), name
        assert module.weight.quant_state.nested and module.weight.quant_type == "nf4"


def _batch(vocab: int):
    """Two sequences of 8 prompt and 16 completion tokens."""
    from pbt.algorithms.rollout.hf import RolloutBatch

    ids = torch.randint(vocab, (2, 24))
    return RolloutBatch(ids[:, :8], torch.ones(2, 8, dtype=torch.long), ids[:, 8:],
                        torch.ones(2, 16), ["", ""])  # fmt: skip


def _saved_bytes(model, batch, autocast: bool) -> int:
    """Bytes of the distinct storages one forward saves for backward, parameters apart."""
    import contextlib

    from pbt.algorithms.rollout.hf import sequence_logprobs

    storages: dict[int, int] = {}

    def pack(t):
        if not isinstance(t._base if t._base is not None else t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cast = torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        sequence_logprobs(model, batch, 1.0)
    return sum(storages.values())


@pytest.mark.parametrize("autocast", [False, True])
def test_the_activation_term_holds_on_a_4bit_base(autocast: bool):
    """A 4-bit layer's matmul saves no activation of its own (its weight is frozen): on the
    CPU, a block of a quantized base saves exactly what :func:`layer_bytes` says, as a plain
    one does (tests/unit/estimate/test_memory_estimate.py)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from pbt.algorithms.runtime.models import add_lora, quantize_blocks
    from pbt.config import LoRAConfig
    from pbt.estimate.memory import Plan, adapter_params, layer_bytes
    from pbt.estimate.model_shape import shape_from_config

    config = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False,
    }  # fmt: skip

    def saved(layers: int) -> int:
        torch.manual_seed(0)
        dtype = torch.bfloat16 if autocast else torch.float32
        qwen = Qwen2Config(num_hidden_layers=layers, **config)
        base = AutoModelForCausalLM.from_config(qwen, dtype=dtype).requires_grad_(False)
        quantize_blocks(base, CPU)
        model = add_lora(base, LoRAConfig(r=8)).train()
        return _saved_bytes(model, _batch(128), autocast)

    shape = shape_from_config({"model_type": "qwen2", "num_hidden_layers": 2, **config}, "t")
    plan = Plan(
        weight_bytes=2 if autocast else 4,
        autocast=autocast,
        lora_r=8,
        quantized=True,
        generic_lora_on_4bit=True,  # the bench's in-place quantization
    )
    casts = 2 * adapter_params(shape, plan) // shape.layers if autocast else 0
    assert saved(3) - saved(2) == layer_bytes(shape, plan) * 2 * 24 + casts


def test_offloading_moves_the_same_tensors_on_a_4bit_base():
    """What the offloading hooks see of a 4-bit layer: bitsandbytes' matmul keeps its packed
    weight on its autograd context, not through ``save_for_backward``, so the hooks offload
    on a quantized base exactly the storages they offload on a half one (the adapters'), and
    never a 4-bit weight or its dequantized copy (as the H200 run's 46.96 GiB offloaded a
    step in both modes shows)."""
    from bitsandbytes.nn import Params4bit
    from transformers import AutoModelForCausalLM, Qwen2Config

    from pbt.algorithms.rollout.hf import sequence_logprobs
    from pbt.algorithms.runtime.activations import ActivationOffload
    from pbt.algorithms.runtime.models import add_lora, quantize_blocks
    from pbt.config import LoRAConfig

    config = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False,
        "num_hidden_layers": 2,
    }  # fmt: skip

    def offloaded(quantized: bool) -> tuple[int, list[tuple[str, tuple[int, ...]]]]:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(Qwen2Config(**config), dtype=torch.bfloat16)
        base.requires_grad_(False)
        if quantized:
            quantize_blocks(base, CPU)
        model = add_lora(base, LoRAConfig(r=8)).train()
        offload = ActivationOffload(CPU, min_bytes=1)
        seen = []
        pack = offload._pack

        def watch(tensor: torch.Tensor):
            packed = pack(tensor)
            if packed is not tensor:
                assert not isinstance(tensor, Params4bit)
                assert not isinstance(tensor._base, Params4bit)
                seen.append((str(tensor.dtype), tuple(tensor.shape)))
            return packed

        offload._pack = watch
        offload.install(model)
        with torch.autocast("cpu", torch.bfloat16):
            sequence_logprobs(model, _batch(128), 1.0)
        return offload.offloaded_bytes, sorted(seen)

    half, quantized = offloaded(False), offloaded(True)
    assert half[0] > 0 and quantized == half


def test_a_member_on_a_4bit_base_shares_the_adapters_inputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A base loaded with ``model.quantization`` gets peft's 4-bit LoRA layer, which under
    CUDA's autocast passes the adapters its half input as it is (the generic layer, on a half
    base or after the bench's in-place quantization, casts a copy for each projection): a
    block saves what :func:`layer_bytes` counts for shared inputs. The layer asks
    ``torch.is_autocast_enabled()``, CUDA's; here it is told the CPU's autocast, which runs the
    same step on this machine."""
    from pbt.algorithms.builtin.tiny import build_shaped_model
    from pbt.algorithms.runtime.models import add_lora, load_base_model
    from pbt.config import LoRAConfig, ModelConfig, QuantizationConfig
    from pbt.estimate.memory import Plan, adapter_params, layer_bytes
    from pbt.estimate.model_shape import shape_from_config

    cpu_autocast = torch.is_autocast_enabled
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: cpu_autocast(*(a or ("cpu",))))
    shape_kw = {"hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip

    def saved(layers: int) -> tuple[int, dict]:
        folder = build_shaped_model(tmp_path / f"m{layers}", num_hidden_layers=layers, **shape_kw)
        config = ModelConfig(name=str(folder), quantization=QuantizationConfig(), dtype="bfloat16")
        base = load_base_model(config, CPU)
        model = add_lora(base, LoRAConfig(r=8)).train()
        assert type(model.base_model.model.model.layers[0].mlp.down_proj).__module__ == (
            "peft.tuners.lora.bnb"
        )
        torch.manual_seed(0)
        bytes_ = _saved_bytes(model, _batch(100), autocast=True)
        return bytes_, base.config.to_dict()

    (two, config), (three, _) = saved(2), saved(3)
    shape = shape_from_config(config, "m")
    plan = Plan(lora_r=8, quantized=True)  # bf16 base, mixed precision: peft's 4-bit layer
    casts = 2 * adapter_params(shape, plan) // shape.layers  # the adapters' bf16 copies
    assert three - two == layer_bytes(shape, plan) * 2 * 24 + casts
    copies = layer_bytes(shape, Plan(lora_r=8, quantized=True, generic_lora_on_4bit=True))
    assert copies > layer_bytes(shape, plan)
