"""The built-in tiny model: builds once, loads like a real model, and is cache- and rank-safe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pbt.algorithms.builtin.tiny import (
    HEAD_INIT_STD,
    MARKER,
    TINY_VERSION,
    build_tiny_model,
    tiny_model_dir,
)

TEXTS = [
    "12345 + 678 = 13023",
    "café naïve",
    "Tom has 3 apples and buys 5 more. How many apples does he have? 8",
    "a a a bbbb  two spaces   three\n\nnewlines\r\n\ttab  ",
    "Ünïcödé 日本語 🙂 ß",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("cache"))


def test_loads_as_qwen2(tiny_dir: Path) -> None:
    assert tiny_dir.name == f"tiny-qwen2-v{TINY_VERSION}"
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    config = model.config
    assert config.model_type == "qwen2"
    assert model.model.layers[0].self_attn.head_dim == 32
    # an untied head with logits of std ~1, so an adapter can sharpen the distribution
    assert not config.tie_word_embeddings
    assert model.lm_head.weight.std().item() == pytest.approx(HEAD_INIT_STD, rel=0.05)
    assert config.vocab_size % 64 == 0
    assert config.vocab_size >= len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert config.eos_token_id == tokenizer.eos_token_id
    assert config.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert AutoConfig.from_pretrained(tiny_dir).model_type == "qwen2"


@pytest.mark.parametrize("text", TEXTS)
def test_raw_and_auto_tokenizers_agree(tiny_dir: Path, text: str) -> None:
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tokenizer(text)["input_ids"]
    assert ids == raw.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert raw.decode(ids, skip_special_tokens=False) == text


def test_both_tokenizers_normalize_to_nfc(tiny_dir: Path) -> None:
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    decomposed, composed = "cafe\u0301 nai\u0308ve", "café naïve"
    ids = tokenizer(decomposed)["input_ids"]
    assert ids == raw.encode(decomposed).ids == tokenizer(composed)["input_ids"]
    assert tokenizer.decode(ids) == composed


def test_special_tokens_are_single_ids(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tokenizer(token)["input_ids"] == [tokenizer.convert_tokens_to_ids(token)]


def test_chat_template(tiny_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt == "<|im_start|>user\nhi<|im_end|>\n"


def test_generates(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "user", "content": "Repeat the letter a 3 times."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=5)
    prompt_len = inputs["input_ids"].shape[1]
    assert prompt_len < out.shape[1] <= prompt_len + 5
    assert torch.equal(out[0, :prompt_len], inputs["input_ids"][0])
    assert int(out.max()) < model.config.vocab_size


def test_cached_folder_is_reused_and_incomplete_one_rebuilt(tmp_path: Path) -> None:
    folder = tiny_model_dir(tmp_path)
    marker = folder / MARKER
    mtime = marker.stat().st_mtime_ns
    assert tiny_model_dir(tmp_path) == folder
    assert marker.stat().st_mtime_ns == mtime

    marker.unlink()
    (folder / "model.safetensors").unlink()
    assert tiny_model_dir(tmp_path) == folder
    assert marker.is_file()
    assert (folder / "model.safetensors").is_file()
    assert AutoModelForCausalLM.from_pretrained(folder).config.model_type == "qwen2"
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [folder.name]


def test_default_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBT_CACHE_DIR", str(tmp_path / "env-cache"))
    folder = tiny_model_dir()
    assert folder == tmp_path / "env-cache" / f"tiny-qwen2-v{TINY_VERSION}"
    assert (folder / MARKER).is_file()


@pytest.mark.integration
def test_concurrent_callers_share_one_folder(tmp_path: Path) -> None:
    cache = tmp_path / "shared"
    code = "import sys; from pbt.algorithms.builtin.tiny import tiny_model_dir; print(tiny_model_dir(sys.argv[1]))"
    env = {k: v for k, v in os.environ.items() if k != "PBT_CACHE_DIR"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    results = [proc.communicate(timeout=120) for proc in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
    paths = {Path(out.strip().splitlines()[-1]) for out, _ in results}
    assert paths == {cache / f"tiny-qwen2-v{TINY_VERSION}"}
    folder = paths.pop()
    assert (folder / MARKER).is_file()
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [folder.name]
    AutoTokenizer.from_pretrained(folder)
    AutoModelForCausalLM.from_pretrained(folder)


def test_same_seed_builds_identical_files(tiny_dir: Path, tmp_path: Path) -> None:
    rng_before = torch.random.get_rng_state()
    build_tiny_model(tmp_path / "again", seed=0)
    assert torch.equal(torch.random.get_rng_state(), rng_before)

    first = load_file(tiny_dir / "model.safetensors")
    second = load_file(tmp_path / "again" / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    tokenizer_json = (tiny_dir / "tokenizer.json").read_bytes()
    assert tokenizer_json == (tmp_path / "again" / "tokenizer.json").read_bytes()
