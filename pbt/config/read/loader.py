"""Load a YAML manifest (or an AgileRL-style ``INIT_HP`` dict) into a typed :class:`Manifest`.

Every problem is collected before anything is raised: unknown keys (with the nearest valid key
suggested), wrong types, NaN and infinities in any number, and the value rules each config's
``check()`` states. The result is one :class:`~pbt.config.errors.ConfigError` listing all of them.

Every manifest file is read here, by :func:`read_manifest_file`: at most
:data:`~pbt.config.read.strict_yaml.MAX_BYTES`, parsed by :mod:`pbt.config.read.strict_yaml` (duplicate
keys, nesting and alias expansion refused in one line each); a file without a document says so.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import keyword
import math
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from pbt.config.agilerl import translate_agilerl, translate_hp_dicts
from pbt.config.errors import ConfigError
from pbt.config.manifest import Manifest
from pbt.config.ranges import campaign_problems
from pbt.config.read.strict_yaml import MAX_BYTES, NO_DOCUMENT, ManifestYAMLError, load_strict
from pbt.config.rules import shown as _show


@dataclasses.dataclass(frozen=True, slots=True)
class ManifestFile:
    """A manifest file as read once: its text, its sections as parsed, and the manifest."""

    path: Path
    text: str
    """The file's text, as read (a campaign keeps a copy)."""
    sections: dict[str, Any]
    """The YAML as parsed, before validation; never changed by it (a campaign stores these)."""
    manifest: Manifest


def read_manifest_file(path: str | Path) -> ManifestFile:
    """Read a YAML manifest file once and validate it; problems name the file.

    Raises:
        ConfigError: the file is missing, a folder, unreadable, too large, empty or not valid
            YAML (duplicate keys, too deep, aliases that expand too far included), its top
            level is not a mapping, or any key or value breaks a rule.
    """
    path = Path(path)
    text = _read_text(path)
    try:
        sections = load_strict(text)
    except yaml.YAMLError as err:
        raise ConfigError([_yaml_problem(err)], str(path)) from None
    except ManifestYAMLError as err:
        raise ConfigError([str(err)], str(path)) from None
    if sections is NO_DOCUMENT:
        raise ConfigError([_empty_problem(path, text)], str(path))
    if not isinstance(sections, dict):
        raise ConfigError(
            [
                f"top level must be a mapping of sections, got {type(sections).__name__}; "
                "write sections like 'model:' and 'optim:' at the left margin"
            ],
            str(path),
        )
    manifest = manifest_from_dict(sections, base_dir=path.resolve().parent, source=str(path))
    return ManifestFile(path=path, text=text, sections=sections, manifest=manifest)


def load_manifest(path: str | Path) -> Manifest:
    """Read a YAML manifest file and validate it (:func:`read_manifest_file`'s manifest).

    Raises:
        ConfigError: the file cannot be read or parsed, or any key or value breaks a rule.
    """
    return read_manifest_file(path).manifest


def _empty_problem(path: Path, text: str) -> str:
    """What a file without a YAML document gets: what it holds, and where to start."""
    what = "only comments" if text.strip() else "nothing"
    reference = "configs/reference.yaml"
    with contextlib.suppress(Exception):  # an installed package: the file's own path
        reference += f" (installed as {resources.files('pbt.configs') / 'reference.yaml'})"
    return (
        f"{path} is empty: it holds {what}, no sections; start from {reference}, which lists "
        "every key with its default, or write {} to take every default"
    )


def _read_text(path: Path) -> str:
    """The file's text, read up to :data:`MAX_BYTES` (a device or a huge file is refused,
    not read to its end)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise ConfigError(
                [
                    f"{path} is larger than {MAX_BYTES >> 10} KiB, which no manifest needs (one "
                    "is a few KB of YAML); rows go in a file that task.train names"
                ],
                str(path),
            )
        return data.decode("utf-8")
    except OSError as err:
        reason = err.strerror or str(err)
        raise ConfigError([f"cannot read {path}: {reason}; check the path"], str(path)) from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            [
                f"cannot read {path}: byte {err.object[err.start]:#04x} at offset {err.start} "
                "is not UTF-8 text; save the manifest as UTF-8 YAML"
            ],
            str(path),
        ) from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: where, what, and in which construct."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None)
    if mark is None or problem is None:
        return f"not valid YAML: {' '.join(str(err).split())}; fix the syntax"
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and start is not None:
        problem += f" ({context} started at line {start.line + 1}, column {start.column + 1})"
    elif context:
        problem += f" ({context})"
    return f"not valid YAML at {where}: {problem}; fix the syntax there"


def manifest_from_dict(
    data: dict[str, Any], base_dir: str | Path = ".", source: str = "manifest"
) -> Manifest:
    """Validate a manifest given as a dict of sections, optionally with AgileRL's ``INIT_HP`` and
    ``MUTATION_PARAMS`` entries, or in AgileRL's lowercase format (:mod:`pbt.config.agilerl`)."""
    data = copy.deepcopy(data)  # AgileRL's keys are merged into the sections: never the caller's
    agilerl = translate_agilerl(data)
    problems = list(agilerl.problems)
    data["base_dir"] = str(base_dir)
    manifest = _build(Manifest, data, "", problems)
    if manifest is not None:
        # Fields that failed their type check kept their defaults, so the value rules below
        # report only real problems; every problem still comes out in one error.
        problems += manifest.check()
        if not problems:
            problems += campaign_problems(manifest)
    if problems:
        raise ConfigError(problems, source)
    assert manifest is not None
    manifest.translation_notes.extend(agilerl.notes)
    return manifest


def merge_init_hp(sections: dict[str, Any], init_hp: Any) -> list[str]:
    """Fold an AgileRL-style ``INIT_HP`` dict into manifest ``sections`` in place; returns the
    problems (a key given both in ``INIT_HP`` and in its section differently is one)."""
    translation = translate_hp_dicts(init_hp, None)
    translation.write(sections)
    return translation.problems


def _suggest(key: str, valid: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    if not close and key.upper() != key:
        close = difflib.get_close_matches(key.lower(), [v.lower() for v in valid], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(valid))}"


def _suggest_key(cls: type, key: str, fields: typing.Iterable[str]) -> str:
    """Suggest a near spelling, or the section a misplaced key belongs to."""
    if cls is not Manifest:
        hints = typing.get_type_hints(Manifest)
        for section in (f.name for f in dataclasses.fields(Manifest)):
            other = hints[section]
            if (
                dataclasses.is_dataclass(other)
                and other is not cls
                and key in {f.name for f in dataclasses.fields(other)}
            ):
                return f"; it belongs in the {section} section ({section}.{key})"
    return _suggest(key, fields)


def _build(cls: type, data: Any, prefix: str, problems: list[str]) -> Any:
    """Construct dataclass ``cls`` from ``data``, appending problems instead of raising."""
    where = prefix or "manifest"
    if not isinstance(data, dict):
        problems.append(f"{where} must be a mapping, got {type(data).__name__} {_show(data)}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key)
        if keyword.iskeyword(key) and f"{key}_" in fields:  # e.g. task.env.class -> class_
            key = f"{key}_"
        if key not in fields:
            problems.append(
                f"{_join(prefix, key)} is not a known key"
                f"{_suggest_key(cls, key, [n.rstrip('_') for n in fields])}"
            )
            continue
        before = len(problems)
        ok, converted = _coerce(value, hints[key], _join(prefix, key), problems)
        if ok:
            kwargs[key] = converted
        elif len(problems) == before + 1:
            problems[-1] += _fix_hint(fields[key], hints[key], value)
    missing = [
        name
        for name, f in fields.items()
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and name not in data
        and name.rstrip("_") not in data
    ]
    for name in missing:
        problems.append(f"{_join(prefix, name.rstrip('_'))} is required")
    if missing:
        return None
    return cls(**kwargs)


def _fix_hint(field: dataclasses.Field, hint: Any, value: Any) -> str:
    """What to write instead of a value of the wrong type: the nearest allowed choice, or the
    field's default as an example."""
    if typing.get_origin(hint) is Literal:
        choices = [str(a) for a in typing.get_args(hint)]
        close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
        close = close or [c for c in choices if c.lower() == str(value).lower()]
        return f"; did you mean {close[0]!r}?" if close else ""
    default = field.default
    if isinstance(default, (bool, int, float, str)):
        return f"; e.g. {field.name}: {yaml.safe_dump(default).splitlines()[0]}"
    return ""


def _coerce(value: Any, hint: Any, key: str, problems: list[str]) -> tuple[bool, Any]:
    """Check ``value`` against type ``hint``; return (ok, value converted)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return True, None
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        if isinstance(value, dict) and len(sections) == 1:  # a section that may be null
            return _coerce(value, sections[0], key, problems)
        if float in args and not isinstance(value, bool):  # say why a number is refused
            number = _float(value)
            if number is not None and not math.isfinite(number):
                return _coerce_scalar(value, float, key, problems)
        for arg in (a for a in args if a is not type(None)):
            scratch: list[str] = []
            ok, converted = _coerce(value, arg, key, scratch)
            if ok and not scratch:
                return True, converted
        problems.append(f"{key} ({_show(value)}) must be {_describe(hint)}")
        return False, None
    if origin is Literal:
        if value in args:
            return True, value
        problems.append(f"{key} ({_show(value)}) must be one of {', '.join(map(repr, args))}")
        return False, None
    if dataclasses.is_dataclass(hint):
        built = _build(hint, value, key, problems)
        return built is not None, built
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{key} ({_show(value)}) must be a list of {_describe(args[0])}")
            return False, None
        items = [_coerce(v, args[0], f"{key}[{i}]", problems) for i, v in enumerate(value)]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict:
        if isinstance(value, dict):
            return True, dict(value)
        problems.append(f"{key} ({_show(value)}) must be a mapping")
        return False, None
    return _coerce_scalar(value, hint, key, problems)


def _coerce_scalar(value: Any, hint: Any, key: str, problems: list[str]) -> tuple[bool, Any]:
    if hint is bool and isinstance(value, bool):
        return True, value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) < INT_LIMIT:
            return True, value
        problems.append(
            f"{key} ({_show(value)}) is out of range: a whole number here is below 2**63"
        )
        return False, None
    if hint is float and not isinstance(value, bool):
        number = _float(value)
        if number is not None and math.isfinite(number):
            return True, number
        if number is not None:
            problems.append(f"{key} ({_show(value)}) must be a finite number, not NaN or infinity")
            return False, None
    if hint is str and isinstance(value, str):
        return True, value
    problems.append(f"{key} ({_show(value)}) must be {_describe(hint)}")
    return False, None


INT_LIMIT = 2**63
"""Whole numbers in a manifest fit a signed 64-bit integer (seeds, sizes and counts reach torch
and numpy as such)."""


def _float(value: Any) -> float | None:
    """``value`` as a float: a number, or a string that reads as one (YAML 1.1 reads ``5e-4``,
    without a dot, as a string); None otherwise."""
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # an integer too large for a float
            return math.inf
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if origin is dict:
        return "a mapping"
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if hint is type(None):
        return "null"
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
