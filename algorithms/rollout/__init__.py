"""Rollout engines behind one interface: Hugging Face ``generate`` (:mod:`~pbt.algorithms.rollout.hf`,
with the log-prob pass that matches every engine), the static-cache decoder
(:mod:`~pbt.algorithms.rollout.static`) and colocated vLLM (:mod:`~pbt.algorithms.rollout.vllm`).
"""
