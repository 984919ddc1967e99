"""Hostile manifests: each one given to ``pbt check`` exits 2 with one ``error:`` line and one
problem, no traceback, within a few seconds.

The cases are files as a careless or hostile user writes them: NaN and infinities, negative
timeouts, an alias bomb, 3,000 levels of nesting, duplicate keys, an empty file, binary garbage,
reward functions with the wrong signature or that return None, and the usual unknown keys,
wrong types and bad choices. Most run in this process through the CLI's own ``main()`` (the
same code as the ``pbt`` command, whose ``PbtError`` handler turns an error into exit 2), with
stdout and stderr captured; a few run as real ``pbt check`` processes.
"""

from __future__ import annotations

import importlib
import itertools
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pbt.cli.main import main

SECONDS = 5.0
"""The most one case may take in this process (the machine is shared; most take milliseconds)."""

REWARDS_PY = """
import math, sys, time

def good(completion, answer, question):
    return 1.0 if completion == answer else 0.0

def one(x):
    return 0.0

def kw(*, completion, answer, question):
    return 0.0

def extra(completion, answer, question, *, scale):
    return 0.0

not_callable = 3

def none(completion, answer, question):
    return None

def nan(completion, answer, question):
    return math.nan

def inf(completion, answer, question):
    return -math.inf

def text(completion, answer, question):
    return "1.0"

def raises(completion, answer, question):
    raise ValueError("cannot parse the completion")

def short(completions, answers, questions):
    return []

def hangs(completion, answer, question):
    time.sleep(60)
"""


def _bomb(leaf_key: str) -> str:
    """Nine levels of nine-fold aliases ('billion laughs': 9**9 leaves), the last one named
    under ``leaf_key`` (a YAML path such as ``lora:\\n  target_modules``)."""
    names = "abcdefghi"
    lines = [f"x-a: &a [{', '.join(['lol'] * 9)}]"]
    lines += [f"x-{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in itertools.pairwise(names)]
    return "\n".join(lines) + f"\n{leaf_key}: *i\n"


def _reward(function: str, **extra: object) -> str:
    fields = ", ".join(f"{k}: {v}" for k, v in {"file": "rewards.py", **extra}.items())
    return f"task:\n  name: builtin:letters\n  reward: {{{fields}, function: {function}}}\n"


Case = tuple[str | bytes | Callable[[Path], Path], str]
"""The file's text (or bytes, or a function that makes the path), and a part of the message."""

CASES: dict[str, Case] = {
    # numbers: NaN, infinities, negatives, zeros, out of range
    "lr nan": ("optim:\n  lr: .nan\n", "optim.lr (nan) must be a finite number"),
    "lr inf": ("optim:\n  lr: .inf\n", "optim.lr (inf) must be a finite number"),
    "lr minus inf": ("optim:\n  lr: -.inf\n", "optim.lr (-inf) must be a finite number"),
    "lr nan as a word": ("optim:\n  lr: nan\n", "optim.lr ('nan') must be a finite number"),
    "lr 1e999": ("optim:\n  lr: 1.0e+999\n", "optim.lr (inf) must be a finite number"),
    "lr 1e999 as a word": ("optim:\n  lr: 1.0e999\n", "optim.lr ('1.0e999') must be a finite"),
    "INIT_HP lr nan": ("INIT_HP:\n  LR: .nan\n", "optim.lr (nan) must be a finite number"),
    "temperature nan": ("rollout:\n  temperature: .nan\n", "rollout.temperature (nan)"),
    "alpha inf": ("lora:\n  alpha: .inf\n", "lora.alpha (inf) must be a finite number"),
    "target fitness nan": ("budget:\n  target_fitness: .nan\n", "budget.target_fitness (nan)"),
    "exploit gap nan": ("population:\n  exploit_gap: .nan\n", "population.exploit_gap (nan)"),
    "mutation weight nan": ("mutation:\n  no_mutation: .nan\n", "mutation.no_mutation (nan)"),
    "range min nan": (
        "mutation:\n  ranges:\n    lr: {min: .nan, max: 1.0e-3}\n", "mutation.ranges.lr",
    ),
    "beta nan in a list": ("optim:\n  betas: [.nan, 0.999]\n", "optim.betas[0] (nan)"),
    "task timeout negative": (
        "launch:\n  task_timeout_s: -1\n", "launch.task_timeout_s (-1.0) must be > 0",
    ),
    "task timeout zero": ("launch:\n  task_timeout_s: 0\n", "launch.task_timeout_s (0.0) must"),
    "task timeout inf": ("launch:\n  task_timeout_s: .inf\n", "launch.task_timeout_s (inf)"),
    "heartbeat negative": ("launch:\n  heartbeat_timeout_s: -5\n", "heartbeat_timeout_s (-5.0)"),
    "reward timeout zero": ("task:\n  reward_timeout_s: 0\n", "task.reward_timeout_s (0.0)"),
    "collective timeout negative": ("distributed:\n  timeout_s: -1\n", "distributed.timeout_s"),
    "wall time negative": ("budget:\n  wall_time_s: -10\n", "budget.wall_time_s (-10.0)"),
    "gpu hours zero": ("budget:\n  gpu_hours: 0\n", "budget.gpu_hours (0.0) must be > 0"),
    "memory limit negative": ("launch:\n  memory_limit_gib: -1\n", "launch.memory_limit_gib"),
    "slurm poll zero": ("launch:\n  slurm:\n    poll_s: 0\n", "launch.slurm.poll_s (0.0)"),
    "slurm gpus per node zero": (
        "launch:\n  backend: slurm\n  slurm:\n    gpus_per_node: 0\n", "gpus_per_node (0)",
    ),
    "gpu id negative": ("launch:\n  gpu_ids: [-1]\n", "launch.gpu_ids[0] (-1) must be >= 0"),
    "kv cache negative": ("rollout:\n  vllm:\n    cpu_kv_cache_gib: -1\n", "cpu_kv_cache_gib"),
    "steps negative": ("training:\n  steps: -3\n", "training.steps (-3) must be > 0"),
    "eval size zero": ("task:\n  eval_size: 0\n", "task.eval_size (0) must be > 0"),
    "train size negative": ("task:\n  train_size: -5\n", "or null for every row"),
    "population 1e30": (f"population:\n  size: {10**30}\n", "population.size (1000000000"),
    "seed past int64": (f"training:\n  seed: {2**70}\n", "is out of range"),
    "dropout above one": ("lora:\n  dropout: 1.5\n", "lora.dropout (1.5) must be in [0, 1)"),
    "top_p zero": ("rollout:\n  top_p: 0\n", "rollout.top_p (0.0) must be in (0, 1]"),
    "tournament above population": (
        "population:\n  size: 2\n  tournament_size: 5\n", "lower tournament_size",
    ),
    # YAML: aliases, nesting, duplicates
    "alias bomb under lora.target_modules": (
        _bomb("lora:\n  target_modules"), "once its YAML aliases (*name) are expanded",
    ),
    "alias bomb at the top level": (_bomb("bomb"), "once its YAML aliases (*name) are expanded"),
    "alias bomb under task.options": (_bomb("task:\n  options:\n    x"), "alias bomb"),
    "alias that holds itself": (
        "lora:\n  target_modules: &a [q_proj, *a]\n", "names a node that holds it",
    ),
    "3,000 levels of flow nesting": (
        "lora:\n  target_modules: " + "[" * 3000 + "]" * 3000 + "\n", "nesting deeper than 64",
    ),
    "3,000 levels of block sequences": ("- " * 3000 + "1\n", "nesting deeper than 64"),
    "100 levels of block mappings": (
        "".join("  " * i + f"k{i}:\n" for i in range(100)) + "  " * 100 + "v: 1\n",
        "nesting deeper than 64",
    ),
    "duplicate key in a section": (
        "optim:\n  lr: 1.0e-4\n  weight_decay: 0.0\n  lr: 2.0e-4\n",
        "optim.lr is given twice, at lines 2 and 4; keep one",
    ),
    "duplicate section": (
        "optim:\n  lr: 1.0e-4\nrollout:\n  top_k: 0\noptim:\n  eps: 1.0e-8\n",
        "optim is given twice, at lines 1 and 5",
    ),
    "duplicate key in a flow mapping": (
        "optim: {lr: 1.0e-4, lr: 2.0e-4}\n", "optim.lr is given twice, at lines 1 and 1",
    ),
    "duplicate key in INIT_HP": ("INIT_HP:\n  LR: 1.0e-4\n  LR: 1.0e-3\n", "INIT_HP.LR is given"),
    # files that hold no manifest
    "empty file": ("", "is empty: it holds nothing, no sections; start from configs/reference"),
    "only comments": ("# my manifest\n# todo\n", "it holds only comments"),
    "only blank lines": ("\n\n   \n", "is empty"),
    "a null document": ("~\n", "top level must be a mapping of sections, got NoneType"),
    "a list": ("- model\n- optim\n", "top level must be a mapping of sections, got list"),
    "a plain word": ("hello\n", "top level must be a mapping of sections, got str"),
    "two documents": ("optim: {}\n---\noptim: {}\n", "expected a single document"),
    "binary garbage": (bytes(random.Random(0).randrange(128, 256) for _ in range(512)), "UTF-8"),
    "NUL bytes": ("optim:\n  lr: 1\x00\n", "not valid YAML"),
    "larger than 256 KiB": ("# " + "x" * (300 << 10) + "\n", "larger than 256 KiB"),
    "more than 10,000 values": (
        "lora:\n  target_modules: [" + ", ".join(["q"] * 12000) + "]\n", "more than 10,000",
    ),
    "missing file": (lambda folder: folder / "nowhere.yaml", "No such file or directory"),
    "a folder": (lambda folder: _mkdir(folder / "a-folder.yaml"), "Is a directory"),
    "unclosed bracket": ("model: [unclosed\n", "not valid YAML at line 2"),
    "tab indentation": ("optim:\n\tlr: 1.0e-4\n", "not valid YAML"),
    "python object tag": (
        "optim: !!python/object/apply:os.system ['echo hostile']\n", "not valid YAML",
    ),
    "unhashable key": ("? [a, b]\n: 1\n", "not valid YAML"),
    # keys, types, choices
    "unknown section": ("modle:\n  name: x\n", "modle is not a known key; did you mean 'model'"),
    "unknown key": ("optim:\n  lrr: 1.0e-4\n", "optim.lrr is not a known key; did you mean 'lr'"),
    "unicode section": ("модель:\n  name: x\n", "модель is not a known key"),
    "unicode key": ("optim:\n  ľr: 1.0e-4\n", "optim.ľr is not a known key"),
    "emoji key": ("optim:\n  \U0001f680: 1\n", "optim.\U0001f680 is not a known key"),
    "integer key": ("optim:\n  1: 1\n", "optim.1 is not a known key"),
    "lr a list": ("optim:\n  lr: [1, 2]\n", "optim.lr ([1, 2]) must be a number"),
    "lr a date": ("optim:\n  lr: 2024-01-01\n", "optim.lr (datetime.date(2024, 1, 1))"),
    "steps a word": ("training:\n  steps: ten\n", "training.steps ('ten') must be an integer"),
    "size a boolean": ("population:\n  size: true\n", "population.size (True) must be an"),
    "section a number": ("optim: 3\n", "optim must be a mapping, got int 3"),
    "algorithm lowercase": ("algorithm:\n  name: grpo\n", "did you mean 'GRPO'"),
    "unknown engine": ("rollout:\n  engine: sglang\n", "rollout.engine ('sglang') must be one"),
    "a 200,000-character model name": (
        "model:\n  name: " + "a" * 200_000 + "\n", "is not a usable path (File name too long)",
    ),
    # rewards, checked by running them once on the first training row
    "reward file missing": (_reward("f", file="missing.py"), "task.reward.file ('missing.py')"),
    "reward function missing": (_reward("nowhere"), "is not defined at the top level"),
    "reward takes one argument": (
        _reward("one"), "(rewards.py:one) must take (completion, answer, question) by position",
    ),
    "reward keyword-only": (_reward("kw"), "its signature is (*, completion, answer, question)"),
    "reward with a required keyword": (_reward("extra"), "rewards.py:extra) must take"),
    "reward not callable": (_reward("not_callable"), "(rewards.py:not_callable) is 3 (int)"),
    "reward returns None": (_reward("none"), "rewards.py:none returned None (NoneType)"),
    "reward returns NaN": (_reward("nan"), "rewards.py:nan returned nan (float)"),
    "reward returns -inf": (_reward("inf"), "rewards.py:inf returned -inf (float)"),
    "reward returns a string": (_reward("text"), "rewards.py:text returned '1.0' (str)"),
    "reward raises": (_reward("raises"), "raised ValueError: cannot parse the completion"),
    "batched reward returns too few": (
        _reward("short", batched="true"), "returned 0 values for a batch of 1",
    ),
    "batched reward unbatched signature": (
        _reward("one", batched="true"), "must take (completions, answers, questions)",
    ),
    "reward hangs": (_reward("hangs") + "  reward_timeout_s: 1\n", "took longer than task.rewa"),
    "reward file fails to import": (
        _reward("f", file="broken_import.py"), "failed to import: ZeroDivisionError",
    ),
    "reward file exits on import": (_reward("f", file="exits.py"), "failed to import: SystemExit"),
    "reward file hangs on import": (
        _reward("f", file="sleeps.py") + "  reward_timeout_s: 0.1\n", "(1 s) to import; move",
    ),
    "one bad reward among several": (
        "task:\n  name: builtin:letters\n  rewards:\n    - {file: rewards.py, function: good}\n"
        "    - {file: rewards.py, function: none}\n",
        "task.rewards[1]: reward rewards.py:none returned None",
    ),
    "own rows, reward returns None": (
        "task:\n  train: rows.jsonl\n  reward: {file: rewards.py, function: none}\n",
        "question 'What is 2+3?', completion '5'",
    ),
}  # fmt: skip


def _mkdir(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Reward files and rows for the cases; the reward check's imports (torch) done once."""
    folder = tmp_path_factory.mktemp("hostile")
    (folder / "rewards.py").write_text(REWARDS_PY)
    f = "def f(completion, answer, question):\n    return 0.0\n"
    (folder / "broken_import.py").write_text(f + "x = 1 / 0\n")
    (folder / "exits.py").write_text(f + "import sys\nsys.exit(3)\n")
    (folder / "sleeps.py").write_text(f + "import time\ntime.sleep(60)\n")
    (folder / "rows.jsonl").write_text(
        '{"question": "What is 2+3?", "answer": "5"}\n{"question": "Spell cat", "answer": "cat"}\n'
    )
    # the reward check's first import is seconds of torch and datasets: not a case's time
    importlib.import_module("pbt.algorithms.data.rows")
    importlib.import_module("pbt.algorithms.data.tasks")

    return folder


def _path(folder: Path, name: str, content: str | bytes | Callable[[Path], Path]) -> Path:
    if callable(content):
        return content(folder)
    path = folder / f"{name.replace(' ', '_').replace('/', '_')}.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def test_the_suite_is_large() -> None:
    assert len(CASES) >= 60


@pytest.mark.parametrize("name", list(CASES))
def test_pbt_check_refuses_it_in_one_line(folder: Path, name: str, capsys) -> None:
    content, expected = CASES[name]
    path = _path(folder, name, content)
    started = time.perf_counter()
    code = main(["check", str(path)])
    elapsed = time.perf_counter() - started
    out, err = capsys.readouterr()
    _assert_one_problem(name, code, out, err, expected)
    assert elapsed < SECONDS, (name, elapsed)


def _assert_one_problem(name: str, code: int, out: str, err: str, expected: str) -> None:
    """Exit 2, nothing on stdout, one ``error:`` line with its one problem, no traceback."""
    assert code == 2, (name, code, err)
    assert "Traceback" not in out + err, (name, err)
    assert out == "", (name, out[:500])
    lines = [line for line in err.splitlines() if not line.startswith(("note:", "warning:"))]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, (name, err)
    assert errors[0].endswith(": 1 problem") and len(lines) == 2, (name, err)
    assert lines[1].startswith("  - ") and len(lines[1]) < 2000, (name, err[:2000])
    assert expected in err, (name, err)


SUBPROCESS_CASES = (
    "lr nan",
    "task timeout negative",
    "alias bomb under lora.target_modules",
    "3,000 levels of flow nesting",
    "duplicate key in a section",
    "empty file",
    "binary garbage",
    "reward takes one argument",
    "reward returns None",
)
"""Cases also run as real ``pbt check`` processes, all at once."""


@pytest.mark.integration
def test_the_pbt_command_refuses_them_the_same_way(folder: Path) -> None:
    paths = {name: _path(folder, name, CASES[name][0]) for name in SUBPROCESS_CASES}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "pbt.cli", "check", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, path in paths.items()
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        _assert_one_problem(name, proc.returncode, out, err, CASES[name][1])
