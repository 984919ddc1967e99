"""The user's own rows, read with ``datasets``, split into train and held-out eval.

``task.train`` and ``task.eval`` name a JSONL, JSON, CSV or Parquet file (by extension), a
folder written by ``Dataset.save_to_disk``, or ``hf:NAME[:SPLIT]`` on the hub; paths are
relative to the manifest's folder. A file is converted once into ``datasets``' Arrow cache and
memory-mapped from there, so a million rows cost each member process almost no RAM: a split is
a :class:`Rows`, a sequence of row numbers into the table (8 bytes a row) that builds one
example when it is read, never a list of every row.

The split is seeded by the campaign's ``training.seed`` alone, so every member of a campaign
trains and is measured on the same rows: without ``task.eval``, ``eval_fraction`` of the rows
are held out; fitness reads at most ``eval_size`` eval rows (a seeded, fixed subset) and
training at most ``train_size`` rows (a seeded subset, kept in file order).
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar, overload

import datasets
import numpy as np

from pbt.algorithms.data.fields import (
    Row,
    check_fields,
    check_template,
    required_fields,
)
from pbt.config import TaskConfig
from pbt.config.errors import ConfigError
from pbt.config.sections.task import HUB_PREFIX

FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
"""File extension -> the ``datasets`` builder that reads it."""
PREVIEW_ROWS = 5
"""Rows ``pbt check`` reads from the start of each file."""
SPLIT_SALT = zlib.crc32(b"task split")
"""Keeps the split's stream apart from every other use of ``training.seed``."""

T = TypeVar("T")


class Rows(Sequence[T]):
    """Rows ``indices`` of a memory-mapped table, each made into a ``T`` when read.

    Args:
        table: the rows, memory-mapped Arrow.
        indices: ``[len]`` row numbers of ``table``, in this sequence's order.
        convert: makes one row (a dict of its fields) into what the algorithm reads.
    """

    def __init__(self, table: datasets.Dataset, indices: np.ndarray, convert: Callable[[Row], T]):
        self.table = table
        self.indices = indices
        self.convert = convert

    def __len__(self) -> int:
        return len(self.indices)

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.convert(self.table[int(self.indices[i])])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Rows({len(self)} of {len(self.table)})"


# -- reading a source --------------------------------------------------------------------


def parse_hub(source: str) -> tuple[str, str]:
    """``hf:NAME[:SPLIT]`` -> ``(NAME, SPLIT)``, the split ``train`` when not given.

    Raises:
        ConfigError: no name after ``hf:``.
    """
    name, _, split = source.removeprefix(HUB_PREFIX).partition(":")
    if not name:
        raise ConfigError(
            [f"task.train ({source!r}) names no dataset; write hf:NAME or hf:NAME:SPLIT"]
        )
    return name, split or "train"


def open_rows(source: str, base_dir: str | Path, key: str) -> datasets.Dataset:
    """Every row of ``source`` (a file, a ``save_to_disk`` folder or ``hf:NAME[:SPLIT]``),
    memory-mapped.

    Args:
        source: the value of ``key`` in the manifest.
        base_dir: the manifest's folder.
        key: the manifest key that named it (``task.train`` or ``task.eval``), for messages.

    Raises:
        ConfigError: nothing there, an unknown format, an empty or unparsable file (a bad JSONL
            line is named by its number), or a hub dataset that cannot be loaded.
    """
    where = f"{key} ({source!r})"
    if source.startswith(HUB_PREFIX):
        name, split = parse_hub(source)
        try:
            with quiet():
                return datasets.load_dataset(name, split=split)
        except Exception as err:  # the hub's failures come in many types
            raise ConfigError(
                [f"{where} could not be loaded ({_first_line(err)}); check the name and split"]
            ) from None
    path = Path(base_dir) / source
    if not path.exists():
        raise ConfigError(
            [f"{where} not found: nothing at {path}; give a path relative to the manifest's folder"]
        )
    table = _open_folder(path, where) if path.is_dir() else _open_file(path, where)
    if len(table) == 0:
        raise ConfigError([f"{where} holds no rows ({path}); add rows to it"])
    return table


def _open_file(path: Path, where: str, streaming: bool = False):
    builder = FORMATS.get(path.suffix.lower())
    if builder is None:
        raise ConfigError(
            [
                f"{where} has the extension {path.suffix or '(none)'!r}, which is not read; use "
                ".jsonl, .json, .csv or .parquet, or a folder written by Dataset.save_to_disk"
            ]
        )
    if path.stat().st_size == 0:
        raise ConfigError([f"{where} holds no rows ({path} is empty); add rows to it"])
    try:
        with quiet():
            return datasets.load_dataset(
                builder, data_files=str(path), split="train", streaming=streaming
            )
    except Exception as err:  # each builder fails its own way; the file is at fault
        raise ConfigError([_parse_problem(path, where, builder, err)]) from None


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No progress bars, and none of ``datasets``' own logging of a file it cannot parse (the
    error that follows says what is wrong, once)."""
    datasets.disable_progress_bars()
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


def _open_folder(path: Path, where: str) -> datasets.Dataset:
    try:
        table = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise ConfigError(
            [
                f"{where} is a folder that Dataset.save_to_disk did not write ({path}); give a "
                "file, or a folder written by save_to_disk"
            ]
        ) from None
    if isinstance(table, datasets.DatasetDict):
        splits = ", ".join(table)
        raise ConfigError(
            [
                f"{where} holds several splits ({splits}); name one split's folder, e.g. {path.name}/"
                f"{next(iter(table))}"
            ]
        )
    return table


def _parse_problem(path: Path, where: str, builder: str, err: Exception) -> str:
    """What is wrong with a file ``datasets`` could not read: the first bad line of a JSONL
    file (found by reading it line by line), else the reader's own words."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as bad:
        return f"{where}: {path} is not UTF-8 ({bad.reason} at byte {bad.start}); save it as UTF-8"
    if builder == "json":
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as bad:
                if number == 1 and path.suffix.lower() == ".json":
                    break  # a JSON document over several lines, not JSON Lines
                return (
                    f"{where}: line {number} of {path} is not valid JSON ({bad.msg} at column "
                    f"{bad.colno}); fix the line"
                )
            if not isinstance(record, dict):
                return (
                    f"{where}: line {number} of {path} is a JSON {type(record).__name__}, not an "
                    "object; write one object per line"
                )
    return f"{where}: {path} could not be read as {builder} ({_first_line(err)}); fix the file"


def _first_line(err: BaseException) -> str:
    cause = err.__cause__ or err
    return (str(cause).strip().splitlines() or [type(cause).__name__])[0]


# -- the split ---------------------------------------------------------------------------


def split_rows(
    n_train: int, n_eval: int | None, cfg: TaskConfig, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Row numbers ``(train, eval)``: of the train source, and of the eval source (or, when
    ``n_eval`` is None, also of the train source: a held-out ``eval_fraction``).

    Seeded by ``seed`` alone (the campaign's), so every member gets the same split; train keeps
    file order, at most ``train_size`` rows; eval at most ``eval_size``.
    """
    rng = np.random.default_rng([seed % 2**32, SPLIT_SALT])
    if n_eval is None:
        order = rng.permutation(n_train)
        held = min(max(1, round(n_train * cfg.eval_fraction)), n_train)
        eval_rows, train_rows = order[:held], np.sort(order[held:])
    else:
        train_rows = np.arange(n_train)
        eval_rows = np.arange(n_eval) if n_eval <= cfg.eval_size else rng.permutation(n_eval)
    eval_rows = np.sort(eval_rows[: cfg.eval_size])
    if cfg.train_size is not None and cfg.train_size < len(train_rows):
        train_rows = np.sort(rng.choice(train_rows, cfg.train_size, replace=False))
    return train_rows, eval_rows


def load_rows(
    cfg: TaskConfig,
    base_dir: str | Path,
    seed: int,
    algorithm: str,
    convert: Callable[[Row], T],
) -> tuple[Rows[T], list[T]]:
    """The train split (lazy :class:`Rows`) and the eval split (a list of at most
    ``eval_size``) of ``task.train`` and ``task.eval``.

    Args:
        cfg: the task section; ``cfg.train`` is set.
        base_dir: the manifest's folder.
        seed: the campaign's ``training.seed``: fixes the split, the same for every member.
        algorithm: ``algorithm.name``, which decides the fields a row must have.
        convert: makes one row into what the algorithm reads.

    Raises:
        ConfigError: an unreadable source, a missing field, a template naming an unknown field,
            a non-text field for SFT or DPO, or a split that leaves no training rows.
    """
    assert cfg.train is not None
    sources = {"task.train": open_rows(cfg.train, base_dir, "task.train")}
    if cfg.eval is not None:
        sources["task.eval"] = open_rows(cfg.eval, base_dir, "task.eval")
    wanted = required_fields(cfg, algorithm)
    for key, table in sources.items():
        where = f"{key} ({getattr(cfg, key.removeprefix('task.'))!r})"
        check_fields(table.column_names, wanted, where)
        check_template(cfg.prompt_template, table.column_names, where)
        if algorithm in ("SFT", "DPO"):
            _check_text(table, wanted, where)
        if algorithm == "DPO":
            _check_pairs(table, cfg.chosen_field, cfg.rejected_field, where)
    train, held_out = sources["task.train"], sources.get("task.eval")
    train_rows, eval_rows = split_rows(
        len(train), None if held_out is None else len(held_out), cfg, seed
    )
    if held_out is None and algorithm in ("SFT", "DPO") and cfg.prompt_field in train.column_names:
        train_rows = _drop_shared(train, train_rows, eval_rows, cfg.prompt_field)
    if not len(train_rows):
        raise ConfigError(
            [
                f"task.eval_fraction ({cfg.eval_fraction}) leaves no training rows: task.train "
                f"({cfg.train!r}) holds {len(train)} rows (rows sharing a prompt with a held-out "
                "row are held out too); add rows, lower eval_fraction, or give task.eval"
            ]
        )
    eval_split = list(Rows(held_out if held_out is not None else train, eval_rows, convert))
    return Rows(train, train_rows, convert), eval_split


def _check_text(table: datasets.Dataset, wanted: dict[str, str], where: str) -> None:
    """SFT and DPO fields hold text (a response is tokenised as it is)."""
    problems = [
        f"{key} ({name!r}) of {where} holds {table.features[name]} values, not text; quote them "
        "as strings"
        for key, name in wanted.items()
        if getattr(table.features[name], "dtype", None) not in ("string", "large_string")
    ]
    if problems:
        raise ConfigError(problems)


def _check_pairs(table: datasets.Dataset, chosen: str, rejected: str, where: str) -> None:
    """No DPO row prefers a response to itself (compared by Arrow, in place)."""
    import pyarrow.compute as pc

    same = pc.equal(table.data.column(chosen), table.data.column(rejected))
    rows = np.flatnonzero(same.to_numpy(zero_copy_only=False))
    if len(rows):
        shown = ", ".join(str(r + 1) for r in rows[:5]) + (" ..." if len(rows) > 5 else "")
        raise ConfigError(
            [
                f"{where}: {len(rows)} row(s) (row {shown}) have the same chosen and rejected "
                "response; drop them (they state no preference)"
            ]
        )


def _drop_shared(
    table: datasets.Dataset, train_rows: np.ndarray, eval_rows: np.ndarray, field: str
) -> np.ndarray:
    """``train_rows`` without those whose ``field`` (the prompt) is also a held-out row's, so
    eval measures prompts never trained on even when a file holds several rows per prompt.
    Arrow compares the column in place; only a mask of one byte a row is made."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table.data.column(field)
    held = pa.array([table[int(i)][field] for i in eval_rows], type=column.type)
    shared = pc.is_in(column, value_set=held).to_numpy(zero_copy_only=False)
    return train_rows[~shared[train_rows]]


# -- pbt check ---------------------------------------------------------------------------


def check_rows(cfg: TaskConfig, base_dir: str | Path, algorithm: str) -> list[str]:
    """Problems with the first rows of ``task.train`` and ``task.eval`` (and of each stage's):
    unreadable, empty, a missing field or a template naming an unknown one. Hub datasets are
    not read here."""
    problems: list[str] = []
    named = [(f"task.{key}", getattr(cfg, key)) for key in ("train", "eval")]
    for i, stage in enumerate(cfg.stages):  # a curriculum: each stage's own files
        named += [(f"task.stages[{i}].{key}", getattr(stage, key)) for key in ("train", "eval")]
    for key, source in named:
        if source is None or source.startswith(HUB_PREFIX):
            continue
        where = f"{key} ({source!r})"
        try:
            found = preview_fields(Path(base_dir) / source, where)
            check_fields(found, required_fields(cfg, algorithm), where)
            check_template(cfg.prompt_template, found, where)
        except ConfigError as err:
            problems += err.problems
    return problems


def first_row(cfg: TaskConfig, base_dir: str | Path) -> Row | None:
    """The first row of ``task.train`` (a file or ``save_to_disk`` folder), read as
    :func:`preview_fields` reads; None for a hub dataset or rows that cannot be read (which
    :func:`check_rows` reports)."""
    if cfg.train is None or cfg.train.startswith(HUB_PREFIX):
        return None
    path = Path(base_dir) / cfg.train
    try:
        if path.is_dir():
            table = _open_folder(path, "task.train")
            return table[0] if len(table) else None
        with quiet():
            return next(iter(_open_file(path, "task.train", streaming=True).take(1)), None)
    except Exception:  # reported by check_rows, which reads the same rows
        return None


def preview_fields(path: Path, where: str) -> list[str]:
    """The fields of the first rows of a file or ``save_to_disk`` folder, reading no more of a
    file than its first :data:`PREVIEW_ROWS` rows.

    Raises:
        ConfigError: nothing there, an unknown format, or an empty or unparsable start.
    """
    if not path.exists():
        raise ConfigError(
            [f"{where} not found: nothing at {path}; give a path relative to the manifest's folder"]
        )
    if path.is_dir():
        return list(_open_folder(path, where).column_names)
    stream = _open_file(path, where, streaming=True)
    try:
        with quiet():
            rows = list(stream.take(PREVIEW_ROWS))
    except Exception as err:  # the stream parses as it is read
        raise ConfigError(
            [_parse_problem(path, where, FORMATS[path.suffix.lower()], err)]
        ) from None
    if not rows:
        raise ConfigError([f"{where} holds no rows ({path}); add rows to it"])
    return list(dict.fromkeys(k for row in rows for k in row))
