"""Rewards for the "write one letter over and over" rows of train.jsonl and eval.jsonl.

Each row's answer is the letter asked for. Two terms, summed by the weights in manifest.yaml:
``right_letter`` is what the task is about; ``one_letter`` is a smaller shaping term that pays
for the form of the answer (a line of one repeated character) before the model has learned
which letter to write. Plain Python, no imports from pbt: any file with functions of these
signatures works.
"""

from __future__ import annotations

from collections import Counter


def right_letter(completion: str, answer: str, question: str) -> float:
    """Partial credit for the requested letter, in [0, 1].

    The share of the completion's non-space characters that are the letter ``answer``
    (case-insensitive): asked for k, ``"kkkk"`` scores 1.0, ``"kkab"`` 0.5, ``"abab"`` and an
    empty completion 0.0. The question is not needed: the answer says it all.
    """
    chars = [ch for ch in completion.lower() if not ch.isspace()]
    if not chars:
        return 0.0
    return chars.count(answer.lower()) / len(chars)


def one_letter(completions: list[str], answers: list[str], questions: list[str]) -> list[float]:
    """Partial credit for the form, whatever the letter, in [0, 1]; batched (one call a batch).

    For each completion, the share of its non-space characters taken by its most frequent
    one: ``"zzzz"`` scores 1.0 whatever was asked, ``"zzab"`` 0.5, an empty completion 0.0.
    """
    scores = []
    for completion in completions:
        chars = [ch for ch in completion.lower() if not ch.isspace()]
        top = Counter(chars).most_common(1)
        scores.append(top[0][1] / len(chars) if top else 0.0)
    return scores
