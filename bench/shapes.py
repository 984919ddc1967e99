"""The model shapes the benchmarks build, by name: transformers config fields for random
weights (no download). ``QWEN2`` shapes build with ``build_shaped_model(folder, **QWEN2[name])``
or ``Qwen2Config(**QWEN2[name])``; ``QWEN3`` holds the Qwen3 shapes of the sharded-scale runs.
Each script measures the names it picks with :func:`pick`."""

from __future__ import annotations

from typing import Any

_QWEN25_SMALL = {"vocab_size": 151936, "num_key_value_heads": 2, "tie_word_embeddings": True}
"""What Qwen2.5's 0.5B and 1.5B configs share."""
_QWEN25_LARGE = {
    "vocab_size": 152064,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
"""What Qwen2.5's 14B, 32B and 72B configs share."""

QWEN2: dict[str, dict[str, Any]] = {
    # the built-in model's size, untied: a dry run of a GPU measurement in seconds on a CPU
    "tiny": dict(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    ),
    # 13M parameters with the tiny tokenizer's vocabulary: big enough that allocator noise is
    # small, small enough for a CPU
    "wide": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    ),
    # Qwen2.5-0.5B and -1.5B's shapes and vocabulary (the tiny tokenizer uses the first ids)
    "0.5b": dict(
        _QWEN25_SMALL,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        head_dim=64,
    ),
    "1.5b": dict(
        _QWEN25_SMALL,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        head_dim=128,
    ),
    # SmolLM2-135M-Instruct's sizes (a tied Llama there; an untied Qwen2 here): its throughput
    # without fetching it
    "smollm2-shape": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        head_dim=64,
    ),
    # Qwen2.5-7B's published config.json: untied output layer, 152,064-token vocabulary
    "7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # Qwen2.5-14B, -32B and -72B's published shapes (and Qwen1.5-110B's, with the same
    # vocabulary), for the largest member one GPU trains
    **{
        name: dict(
            _QWEN25_LARGE,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
        )
        for name, hidden, inter, layers, heads in [
            ("14b", 5120, 13824, 48, 40),
            ("32b", 5120, 27648, 64, 40),
            ("72b", 8192, 29568, 80, 64),
            ("110b", 8192, 49152, 80, 64),
        ]
    },
}

QWEN3: dict[str, dict[str, Any]] = {
    # Qwen3-32B's published config.json
    "32b": dict(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    # the 32B architecture at a size for CPU tests; a prime vocabulary makes uneven shards
    "tiny": dict(
        vocab_size=1031,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
}


def pick(*names: str, table: dict[str, dict[str, Any]] = QWEN2) -> dict[str, dict[str, Any]]:
    """The shapes of ``names`` from ``table``, in that order (a script's ``--shape`` choices)."""
    return {name: table[name] for name in names}
