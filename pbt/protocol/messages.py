"""The two messages of the controller-member contract, typed and versioned, defined once.

A :class:`TaskMessage` is what the controller hands a member (``task.json`` in the task's
folder); a :class:`ResultMessage` is what the member hands back (``result.json`` once its
checkpoint is on disk; ``released`` before that, without the digest, from a long-lived worker).
Both are frozen dataclasses written as flat JSON objects whose keys are the field names, with a
``version``. Reading one checks everything a reader relies on, at once: the version (a file of
another version is refused with one line saying so), every key known, every required key
present and every value of its field's type. A file written before messages had a version has
none and reads as version 1, whose keys are the same.

The task carries the member's manifest in canonical form (:mod:`pbt.config.read.canonical`,
translated and validated once, by the controller) and the folder its relative paths are read
from; a member translates nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pbt.protocol.files import read_json, write_json_atomic

VERSION = 1
"""The message format this package writes and reads."""

TASK_FILE = "task.json"
RESULT_FILE = "result.json"


class MessageError(ValueError):
    """A task or result file that is not a message this version of pbt reads."""


M = TypeVar("M", bound="_Message")


class _Message:
    """JSON in and out, shared by both messages (each a frozen, slotted dataclass)."""

    __slots__ = ()
    kind: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """The message as a flat JSON object (nested messages as objects)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[M], data: object, source: str = "") -> M:
        """Read a message back, checking its version, its keys and every value's type.

        Raises:
            MessageError: one line naming the source and every problem.
        """
        where = f"{source}: " if source else ""
        if not isinstance(data, dict):
            raise MessageError(f"{where}a {cls.kind} is a JSON object, not {type(data).__name__}")
        version = data.get("version", 1)
        if version != VERSION or isinstance(version, bool):
            raise MessageError(
                f"{where}{cls.kind} version {version!r} is not version {VERSION}, the one this "
                f"pbt reads; run the campaign with the pbt version that wrote it"
            )
        return cls(**_checked(cls, {**data, "version": VERSION}, where))

    def write(self, path: str | Path, durable: bool = True) -> None:
        """Write the message to ``path`` atomically (readers see all of it or none)."""
        write_json_atomic(path, self.to_dict(), durable=durable)

    @classmethod
    def read(cls: type[M], path: str | Path) -> M | None:
        """The message at ``path``; None when there is no complete JSON file there yet.

        Raises:
            MessageError: the file is JSON but not such a message.
        """
        data = read_json(Path(path))
        return None if data is None else cls.from_dict(data, str(path))

    @classmethod
    def peek(cls: type[M], path: str | Path) -> M | None:
        """The message at ``path``; None when it is missing, incomplete or not such a message
        (for a reader that only acts on a good one)."""
        try:
            return cls.read(path)
        except MessageError:
            return None


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskMessage(_Message):
    """One attempt at one member's task: what to load, what to apply, how long to train and
    where to save."""

    kind: ClassVar[str] = "task"
    campaign_dir: str
    """The campaign's folder (absolute); the checkpoint paths below are relative to it."""
    manifest: dict[str, Any]
    """The member's manifest in canonical form (:func:`pbt.config.read.canonical.canonical_sections`)."""
    manifest_base_dir: str
    """The folder the manifest's relative paths are read from."""
    member_id: str
    generation: int
    parent_id: str | None
    """The member this one was bred from; None in generation 0."""
    parent_checkpoint: str | None
    """The checkpoint to load, relative to the campaign; None: the base model."""
    parent_digest: str | None
    """That checkpoint's digest; None when there is no parent or, for a task handed ahead, its
    parent is still being written by the worker it is handed to (which holds that state)."""
    hyperparameters: dict[str, float]
    """Applied after the parent is loaded."""
    mutation: str | None
    """What made this member from its parent, in words."""
    steps: int
    """Training steps to run."""
    checkpoint: str
    """Where to save, relative to the campaign (``checkpoints/<member_id>``)."""
    version: int = VERSION


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    """A member that ended early but with a result (its kind, :data:`pbt.protocol.collapse.COLLAPSED`)."""

    kind: str
    detail: str


ParentFrom = Literal["memory", "disk"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultMessage(_Message):
    """A task that ended ok: the member's fitness, steps and checkpoint, and what its training
    measured. The fields after ``fault`` are the worker's figures of how the task ran (the fake
    member of the tests writes none of them)."""

    kind: ClassVar[str] = "result"
    status: Literal["ok"]
    member_id: str
    fitness: float
    """The evaluation at the end of the task."""
    steps: int
    """The lineage's optimizer steps after this task (its parents' included)."""
    checkpoint: str
    """The checkpoint saved, relative to the campaign (the task's ``checkpoint``)."""
    digest: str | None
    """Its digest; None in ``released`` (the write is still running)."""
    metrics: dict[str, float]
    """The last step's metrics and the zero-signal summary."""
    history: list[dict[str, float]]
    """Every step's metrics, each with its lineage ``step``."""
    fault: Fault | None = None
    seconds: float | None = None
    """From the member's load to its result (the checkpoint write included once written)."""
    productive_seconds: float | None = None
    """Training and evaluation."""
    write_s: float | None = None
    """The checkpoint write (after the device was let go)."""
    timings: dict[str, float] | None = None
    """Seconds of each phase: setup, parent, load, train, evaluate, save."""
    world_size: int | None = None
    device: str | None = None
    parent_from: ParentFrom | None = None
    """Where the parent's state came from; None without a parent."""
    parent_prefetched: bool | None = None
    """The parent was copied to the device while the task before it trained."""
    parent_in_flight: bool | None = None
    """The parent's write, on this worker, had not finished when the task began."""
    parent_on_device: bool | None = None
    """The parent came from a copy held on the device."""
    peak_memory_gib: float | None = None
    version: int = VERSION


def _checked(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data`` as keyword arguments of ``cls``, nested messages built.

    Raises:
        MessageError: the unknown keys, missing keys and mistyped values, all together.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = _hints(cls)
    problems = [f"unknown key {k!r}" for k in data if k not in fields]
    problems += [
        f"missing key {name!r}"
        for name, f in fields.items()
        if name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    values = {}
    for name, value in data.items():
        if name not in fields:
            continue
        built = _build(hints[name], value)
        if built is _WRONG:
            problems.append(f"{name} ({value!r:.60}) is not {_describe(hints[name])}")
        values[name] = built
    if problems:
        raise MessageError(f"{where}not a {cls.kind} this pbt reads: {'; '.join(problems)}")  # type: ignore[attr-defined]
    return values


_WRONG = object()


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(tp: Any, value: Any) -> Any:
    """``value`` as a ``tp`` (a nested dataclass built from its object), or :data:`_WRONG`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            built = _build(arg, value)
            if built is not _WRONG:
                return built
        return _WRONG
    if origin is Literal:
        return value if value in args else _WRONG
    if tp is type(None):
        return value if value is None else _WRONG
    if tp is bool:
        return value if isinstance(value, bool) else _WRONG
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _WRONG
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return value if ok else _WRONG
    if tp is str:
        return value if isinstance(value, str) else _WRONG
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            return _WRONG
        built = {k: _build(args[1], v) for k, v in value.items()}
        return _WRONG if any(v is _WRONG for v in built.values()) else built
    if origin is list:
        if not isinstance(value, list):
            return _WRONG
        items = [_build(args[0], v) for v in value]
        return _WRONG if any(v is _WRONG for v in items) else items
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict) or set(value) != {f.name for f in dataclasses.fields(tp)}:
            return _WRONG
        kwargs = {k: _build(_hints(tp)[k], v) for k, v in value.items()}
        return _WRONG if _WRONG in kwargs.values() else tp(**kwargs)
    raise TypeError(f"no check for {tp!r}")


def _describe(tp: Any) -> str:
    """``tp`` in words, for a message."""
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in names:
        return names[tp]
    if tp is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return " or ".join(repr(a) for a in args)
    if origin is dict:
        return f"an object of {_describe(args[1])}"
    if origin is list:
        return f"a list of {_describe(args[0])}"
    if dataclasses.is_dataclass(tp):
        return f"an object with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    return str(tp)
