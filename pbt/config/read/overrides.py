"""Environment variables that override manifest fields.

A few settings are about the machine a campaign runs on more than about the experiment: how
much memory a long-lived worker keeps members' states in, and how often the controller prints
its progress lines. Each is a field of the manifest, documented with it, and each has an
environment variable that overrides it without editing the manifest:

==============================  ================================
``PBT_STATE_CACHE_GIB``         ``launch.state_cache_gib``
``PBT_DEVICE_STATE_CACHE_GIB``  ``launch.device_state_cache_gib``
``PBT_PROGRESS_EVERY``          ``tracking.progress_every_s``
==============================  ================================

A variable that is set and not empty wins over the manifest. The controller applies them once,
when it starts or resumes a campaign (and ``pbt check`` when it validates a manifest), with the
field's own rules; members read the values from the canonical manifest they are handed, never
from their environment. The campaign's store keeps the manifest as written, so a later resume
without the variable goes back to the manifest's value.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from pbt.config.errors import ConfigError
from pbt.config.manifest import Manifest
from pbt.config.rules import shown

OVERRIDES: dict[str, tuple[str, str]] = {
    "PBT_STATE_CACHE_GIB": ("launch", "state_cache_gib"),
    "PBT_DEVICE_STATE_CACHE_GIB": ("launch", "device_state_cache_gib"),
    "PBT_PROGRESS_EVERY": ("tracking", "progress_every_s"),
}
"""Each variable and the ``(section, field)`` it overrides."""


def with_environment(manifest: Manifest, environ: Mapping[str, str] | None = None) -> Manifest:
    """``manifest`` with every field of :data:`OVERRIDES` whose variable ``environ`` (default:
    this process's environment) sets, validated by the field's section rules; ``manifest``
    itself is left as it is.

    Raises:
        ConfigError: a variable is not a number, or its value breaks the field's rule (each
            problem names the variable, the field, the rule and the fix).
    """
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    changed: dict[str, dict[str, float]] = {}
    given: dict[str, list[str]] = {}
    for variable, (section, key) in OVERRIDES.items():
        text = environ.get(variable, "").strip()
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            default = getattr(getattr(manifest, section), key)
            problems.append(
                f"{variable} ({shown(text)}) overrides {section}.{key} and must be a number, "
                f"e.g. {default:g}; set a number or unset it to keep the manifest's value"
            )
            continue
        changed.setdefault(section, {})[key] = value
        given.setdefault(section, []).append(f"{variable}={text}")
    sections = {
        name: dataclasses.replace(getattr(manifest, name), **fields)
        for name, fields in changed.items()
    }
    for name, section in sections.items():
        source = ", ".join(given[name])
        problems += [f"{p} (set by {source})" for p in section.check(name)]
    if problems:
        raise ConfigError(problems, "environment")
    if not sections:
        return manifest
    out = dataclasses.replace(manifest, **sections)
    out.translation_notes.extend(manifest.translation_notes)
    return out


__all__ = ["OVERRIDES", "with_environment"]
