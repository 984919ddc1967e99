"""The reward of the proof-of-value data-file task: 1.0 when the completion's last integer is
the answer, else 0.0 (the built-in arithmetic tasks' own rule)."""

from pbt.algorithms.builtin.arithmetic import arithmetic_reward


def exact_integer(completion: str, answer: object, question: str) -> float:
    return arithmetic_reward(completion, answer, question)
