"""The canonical form of a manifest: what crosses every process boundary.

A manifest arrives in any spelling the loader reads (our sections, AgileRL's ``INIT_HP`` and
``MUTATION_PARAMS``, AgileRL's lowercase sections). The controller translates and validates it
once; what it hands a member is :func:`canonical_sections` of the validated :class:`Manifest`:
every section of :data:`~pbt.config.manifest.SECTIONS`, every field written out with its value
(defaults and translated values alike), in our layout only. A member reads it back with
:func:`manifest_from_canonical`, which refuses anything but that layout, so nothing is ever
translated twice.

The round trip is exact: ``manifest_from_canonical(canonical_sections(m), m.base_dir) == m``
for every manifest ``m`` the loader accepts, in every compared field (all but
``translation_notes``, which says what the translation did and is not a setting). Relative
paths stay as written; ``base_dir`` travels beside the sections (a task's
``manifest_base_dir``), as it does in a campaign's store.
"""

from __future__ import annotations

import dataclasses
import keyword
from pathlib import Path
from typing import Any

import yaml

from pbt.config.agilerl import is_agilerl_format
from pbt.config.errors import ConfigError
from pbt.config.manifest import SECTIONS, Manifest
from pbt.config.read.loader import manifest_from_dict


def canonical_sections(manifest: Manifest) -> dict[str, Any]:
    """Every section of ``manifest``, in :data:`SECTIONS` order, as plain dicts, lists, strings,
    numbers, booleans and None (JSON and YAML both write it as it is)."""
    return {name: _plain(getattr(manifest, name)) for name in SECTIONS}


def manifest_from_canonical(
    sections: dict[str, Any], base_dir: str | Path, source: str = "canonical manifest"
) -> Manifest:
    """Read sections in our own layout back into a :class:`Manifest`, with the loader's
    rules, translating nothing.

    Raises:
        ConfigError: a key is not one of our sections or the sections are AgileRL's (a
            manifest that was never translated), or any value breaks a rule.
    """
    foreign = [str(key) for key in sections if key not in SECTIONS]
    if foreign or is_agilerl_format(sections):
        what = f"{', '.join(foreign)} {'is' if len(foreign) == 1 else 'are'} not our sections"
        if not foreign:
            what = "algorithm, training or mutation holds AgileRL's keys"
        raise ConfigError(
            [
                f"not a canonical manifest: {what}; a member reads only the sections the "
                "controller translated once (canonical_sections of the validated manifest)"
            ],
            source,
        )
    return manifest_from_dict(sections, base_dir=base_dir, source=source)


def resolved_yaml(manifest: Manifest) -> str:
    """:func:`canonical_sections` as YAML: a manifest that loads, from the original's folder,
    to the same :class:`Manifest` (``pbt check --resolved`` prints it)."""
    return yaml.safe_dump(canonical_sections(manifest), sort_keys=False, allow_unicode=True)


def _plain(value: Any) -> Any:
    """``value`` with every config dataclass turned into a dict of its init fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            _key(f.name): _plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.init
        }
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _key(name: str) -> str:
    """A field's manifest key: ``class_`` is written ``class``."""
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


__all__ = ["canonical_sections", "manifest_from_canonical", "resolved_yaml"]
