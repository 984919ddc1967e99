"""AgileRL's manifest formats (``INIT_HP`` and the lowercase sections), translated into ours
once, by the controller: :mod:`.translate` the sections and their rules, :mod:`.rules` the key
tables, :mod:`.env` the environment and network keys."""

from pbt.config.agilerl.rules import TRAINING_RULES
from pbt.config.agilerl.translate import (
    is_agilerl_format,
    mapping_rows,
    translate_agilerl,
    translate_hp_dicts,
)

__all__ = [
    "TRAINING_RULES",
    "is_agilerl_format",
    "mapping_rows",
    "translate_agilerl",
    "translate_hp_dicts",
]
