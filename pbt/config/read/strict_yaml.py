"""YAML read strictly and within bounds: the parser every manifest file goes through.

A :class:`StrictLoader` is PyYAML's safe loader (no tags that build Python objects) with three
more rules, each broken one line that says where and why:

- a key given twice in one mapping is an error naming the key and both lines (PyYAML keeps
  the last value without a word);
- nesting is at most :data:`MAX_DEPTH` levels, counted as the document is composed, so a
  3,000-level file is refused before Python's recursion limit is near;
- aliases (``*name``) are allowed, but what they expand to is measured on the composed nodes
  before anything is built: at most :data:`MAX_NODES` nodes and :data:`MAX_DEPTH` levels once
  every alias is replaced by what it names, and no alias inside the node it names. A "billion
  laughs" document (nine levels of nine-fold aliases) is refused in milliseconds; without the
  bound, later steps that walk the values (validation, messages quoting a value) would expand
  it.

The file itself is read up to :data:`MAX_BYTES`: a manifest is a few kilobytes of YAML.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_DEPTH = 64
"""Levels of nesting a manifest may have (its deepest section holds about five)."""
MAX_NODES = 10_000
"""Values (mappings, lists, scalars) a manifest may hold, its aliases expanded (the reference
manifest, every key written out, holds about 400)."""
MAX_BYTES = 256 << 10
"""The largest manifest file read (256 KiB; the reference manifest is about 20 KB). PyYAML
parses some 50 KB a second on a busy machine: the bound keeps ``pbt check`` within seconds."""


NO_DOCUMENT = object()
"""What :func:`load_strict` returns for a text without a YAML document (empty, or comments)."""


class ManifestYAMLError(ValueError):
    """A YAML document that parses but breaks one of :class:`StrictLoader`'s rules; its message
    is one line: where, what, and the fix."""


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that bounds nesting as it composes (see the module docstring)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:  # type: ignore[override]
        self._depth += 1
        try:
            self._nodes += 1
            if self._depth > MAX_DEPTH:
                raise ManifestYAMLError(_too_deep(self.peek_event().start_mark))
            if self._nodes > MAX_NODES:
                line = self.peek_event().start_mark.line + 1
                raise ManifestYAMLError(
                    f"more than {MAX_NODES:,} values by line {line}; a manifest holds a few "
                    "hundred: rows go in a file that task.train names"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def fetch_flow_collection_start(self, TokenClass: type) -> None:
        # The scanner looks ahead over a flow collection's opening brackets (each may start a
        # key) in quadratic time: count them as they come, before the composer sees any.
        if self.flow_level >= MAX_DEPTH:
            raise ManifestYAMLError(_too_deep(self.get_mark()))
        super().fetch_flow_collection_start(TokenClass)


def _too_deep(mark: yaml.Mark) -> str:
    return (
        f"nesting deeper than {MAX_DEPTH} levels at line {mark.line + 1}, column "
        f"{mark.column + 1}; a manifest's sections are a few levels deep: flatten the document"
    )


def load_strict(text: str) -> Any:
    """The one YAML document in ``text``, built with :class:`StrictLoader`;
    :data:`NO_DOCUMENT` when ``text`` holds none (empty, or only comments).

    Raises:
        yaml.YAMLError: not valid YAML (PyYAML's error, with its marks).
        ManifestYAMLError: a duplicate key, too deep, or aliases that expand too far.
    """
    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return NO_DOCUMENT
        _measure(node)
        _check_duplicates(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


@dataclass(slots=True)
class _Size:
    nodes: int
    depth: int


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _measure(root: Node) -> None:
    """Refuse a document whose aliases expand past :data:`MAX_NODES` nodes or
    :data:`MAX_DEPTH` levels, or lead into the node that holds them. Each distinct node is
    visited once (post-order, an explicit stack), its expanded size computed from its
    children's, so a bomb is measured without being expanded."""
    sizes: dict[int, _Size] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            open_nodes.discard(id(node))
            kids = [sizes[id(c)] for c in _children(node)]
            size = _Size(
                1 + sum(k.nodes for k in kids), 1 + max((k.depth for k in kids), default=0)
            )
            sizes[id(node)] = size
            if size.nodes > MAX_NODES or size.depth > MAX_DEPTH:
                raise ManifestYAMLError(_too_large(node, size))
            continue
        if id(node) in sizes:
            continue
        open_nodes.add(id(node))
        stack.append((node, True))
        for child in _children(node):
            if id(child) in open_nodes:
                raise ManifestYAMLError(
                    f"an alias at line {child.start_mark.line + 1} names a node that holds it "
                    "(a value that contains itself); write the value out"
                )
            if id(child) not in sizes:
                stack.append((child, False))


def _too_large(node: Node, size: _Size) -> str:
    line = node.start_mark.line + 1
    if size.depth > MAX_DEPTH:
        what = f"nest deeper than {MAX_DEPTH} levels"
    else:
        what = f"hold more than {MAX_NODES:,} values"
    return (
        f"the value at line {line} would {what} once its YAML aliases (*name) are expanded (an "
        "alias bomb?); aliases may repeat a value, not multiply it: write the values out"
    )


def _check_duplicates(root: Node) -> None:
    """Refuse a mapping that gives a key twice (``<<`` merge keys aside, which YAML allows to
    be overridden), naming the key's path and both lines."""
    seen: set[int] = set()
    stack: list[tuple[Node, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, SequenceNode):
            stack += [(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
        elif isinstance(node, MappingNode):
            first: dict[tuple[str, str], Node] = {}
            for key, value in node.value:
                name = _key_name(key)
                where = f"{path}.{name}" if path else name
                if isinstance(key, ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    earlier = first.setdefault((key.tag, key.value), key)
                    if earlier is not key:
                        raise ManifestYAMLError(
                            f"{where} is given twice, at lines {earlier.start_mark.line + 1} and "
                            f"{key.start_mark.line + 1}; keep one"
                        )
                stack.append((value, where))


def _key_name(key: Node) -> str:
    return str(key.value) if isinstance(key, ScalarNode) else f"<{key.id} key>"
