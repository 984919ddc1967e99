"""AgileRL's configuration keys, translated onto the manifest's sections.

Two spellings arrive here. The uppercase one: ``INIT_HP`` and ``MUTATION_PARAMS`` dicts (also as
top-level keys of a YAML manifest). The lowercase one that AgileRL's manifest runner reads:
``algorithm:``, ``environment:``, ``training:``, ``mutation:``, ``selection_strategy:`` and
``network:``, with the Arena keys of ``training:``. Every key either lands, with AgileRL's
meaning, in the field that uses it; or yields one line saying what pbt-llm does instead: a
note when ignoring the key changes nothing, a problem when obeying it would change results.

:data:`INIT_HP_RULES`, :data:`MUTATION_RULES` and :data:`TRAINING_RULES` are the one table of
the mapping; the table of docs/agilerl.md's "Coming from AgileRL: manifests" is tested against
:func:`mapping_rows`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from pbt.config.agilerl.env import translate_environment, translate_network
from pbt.config.agilerl.rules import (
    INIT_HP_RULES,
    MUTATION_RULES,
    RANGE_NAMES,
    REPLAY_BUFFER_RULES,
    TRAINING_RULES,
    KeyRule,
    Translation,
)

__all__ = [
    "INIT_HP_RULES",
    "MUTATION_RULES",
    "TRAINING_RULES",
    "Translation",
    "is_agilerl_format",
    "mapping_rows",
    "translate_agilerl",
    "translate_hp_dicts",
    "translate_sections",
]

_SECTIONS = (
    "algorithm", "environment", "training", "mutation", "selection_strategy", "network",
    "replay_buffer",
)  # fmt: skip
_OWN_ONLY = ("network", "environment", "selection_strategy", "replay_buffer")
"""Top-level keys only AgileRL's format has."""
_DISTINCT = {
    "algorithm": {"batch_size", "clip_coef", "use_vllm", "vllm_config", "fsdp", "calc_position_embeddings"},
    "training": {
        "max_steps", "pop_size", "eval_loop", "evaluation_interval", "num_epochs",
        "training_gpus_per_agent", "rollout_batch_size", "rollout_engines_per_agent", "rollout_mode",
    },
    "mutation": {"probabilities", "rl_hp_selection", "mutation_sd", "rand_seed"},
}  # fmt: skip
"""Keys of a shared section name (``algorithm:``, ...) that only AgileRL's format uses."""


def translate_hp_dicts(init_hp: Any, mutation_params: Any) -> Translation:
    """Translate AgileRL's ``INIT_HP`` and ``MUTATION_PARAMS`` dicts (either may be None)."""
    out = Translation()
    for name, given, rules in (
        ("INIT_HP", init_hp, INIT_HP_RULES),
        ("MUTATION_PARAMS", mutation_params, MUTATION_RULES),
    ):
        if given is None:
            continue
        if not isinstance(given, dict):
            example = "{LR: 1e-5, GROUP_SIZE: 8}" if name == "INIT_HP" else "{NO_MUT: 0.4}"
            out.problems.append(f"{name} must be a mapping like {example}, got {given!r}")
            continue
        ranges = {k: v for k, v in given.items() if _is_bound(str(k)) and name == "MUTATION_PARAMS"}
        for key, value in given.items():
            if str(key) in ranges:
                continue
            _apply_key(out, rules, name, str(key), value)
        if ranges:
            _range_bounds(out, ranges, given.get("RL_HP_SELECTION"))
    return out


def _apply_key(
    out: Translation, rules: dict[str, KeyRule], where: str, key: str, value: Any
) -> None:
    rule = rules.get(key)
    if rule is None:
        out.problems.append(f"{where}.{key} is not a known key{_suggest(key, rules)}")
        return
    out.apply(rule, f"{where}.{key}", value)


def _is_bound(key: str) -> bool:
    return key.startswith(("MIN_", "MAX_")) and key not in ("MAX_GRAD_NORM", "MAX_OUTPUT_TOKENS",
                                                             "MAX_MODEL_LEN", "MIN_OUTPUT_TOKENS")  # fmt: skip


def _range_bounds(out: Translation, bounds: dict[str, Any], selection: Any) -> None:
    """``MIN_<HP>``/``MAX_<HP>`` pairs -> ``mutation.ranges``; the pairs name the hyperparameters
    that mutate (AgileRL's ``hp_config``), restricted to ``RL_HP_SELECTION`` when given."""
    specs: dict[str, dict[str, Any]] = {}
    for key, value in bounds.items():
        bound, hp = key[:3].lower(), key[4:].lower()
        specs.setdefault(hp, {})[bound] = value
    chosen = None if selection is None else {str(s).lower() for s in selection}
    _ranges_from(out, {hp: s for hp, s in specs.items() if chosen is None or hp in chosen},
                 "MUTATION_PARAMS.MIN_/MAX_")  # fmt: skip


def _ranges_from(out: Translation, specs: dict[str, dict[str, Any]], origin: str) -> None:
    ranges: dict[str, dict[str, Any]] = {}
    for hp, spec in specs.items():
        if not {"min", "max"} <= set(spec):
            missing = "max" if "min" in spec else "min"
            out.problems.append(
                f"{origin}: {hp} has no {missing} bound; give both MIN_{hp.upper()} and "
                f"MAX_{hp.upper()} (or min and max)"
            )
            continue
        for ours, dtype in RANGE_NAMES.get(hp, ((hp, None),)):
            ranges[ours] = dict(spec, **({"dtype": dtype} if dtype else {}))
    if ranges:
        out.sets.append(("mutation.ranges", ranges, origin))


def translate_agilerl(data: dict[str, Any]) -> Translation:
    """Fold every AgileRL key of a manifest dict into its pbt-llm sections, in place: the
    ``INIT_HP`` and ``MUTATION_PARAMS`` entries, and the lowercase format's sections."""
    out = translate_hp_dicts(data.pop("INIT_HP", None), data.pop("MUTATION_PARAMS", None))
    if is_agilerl_format(data):
        rest, sections = translate_sections(data)
        data.clear()
        data.update(rest)
        out.sets += sections.sets
        out.notes += sections.notes
        out.problems += sections.problems
    out.write(data)
    rollout = data.get("rollout")
    engine = rollout.get("engine", "hf") if isinstance(rollout, dict) else "hf"
    for path, value, origin in out.sets:
        if path == "rollout.vllm.max_model_len" and engine != "vllm":
            out.notes.append(
                f"{origin} ({value!r}) sets rollout.vllm.max_model_len, which only the vLLM "
                f"rollout reads; with rollout.engine {engine!r} nothing truncates prompts"
            )
    return out


def is_agilerl_format(data: dict[str, Any]) -> bool:
    """Whether a manifest dict is in AgileRL's lowercase format: it has a section only AgileRL's
    format has, or a key of ``algorithm``/``training``/``mutation`` only AgileRL's uses."""
    if any(key in data for key in _OWN_ONLY):
        return True
    return any(
        isinstance(data.get(section), dict) and set(data[section]) & keys
        for section, keys in _DISTINCT.items()
    )


def translate_sections(data: dict[str, Any]) -> tuple[dict[str, Any], Translation]:
    """Split AgileRL's lowercase sections off ``data`` and translate them.

    Returns:
        The remaining (pbt-llm) sections, and the translation of AgileRL's.
    """
    out = Translation()
    rest = {k: v for k, v in data.items() if k not in _SECTIONS}
    for name in _SECTIONS:
        block = data.get(name)
        if block is None:
            continue
        if not isinstance(block, dict):
            out.problems.append(f"{name} must be a mapping, got {block!r}")
            continue
        _SECTION_HANDLERS[name](out, block)
    _lag_in_optimizer_steps(out)
    return rest, out


_LAG = "replay_buffer.max_rollout_version_lag"


def _lag_in_optimizer_steps(out: Translation) -> None:
    """Arena counts a sample's lag in weight syncs, one per learning step; ``rollout.
    max_staleness`` counts optimizer steps, ``algorithm.update_epochs`` of them a step."""
    epochs = next((v for p, v, _ in out.sets if p == "algorithm.update_epochs"), 1)
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        return  # the algorithm section reports it
    out.sets = [
        (path, value * epochs if origin == _LAG else value, origin)
        for path, value, origin in out.sets
    ]


def _replay_buffer(out: Translation, block: dict[str, Any]) -> None:
    _keys(out, "replay_buffer", block, REPLAY_BUFFER_RULES)


def _keys(out: Translation, section: str, block: dict[str, Any], rules: dict) -> None:
    """Each key of ``section`` by its rule (keys in any case); an unknown key named with the
    section's known ones."""
    for key, value in block.items():
        rule = rules.get(str(key).upper())
        if rule is None:
            known = ", ".join(k.lower() for k in rules)
            out.problems.append(f"{section}.{key} is not a known key; known: {known}")
            continue
        out.apply(rule, f"{section}.{key}", value)


def _algorithm(out: Translation, block: dict[str, Any]) -> None:
    for key, value in block.items():
        upper = {"name": "ALGO"}.get(str(key), str(key).upper())
        rule = INIT_HP_RULES.get(upper)
        if rule is None:
            out.problems.append(
                f"algorithm.{key} is not a known key{_suggest(upper, INIT_HP_RULES)}"
            )
            continue
        out.apply(rule, f"algorithm.{key}", value)


def _training(out: Translation, block: dict[str, Any]) -> None:
    _keys(out, "training", block, TRAINING_RULES)
    batch, gpus = block.get("rollout_batch_size"), block.get("training_gpus_per_agent", 1)
    if isinstance(batch, int) and isinstance(gpus, int) and gpus >= 1 and batch % gpus:
        out.problems.append(
            f"training.rollout_batch_size ({batch}) must be a multiple of "
            f"training.training_gpus_per_agent ({gpus}), so every trainer rank gets whole groups; "
            f"use {max(gpus, batch - batch % gpus)}"
        )


_MUTATION_NAMES = {
    "mutation_sd": "MUT_SD",
    "rand_seed": "RAND_SEED",
    "mutate_elite": "MUTATE_ELITE",
}


def _mutation(out: Translation, block: dict[str, Any]) -> None:
    for key, value in block.items():
        if key == "probabilities" and isinstance(value, dict):
            for name, p in value.items():
                _apply_key(out, MUTATION_RULES, "mutation.probabilities", str(name).upper(), p)
        elif key == "rl_hp_selection" and isinstance(value, dict):
            bad = [hp for hp, spec in value.items() if not isinstance(spec, dict)]
            for hp in bad:
                out.problems.append(f"mutation.rl_hp_selection.{hp} must be a mapping {{min, max}}")
            good = {str(hp): dict(spec) for hp, spec in value.items() if hp not in bad}
            _ranges_from(out, good, "mutation.rl_hp_selection")
        else:
            rule = MUTATION_RULES.get(_MUTATION_NAMES.get(str(key), ""))
            if rule is None:
                known = ", ".join([*_MUTATION_NAMES, "probabilities", "rl_hp_selection"])
                out.problems.append(f"mutation.{key} is not a known key; known: {known}")
                continue
            out.apply(rule, f"mutation.{key}", value)


def _selection(out: Translation, block: dict[str, Any]) -> None:
    names = {"tournament_size": "TOURN_SIZE", "elitism": "ELITISM"}
    for key, value in block.items():
        upper = names.get(str(key))
        if upper is None:
            out.problems.append(
                f"selection_strategy.{key} is not a known key{_suggest(str(key), names)}"
            )
            continue
        out.apply(INIT_HP_RULES[upper], f"selection_strategy.{key}", value)


_SECTION_HANDLERS: dict[str, Callable[[Translation, dict[str, Any]], None]] = {
    "algorithm": _algorithm,
    "environment": translate_environment,
    "training": _training,
    "mutation": _mutation,
    "selection_strategy": _selection,
    "network": translate_network,
    "replay_buffer": _replay_buffer,
}


def mapping_rows() -> list[tuple[str, str, str]]:
    """The mapping as ``(AgileRL key, pbt-llm key, what happens)`` rows, docs/agilerl.md's table."""
    rows = [(f"`{k}`", _targets(r), r.meaning) for k, r in INIT_HP_RULES.items()]
    rows += [(f"`{k}`", _targets(r), r.meaning) for k, r in MUTATION_RULES.items()]
    rows.append(
        ("`MIN_<HP>` / `MAX_<HP>`", "`mutation.ranges.<hp>`",
         "a mutation range for each hyperparameter named by a pair (`MIN_LR`/`MAX_LR` -> `lr`)")
    )  # fmt: skip
    rows += [(f"`training.{k.lower()}`", _targets(r), r.meaning) for k, r in TRAINING_RULES.items()]
    rows += [
        (f"`replay_buffer.{k.lower()}`", _targets(r), r.meaning)
        for k, r in REPLAY_BUFFER_RULES.items()
    ]
    return rows


def _targets(rule: KeyRule) -> str:
    return ", ".join(f"`{t}`" for t in rule.targets) or "-"


def _suggest(key: str, valid: Any) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
