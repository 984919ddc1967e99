"""The manifest's sections, one small slotted dataclass each, with the rules of its own values:
``algorithm``, ``model`` (with ``lora``, ``optim`` and quantization), ``task`` (with its
multi-turn ``env``), ``rollout`` (with ``vllm``), ``training`` and ``distributed`` (with
``fsdp``), and the campaign's ``population``, ``mutation``, ``search``, ``budget``, ``launch``
and ``tracking``; :mod:`.source` checks the Python files they name, by parsing them.
:mod:`pbt.config.manifest` composes them; import them from :mod:`pbt.config`.
"""
