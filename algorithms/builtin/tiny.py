"""The built-in tiny model: a random-weight Qwen2-architecture causal LM with its own tokenizer.

``builtin:tiny`` needs no download: it is built once into an ordinary Hugging Face folder that
loads through ``AutoModelForCausalLM`` and ``AutoTokenizer`` exactly like a real model. Its
byte-level BPE is trained with the normalizer and pre-tokenizer that transformers'
``Qwen2Tokenizer`` installs, so ``tokenizer.json`` and ``AutoTokenizer`` give the same ids.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pbt.config.sections.model import BUILTIN_MODEL, BUILTIN_MODEL_ARCHITECTURE
from pbt.protocol.files import COMPLETE, build_once

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

TINY_MODEL_ID = BUILTIN_MODEL
TINY_VERSION = 2
"""Bump when the recipe changes; part of the cache folder name."""

MARKER = COMPLETE
"""Written last into a finished folder; a folder without it is incomplete."""

VOCAB_SIZE = BUILTIN_MODEL_ARCHITECTURE["vocab_size"]
HEAD_INIT_STD = 0.09
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORD_TEXT = (
    "the a an and or but of to in on at for with as is are was were be has have had do does "
    "did will can say said write wrote repeat letter letters word words number numbers time "
    "times many much more less how what which who answer question please count total each "
    "apple apples book books cat cats dog dogs pen pens cookie cookies ball balls car cars "
    "friend friends day days good great small big new old first last long little right left "
    "user assistant system hello hi yes no thank you we they he she it this that there here "
    "again once twice make made give gave take took buy buys bought sell sells eat eats café "
    "naïve über résumé year years school house water tree trees bird birds sun moon "
    "red blue green happy quickly slowly because after before morning evening garden "
    "story stories people children teacher student window kitchen river mountain city "
    "walk walks walked run runs play plays played read reads find found think thought "
    "between under over every some any other another number plus minus times equals"
)
_WORDS = _WORD_TEXT.split()
_NAMES = ("Tom", "Anna", "Sam", "Mia", "Ben", "Lily", "Max", "Zoe", "Leo", "Emma")
_ITEMS = ("apples", "books", "pens", "cookies", "marbles", "cards", "stickers", "balls")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"

logger = logging.getLogger(__name__)


def is_complete(folder: Path) -> bool:
    """Return whether ``folder`` holds a finished build (its marker file exists)."""
    return (folder / MARKER).is_file()


def tiny_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Return the folder of the built-in tiny model, building it once if missing.

    Safe to call from several processes at once (e.g. torchrun ranks): one builds it, the
    others wait and then find the finished folder (:func:`~pbt.protocol.files.build_once`);
    a folder without its ``.complete`` marker (an interrupted build) is rebuilt.

    Args:
        cache_dir: The cache root; default ``$PBT_CACHE_DIR`` if set, else ``~/.cache/pbt-llm``.

    Returns:
        The folder ``<cache_dir>/tiny-qwen2-v{TINY_VERSION}``, complete and loadable.
    """
    if cache_dir is None:
        cache_dir = os.environ.get("PBT_CACHE_DIR") or Path.home() / ".cache" / "pbt-llm"
    root = Path(cache_dir).expanduser()
    folder = root / f"tiny-qwen2-v{TINY_VERSION}"
    return build_once(folder, build_tiny_model)


def build_tiny_model(out_dir: str | Path, seed: int = 0) -> None:
    """Build the tokenizer and the random-weight model into ``out_dir``.

    The result is deterministic for a given seed. The global torch RNG state is restored
    afterwards, so callers' random streams are untouched. The marker file is written last.

    Args:
        out_dir: The folder to write; created if missing.
        seed: Seeds both the training corpus and the weight initialisation.
    """
    import torch

    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _save_tokenizer(_train_tokenizer(seed), out)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        _save_model(tokenizer, out)
    finally:
        torch.random.set_rng_state(rng_state)
    (out / MARKER).write_text(f"{TINY_MODEL_ID} v{TINY_VERSION} seed {seed}\n")
    logger.info("built %s into %s in %.1fs", TINY_MODEL_ID, out, time.perf_counter() - start)


def _corpus(seed: int, lines: int = 4000) -> Iterator[str]:
    """Yield a deterministic corpus of sentences, letter runs, numbers and word problems."""
    rng = random.Random(seed)
    makers = (_sentence, _letter_run, _letter_task, _arithmetic, _word_problem)
    for _ in range(lines):
        yield rng.choice(makers)(rng)


def _sentence(rng: random.Random) -> str:
    words = rng.choices(_WORDS, k=rng.randint(3, 12))
    return " ".join(words).capitalize() + rng.choice((".", "?", "!", ",\n"))


def _letter_run(rng: random.Random) -> str:
    letter, count = rng.choice(_LETTERS), rng.randint(1, 12)
    return rng.choice((" ", "")).join([letter] * count)


def _letter_task(rng: random.Random) -> str:
    letter, count = rng.choice(_LETTERS), rng.randint(1, 9)
    verb = rng.choice(("Repeat", "Write", "Say"))
    answer = " ".join([letter] * count)
    return f"{verb} the letter {letter} as many times as {count}.\n{answer}"


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 99999), rng.randint(0, 9999)
    op, result = rng.choice((("+", a + b), ("-", a - b), ("*", a * b)))
    return f"{a} {op} {b} = {result}"


def _word_problem(rng: random.Random) -> str:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now? {a + b}"


def _train_tokenizer(seed: int) -> Tokenizer:
    """Train a byte-level BPE with the Qwen2 normalizer, pre-tokenizer and decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    return tokenizer


def _save_tokenizer(raw: Tokenizer, out: Path) -> PreTrainedTokenizerBase:
    """Wrap the trained tokenizer for transformers, save it and return the wrapper."""
    from transformers import Qwen2TokenizerFast

    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=raw,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        model_max_length=512,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(out, save_jinja_files=False)
    return tokenizer


def build_shaped_model(out_dir: str | Path, seed: int = 0, **shape: object) -> Path:
    """A random-weight Qwen2 model of another shape (``hidden_size=512``, ``num_hidden_layers=4``,
    ...) with the tiny model's tokenizer, written into ``out_dir`` as an ordinary model folder.

    For measurements that need a bigger model than ``builtin:tiny`` without a download. The
    global torch RNG state is restored afterwards.
    """
    import torch
    from transformers import AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = tiny_model_dir()
    for item in source.iterdir():
        if item.name.startswith("tokenizer") or item.name in ("special_tokens_map.json",):
            shutil.copy(item, out / item.name)
    tokenizer = AutoTokenizer.from_pretrained(out)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        _save_model(tokenizer, out, **shape)
    finally:
        torch.random.set_rng_state(rng_state)
    return out


def _save_model(tokenizer: PreTrainedTokenizerBase, out: Path, **shape: object) -> None:
    """Initialise the random-weight Qwen2 model for ``tokenizer`` and save it to ``out``.

    ``shape`` overrides the tiny model's config fields."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    from pbt.algorithms.runtime.checkpoint import save_weights

    eos_id, pad_id = tokenizer.convert_tokens_to_ids([EOS_TOKEN, PAD_TOKEN])
    architecture = {k: v for k, v in BUILTIN_MODEL_ARCHITECTURE.items() if k != "model_type"}
    fields = dict(
        architecture,
        vocab_size=-(-len(tokenizer) // 64) * 64,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    fields.update(shape)
    fields.setdefault("max_window_layers", fields["num_hidden_layers"])
    config = Qwen2Config(**fields)
    model = AutoModelForCausalLM.from_config(config)
    # A random output head with the default std (0.02) gives logits so flat that no adapter can
    # make any token likelier than ~1%; std 0.09 gives logits of std ~1 over the vocabulary, like a
    # trained model's, so the distribution can be sharpened. Untied, so input embeddings keep
    # their small scale (scaled tied embeddings make the model echo its last input token).
    torch.nn.init.normal_(model.lm_head.weight, std=HEAD_INIT_STD)
    save_weights(model, out)  # not save_pretrained: any rank may be the one that builds it
    config.save_pretrained(out)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(out)
