"""The architecture, checked: floors, no import loops, and lazy imports only where they pay.

Every module under the package-dir mapping is read with ``ast`` (function-level imports and
``TYPE_CHECKING`` blocks included). Floors, bottom up::

    0  pbt.config (and the pbt package itself, whose exports are lazy)
    1  pbt.protocol
    2  pbt.evolution, pbt.tracking, pbt.distributed
    3  pbt.algorithms
    4  pbt.controller, pbt.launch, pbt.worker, pbt.library, pbt.estimate, pbt.train
    5  pbt.agilerl, pbt.hpo (AgileRL's import path for its selection and mutation)
    6  pbt.cli

as DESIGN.md's layout names them.

A module may import its own floor and the floors below, never one above; no module may reach
itself again through its imports. The one exception is a package's public face (``FACADES``):
``pbt.algorithms`` re-exports the algorithm handles of ``pbt.agilerl.agents`` by a lazy
``__getattr__``, so users write ``from pbt.algorithms import GRPO`` as in AgileRL. That import
serves users only: no project module may import the package ``pbt.algorithms`` itself (only its
submodules), so no code of a lower floor can come to depend on a higher one through it. A project import inside a function is allowed only when it
pulls in a heavy dependency (torch, transformers, peft, vllm, mlflow, optuna, ...) that the
importing module must not load at start: any other lazy import would only be hiding a loop.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import tomllib
from support import REPO

ROOT = REPO
FLOORS = {
    "pbt": 0,
    "pbt.config": 0,
    "pbt.configs": 0,
    "pbt.protocol": 1,
    "pbt.evolution": 2,
    "pbt.tracking": 2,
    "pbt.distributed": 2,
    "pbt.algorithms": 3,
    "pbt.algorithms.envs": 3,
    "pbt.controller": 4,
    "pbt.launch": 4,
    "pbt.worker": 4,
    "pbt.library": 4,
    "pbt.estimate": 4,
    "pbt.hpo": 5,
    "pbt.train": 4,
    "pbt.agilerl": 5,
    "pbt.cli": 6,
}
TORCH_FREE = (
    "pbt.config", "pbt.protocol", "pbt.evolution", "pbt.tracking", "pbt.controller",
    "pbt.launch", "pbt.estimate",
)  # fmt: skip
"""The controller side: packages whose modules never import torch, at module level or through
what they import."""
FACADES = {"pbt.algorithms": {"pbt.agilerl.agents"}}
"""Packages whose ``__init__`` re-exports, lazily and for users only, names of a higher floor."""
HEAVY = {
    "torch", "transformers", "peft", "vllm", "mlflow", "optuna", "optuna_dashboard",
    "matplotlib", "datasets", "safetensors", "numpy",
}  # fmt: skip


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    top: set[str] = field(default_factory=set)
    """Project modules imported at module level."""
    lazy: set[str] = field(default_factory=set)
    """Project modules imported inside functions."""
    heavy_top: set[str] = field(default_factory=set)
    """Heavy third-party packages imported at module level (outside TYPE_CHECKING)."""
    heavy_any: set[str] = field(default_factory=set)
    """Heavy third-party packages imported anywhere in the module."""


@cache
def modules() -> dict[str, Module]:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    found: dict[str, Module] = {}
    for package, folder in sorted(mapping.items(), key=lambda kv: len(kv[0])):
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *(p for p in parts if p not in ("__init__", "__main__"))])
            if parts[-1] == "__main__":
                name += ".__main__"
            found[name] = Module(name, path, is_package)
    for module in found.values():
        _read_imports(module, found)
    return found


def _read_imports(module: Module, known: dict[str, Module]) -> None:
    tree = ast.parse(module.path.read_text(), filename=str(module.path))

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.body:
                    visit_one(sub, in_function, True)
                for sub in child.orelse:
                    visit_one(sub, in_function, type_only)
                continue
            visit_one(child, in_function, type_only)

    def visit_one(node: ast.AST, in_function: bool, type_only: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(node, module, known):
                if target in known:
                    (module.lazy if in_function else module.top).add(target)
                elif target.split(".")[0] in HEAVY:
                    module.heavy_any.add(target.split(".")[0])
                    if not in_function and not type_only:
                        module.heavy_top.add(target.split(".")[0])
            return
        nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        visit(node, nested, type_only)

    visit(tree, False, False)


def _targets(node: ast.Import | ast.ImportFrom, module: Module, known: dict) -> list[str]:
    if isinstance(node, ast.Import):
        return [_longest_known(alias.name, known) for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.name if module.is_package else module.name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    out = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        out.append(candidate if candidate in known else _longest_known(base, known))
    return out


def _longest_known(name: str, known: dict) -> str:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return name


def floor(name: str) -> int:
    best = max((p for p in FLOORS if name == p or name.startswith(p + ".")), key=len)
    return FLOORS[best]


def test_every_module_has_a_floor():
    assert all(floor(name) is not None for name in modules())
    assert "pbt.controller.campaign" in modules() and "pbt.algorithms.grpo" in modules()


def _upward_allowed(module: Module, target: str) -> bool:
    """Whether ``module`` may import ``target`` of a higher floor: ``pbt`` itself, or a facade
    importing, inside a function, what it re-exports."""
    return module.name == "pbt" or (
        target in FACADES.get(module.name, ()) and target in module.lazy - module.top
    )


def test_no_import_climbs_a_floor():
    climbs = [
        f"{m.name} (floor {floor(m.name)}) imports {t} (floor {floor(t)})"
        for m in modules().values()
        for t in sorted(m.top | m.lazy)
        if floor(t) > floor(m.name) and not _upward_allowed(m, t)
    ]
    assert not climbs, "\n".join(climbs)


def test_facades_serve_users_only():
    """No project module imports a facade package itself, so none can reach, through it, the
    higher floor it re-exports."""
    users = [
        f"{m.name} imports the facade {t}; import the module that defines the name instead"
        for m in modules().values()
        for t in sorted(m.top | m.lazy)
        if t in FACADES and m.name != t
    ]
    assert not users, "\n".join(users)


def test_no_import_loop():
    graph = {name: m.top | m.lazy for name, m in modules().items() if name != "pbt"}
    loops = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    loops.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not loops, "\n".join(sorted(set(loops))[:20])


@cache
def _pulls_heavy(name: str) -> bool:
    """Whether importing ``name`` loads a heavy dependency, at module level, transitively.

    A package that re-exports its own submodules' names lazily (``pbt.distributed``'s
    ``__getattr__``) counts as loading them: ``from package import name`` does."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        module = modules()[current]
        if module.heavy_top:
            return True
        todo.extend(module.top)
        if module.is_package:  # a name its __getattr__ serves loads that submodule
            todo.extend(t for t in module.lazy if t.startswith(current + "."))
        parent = current.rpartition(".")[0]
        if parent in modules():
            todo.append(parent)
    return False


def test_lazy_imports_only_defer_heavy_dependencies():
    hiding = [
        f"{m.name} imports {t} inside a function, but {t} loads nothing heavy: import it at the top"
        for m in modules().values()
        for t in sorted(m.lazy - m.top)
        if not _upward_allowed(m, t) and not _pulls_heavy(t)
    ]
    assert not hiding, "\n".join(hiding)


def test_controller_side_imports_no_torch():
    """Statically: no module of the controller side (config, protocol, evolution, tracking,
    controller, launch, estimate) pulls torch in at import (the subprocess test below and the one
    in test_cli.py check the same at run time)."""
    light = [n for n in modules() if n.startswith(TORCH_FREE)]
    assert light
    heavy = [n for n in light if _pulls_heavy(n)]
    assert not heavy, heavy


def test_each_optional_engine_is_imported_in_one_module():
    """vLLM, MLflow and Optuna (and optuna-dashboard) each enter through one module only."""
    owners = {
        "vllm": {"pbt.algorithms.rollout.vllm"},
        "mlflow": {"pbt.tracking.tracker"},
        "optuna": {"pbt.evolution.search"},
        "optuna_dashboard": {"pbt.cli.serve"},
    }
    for package, expected in owners.items():
        found = {m.name for m in modules().values() if package in m.heavy_any}
        assert found == expected, f"{package} is imported by {sorted(found)}"


def test_controller_floors_load_no_torch_and_public_paths_resolve():
    """At run time, in a fresh interpreter: every module of the torch-free floors and the CLI
    imports without torch, mlflow or optuna; then the public paths resolve to one class."""
    light = sorted(n for n in modules() if n.startswith(TORCH_FREE))
    code = (
        "import importlib, sys\n"
        f"for name in {[*light, 'pbt.cli.main', 'pbt.library.create', 'pbt.hpo']!r}:\n"
        "    importlib.import_module(name)\n"
        "import pbt\n"
        "pbt.create_population, pbt.GRPO, pbt.FSDPConfig\n"
        "heavy = sorted({'torch', 'mlflow', 'optuna', 'transformers'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
        "from pbt.distributed import FSDPConfig\n"
        "from pbt.config import FSDPConfig as same\n"
        "assert FSDPConfig is same is pbt.FSDPConfig\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_tests_import_no_other_test_module():
    """What tests share lives in tests/support.py: a test that imports another test module
    works only when pytest happens to have collected that module first."""
    offenders = []
    for path in [*ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/tests/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("test_")]
    assert offenders == []


def test_every_project_import_names_a_module():
    """A project import names a module that exists: after a module moves, an importer left on
    its old path fails here, in the product, the tests, the benchmarks and the examples alike
    (the floor checks above would read the old path as its nearest existing package)."""
    known = modules()
    paths = [m.path for m in known.values()]
    paths += [p for folder in ("tests", "bench", "examples") for p in (ROOT / folder).rglob("*.py")]
    stale = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            stale += [
                f"{path.relative_to(ROOT)}:{node.lineno} imports {name}, which is no module"
                for name in names
                if name.startswith("pbt.") and name not in known
            ]
    assert stale == [], "\n".join(stale)
