"""AgileRL's agents as its multi-GPU page builds them: ``GRPO(model_name=..., pad_token_id=...,
pad_token=..., vllm_config=VLLMConfig())`` in a script under ``torchrun --nproc_per_node=2``
(data parallel), the same with ``fsdp_config`` (FSDP2) and ``GRPO.population(size=4, ...)``,
the import paths of docs/agilerl.md, and every constructor of the family.

The torchrun scripts are tests/drivers/agilerl_agent_driver.py, one launch each for data
parallel and FSDP2. Only the data-parallel one passes ``VLLMConfig()``: where vLLM is installed
(CI) that launch is a vLLM run, and one vLLM launch here is enough (vLLM under FSDP2 is
tests/integration/test_vllm.py's); where it is not, the agent samples with ``generate``, with one warning.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from support import DRIVERS, REPO, vllm_cache

from pbt.algorithms import (
    CISPO,
    DPO,
    GRPO,
    GSPO,
    LLMPPO,
    LLMREINFORCE,
    SFT,
    LLMReinforce,
    VLLMConfig,
)
from pbt.config.errors import ConfigError
from pbt.library.population import Agent

DRIVER = DRIVERS / "agilerl_agent_driver.py"
PAGE = REPO / "docs" / "agilerl.md"
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


# -- imports ---------------------------------------------------------------------------------


def _import_table() -> list[tuple[str, str]]:
    """The rows of the page's import table: (AgileRL's statement, ours)."""
    section = PAGE.read_text().split("## Imports", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(from agilerl[^`]*)` \| `(from pbt[^`]*)` \|$", section, re.M)


def test_every_row_of_the_import_table_imports():
    """Each right-hand statement runs, in a fresh interpreter, and binds the names the
    left-hand one binds (``agilerl.x`` -> ``pbt.y``, the same names)."""
    rows = _import_table()
    assert len(rows) >= 12, rows
    for theirs, ours in rows:
        assert theirs.split(" import ")[1] == ours.split(" import ")[1], (theirs, ours)
    code = "\n".join(ours for _, ours in rows) + "\nprint('ok')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_page_imports_load_no_torch_until_an_agent_is_used():
    code = (
        "import sys, warnings\n"
        "warnings.simplefilter('ignore')\n"
        "from pbt.algorithms import GRPO, CISPO, GSPO, LLMPPO, LLMReinforce, SFT, DPO, VLLMConfig\n"
        "from pbt.distributed import FSDPConfig\n"
        "agent = GRPO(model_name='builtin:tiny', pad_token_id=0, pad_token='<|endoftext|>',\n"
        "             vllm_config=VLLMConfig(), fsdp_config=FSDPConfig())\n"
        "pop = GRPO.population(size=4, fsdp_config=FSDPConfig(), lr=1e-4)\n"
        "assert isinstance(agent, GRPO) and all(isinstance(a, GRPO) for a in pop)\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


# -- constructors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "name", "loss"),
    [
        (GRPO, "GRPO", "grpo"),
        (CISPO, "GRPO", "cispo"),
        (GSPO, "GRPO", "gspo"),
        (LLMPPO, "PPO", "grpo"),
        (LLMReinforce, "REINFORCE", "grpo"),
        (LLMREINFORCE, "REINFORCE", "grpo"),
        (SFT, "SFT", "grpo"),
        (DPO, "DPO", "grpo"),
    ],
)
def test_each_constructor_builds_one_agent_of_its_class(cls, name, loss):
    agent = cls(model_name="builtin:tiny", pad_token_id=0, lr=2e-4)
    manifest = agent.population.manifest
    assert type(agent) is cls and isinstance(agent, Agent)
    assert (manifest.algorithm.name, manifest.algorithm.loss) == (name, loss)
    assert list(agent.population) == [agent] and manifest.optim.lr == 2e-4
    assert manifest.model.pad_token_id == 0
    population = cls.population(size=3, lr=2e-4)
    assert [type(a) for a in population] == [cls] * 3
    assert population.manifest.algorithm.name == name


def test_cispo_and_gspo_are_grpo_as_in_agilerl():
    assert isinstance(CISPO(), GRPO) and isinstance(GSPO(), GRPO)
    assert DPO().population.manifest.algorithm.beta == 0.1  # AgileRL's default; ours is 0
    with pytest.raises(ConfigError, match=r"algorithm.loss \('dapo'\) contradicts GSPO"):
        GSPO(config={"algorithm": {"loss": "dapo"}})


def test_constructor_reads_agilerl_keywords_in_either_case():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        agent = GRPO(
            model_name="builtin:tiny",
            LR=3e-4,
            group_size=4,
            beta=0.02,
            batch_size=6,
            max_output_tokens=12,
            temperature=0.8,
            top_k=20,
            seed=7,
            lora_config={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
            gradient_checkpointing=True,
            device="cpu",
            calc_position_embeddings=True,
            accelerator=object(),
            index=3,
        )
    m = agent.population.manifest
    assert (m.optim.lr, m.algorithm.group_size, m.algorithm.beta) == (3e-4, 4, 0.02)
    assert (m.algorithm.prompts_per_step, m.rollout.max_output_tokens) == (6, 12)
    assert (m.rollout.temperature, m.rollout.top_k, m.training.seed) == (0.8, 20, 7)
    assert (m.lora.r, m.lora.alpha, m.training.activation_checkpointing) == (4, 8, True)
    assert m.training.device == "cpu"
    no_effect = [str(w.message) for w in caught if "has no effect here" in str(w.message)]
    assert len(no_effect) == 3, no_effect  # one each: calc_position_embeddings, accelerator, index
    for key in ("calc_position_embeddings=True", "accelerator=", "index=3"):
        assert sum(key in line for line in no_effect) == 1, key


def test_refused_and_unknown_keywords_are_reported_together():
    with pytest.raises(ConfigError) as err:
        GRPO(min_p=0.05, repetition_penalty=1.2, lrr=1e-4, actor_network=object())
    text = str(err.value)
    assert "GRPO(min_p=0.05) is not supported" in text
    assert "GRPO(repetition_penalty=1.2) is not supported" in text
    assert "INIT_HP.LRR is not a known key; did you mean 'LR'?" in text
    assert "GRPO(actor_network=<object object" in text


# -- VLLMConfig ------------------------------------------------------------------------------


def test_vllm_config_maps_onto_the_rollout_section():
    config = VLLMConfig(
        gpu_memory_utilization=0.5,
        max_num_seqs=16,
        enforce_eager=True,
        max_num_batched_tokens=512,
        max_loras=4,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        agent = GRPO(model_name="builtin:tiny", vllm_config=config)
    rollout = agent.population.manifest.rollout
    assert (rollout.vllm.gpu_memory_utilization, rollout.vllm.max_num_seqs) == (0.5, 16)
    assert rollout.vllm.enforce_eager is True and rollout.vllm.sleep_mode is False
    assert rollout.vllm.engine_kwargs == {"max_num_batched_tokens": 512}
    lines = [str(w.message) for w in caught]
    assert sum("vllm_config.max_loras=4) has no effect here" in line for line in lines) == 1
    install = [line for line in lines if "pip install 'pbt-llm[vllm]'" in line]
    if VLLM_INSTALLED:
        assert rollout.engine == "vllm" and not install
    else:  # the snippet still runs: generate, with one warning naming the install
        assert rollout.engine == "hf" and len(install) == 1, lines
        assert "vLLM is not installed" in install[0]


def test_vllm_config_fields_that_would_change_training_are_refused():
    with pytest.raises(ConfigError) as err:
        GRPO(vllm_config=VLLMConfig(stop_sequences=["</answer>"], presence_penalty=0.5))
    text = str(err.value)
    assert "GRPO(vllm_config.stop_sequences=['</answer>']) is not supported" in text
    assert "GRPO(vllm_config.presence_penalty=0.5) is not supported" in text
    with pytest.raises(ConfigError, match=r"vllm_config.swap_space\) is not a field"):
        GRPO(vllm_config={"swap_space": 4})


# -- one process -----------------------------------------------------------------------------


def test_one_agent_samples_learns_tests_saves_and_clones_in_one_process(tmp_path):
    agent = CISPO(
        model_name="builtin:tiny",
        group_size=4,
        batch_size=2,
        max_output_tokens=6,
        lr=1e-2,
        config={"task": {"eval_size": 4}},
    )
    prompts = agent.sample_prompts()
    batch = agent.get_action(prompts)
    assert len(batch.texts) == 2 * 4 and batch.completion_ids.shape[0] == 8
    metrics = agent.learn((batch, agent.reward(prompts, batch)))
    assert agent.steps == 1 and {"loss", "kl", "grad_norm"} <= set(metrics)
    fitness = agent.test()
    assert agent.fitness == [fitness]
    agent.save_checkpoint(tmp_path / "ck")
    attributes = torch.load(tmp_path / "ck" / "attributes.pt", weights_only=True)
    assert attributes["algorithm"] == "GRPO" and attributes["step"] == 1
    clone = agent.clone()
    assert type(clone) is CISPO and clone.steps == 1 and clone.fitness == [fitness]
    other = CISPO(model_name="builtin:tiny", group_size=4, batch_size=2, max_output_tokens=6)
    other.load_checkpoint(tmp_path / "ck")
    assert other.steps == 1 and other.fitness == [fitness]


def test_a_sharded_agent_outside_torchrun_fails_at_first_use_with_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from pbt.algorithms import GRPO\n"
        "from pbt.distributed import FSDPConfig\n"
        "fsdp_config = FSDPConfig(reshard_after_forward=True, cpu_offload=False,\n"
        "                         optim_cpu_offload=True, defer_grad_sync=True)\n"
        "agent = GRPO(model_name='builtin:tiny', fsdp_config=fsdp_config)\n"
        "print('built')\n"
        "agent.get_action(['Write the letter a.'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert out.returncode == 1 and out.stdout.strip() == "built"
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("pbt.config.errors.PbtError: fsdp_config"), out.stderr[-2000:]
    assert "launch the script with torchrun" in last and "drop fsdp_config" in last


# -- torchrun --------------------------------------------------------------------------------


def _launch(out: Path, mode: str) -> subprocess.CompletedProcess:
    """The driver under ``torchrun --nproc_per_node=2`` on the CPU (gloo), vLLM's files kept
    inside ``out``."""
    (out / "tmp").mkdir(parents=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VLLM_CACHE_ROOT": vllm_cache(),
        "VLLM_NO_USAGE_STATS": "1",
        "TMPDIR": str(out / "tmp"),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone"]
    proc = subprocess.run(
        [*cmd, str(DRIVER), str(out), mode], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _ranks(out: Path) -> tuple[list[dict], list[dict[str, torch.Tensor]]]:
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    adapters = [torch.load(out / f"adapter.rank{r}.pt", weights_only=True) for r in (0, 1)]
    return seen, adapters


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("agilerl-dp")
    _launch(out, "dp")
    return out


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("agilerl-fsdp")
    _launch(out, "fsdp")
    return out


def _check_trained_and_saved(out: Path) -> None:
    """Both ranks trained two steps on prompts of their own, hold the same adapter (their
    gradients were averaged), moved from the initial one, and that adapter is the checkpoint's."""
    seen, adapters = _ranks(out)
    assert [s["steps"] for s in seen] == [2, 2] and {s["class"] for s in seen} == {"GRPO"}
    assert seen[0]["prompts"] != seen[1]["prompts"]  # each rank sampled its own share
    assert adapters[0].keys() == adapters[1].keys()
    for name in adapters[0]:
        assert torch.equal(adapters[0][name], adapters[1][name]), name
    assert any("lora_B" in n and adapters[0][n].abs().sum() > 0 for n in adapters[0])
    attributes = torch.load(out / "ckpt" / "attributes.pt", weights_only=True)
    assert attributes["algorithm"] == "GRPO" and attributes["step"] == 2
    assert attributes["trainable"].keys() == adapters[0].keys()
    for name, tensor in attributes["trainable"].items():
        assert torch.equal(tensor, adapters[0][name]), name
    assert (out / "ckpt" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.integration
def test_page_agent_trains_data_parallel_under_torchrun(data_parallel):
    _check_trained_and_saved(data_parallel)
    seen, _ = _ranks(data_parallel)
    assert not any(s["sharded"] for s in seen)
    assert {s["engine"] for s in seen} == {"vllm" if VLLM_INSTALLED else "hf"}


@pytest.mark.integration
def test_page_agent_trains_sharded_under_torchrun(sharded):
    _check_trained_and_saved(sharded)
    seen, _ = _ranks(sharded)
    assert all(s["sharded"] for s in seen)


@pytest.mark.integration
def test_page_population_of_four_is_sharded_grpo_agents(sharded):
    seen, _ = _ranks(sharded)
    for rank in seen:
        population = rank["population"]
        assert population["classes"] == ["GRPO"] * 4 and population["sharded"]
        assert population["members"] == [f"g000-m{i:02d}" for i in range(4)]
        assert population["last"]["steps"] == 1 and population["untrained_steps"] == 0
    assert seen[0]["population"]["last"]["prompts"] != seen[1]["population"]["last"]["prompts"]
