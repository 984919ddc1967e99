"""Python files a manifest names (a reward function, an environment class), checked by parsing,
never by running: loading a manifest runs no user code (``pbt check`` then imports the file and
calls what it names once)."""

from __future__ import annotations

import ast
from pathlib import Path

from pbt.config.rules import shown


def definition_problems(base_dir: Path, file: str, name: str, prefix: str, key: str) -> list[str]:
    """Problems with ``file`` (relative to ``base_dir``) defining ``name`` at its top level: it
    cannot be read, is not valid Python, or does not define it. ``prefix.file`` and
    ``prefix.key`` are the manifest keys the problems name."""
    path = base_dir / file
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except OSError as err:
        return [
            f"{prefix}.file ({shown(file)}) cannot be read ({path}: {err.strerror}); give a .py "
            "path relative to the manifest's folder"
        ]
    except SyntaxError as err:
        return [
            f"{prefix}.file ({shown(file)}) is not valid Python: line {err.lineno}: {err.msg}; "
            "fix the file"
        ]
    defined = top_level_names(tree)
    if name in defined:
        return []
    found = ", ".join(defined) or "nothing"
    return [
        f"{prefix}.{key} ({shown(name)}) is not defined at the top level of {file}; "
        f"it defines: {found}"
    ]


def top_level_names(tree: ast.Module) -> list[str]:
    """Functions, classes and assigned names at the top level of a parsed file."""
    names = [
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    return names + [
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    ]
