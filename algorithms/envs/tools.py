"""Tools: plain Python functions the model may call in its reply.

A tool is a function with a name, a Google-style docstring (a summary line and an ``Args:``
section) and type hints; its JSON schema comes from ``transformers.utils.get_json_schema``. The
schemas reach the model through the tokenizer's chat template (``tools=``) when the template
renders tools, else as a system turn that lists them.

A call is a JSON object between tags, anywhere in the reply (the Hermes/Qwen convention)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>

The first call in a reply is run (within ``task.env_timeout_s``); its result, as text, comes
back as the next observation in a ``tool`` turn. A reply that names no known tool, or whose JSON
does not parse, is no call: it goes to the environment's ``step`` as an action.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A parsed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


def parse_call(reply: str, names: Sequence[str]) -> ToolCall | None:
    """The first well-formed call in ``reply`` to one of ``names``; None if there is none."""
    for match in CALL.finditer(reply):
        try:
            data = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(data, dict) or data.get("name") not in names:
            continue
        arguments = data.get("arguments", {})
        if isinstance(arguments, dict):
            return ToolCall(str(data["name"]), arguments)
    return None


def schemas(tools: Sequence[Callable[..., Any]]) -> list[dict[str, Any]]:
    """Each tool's JSON schema (from its signature and docstring), as chat templates take."""
    from transformers.utils import get_json_schema

    return [get_json_schema(tool) for tool in tools]


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes the ``tools`` it is given."""
    template = tokenizer.chat_template
    return isinstance(template, str) and "tools" in template


def tools_system_prompt(tools: Sequence[Callable[..., Any]]) -> str:
    """A system turn that lists the tools and the call format, for templates without tools."""
    listed = "\n".join(json.dumps(schema["function"]) for schema in schemas(tools))
    return (
        "You may call these tools:\n"
        f"{listed}\n"
        'To call one, reply with <tool_call>{"name": ..., "arguments": {...}}</tool_call>; '
        "its result comes back in the next turn."
    )


def tool_result(value: Any) -> str:
    """A tool's return value as the observation text."""
    return value if isinstance(value, str) else json.dumps(value, default=str)
