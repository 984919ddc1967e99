"""AgileRL's environment-backed ``environment:`` keys onto ``task.env``.

AgileRL names a multi-turn environment in three spellings, all read here:

- ``env_type: rollout`` with ``entrypoint: path/to/file.py:Attr`` (or a module's factory such
  as ``gem:make`` with ``env_config: {env_id: ...}``), ``env_config`` its keyword arguments,
  ``max_turns``;
- the Arena's ``factory: gem:make`` with ``entrypoint: game:...``;
- the older ``env_type: multiturn`` with ``env_name: game:...``.

A file's class becomes ``task.env: {file, class, kwargs}``. GEM's environments are not bundled;
its guess-the-number game (``game:GuessTheNumber-v0-easy`` and ``-hard``) is played by
``builtin:guess_number`` over GEM's range and turns, with a note saying how the two differ.
Keys for an environment served elsewhere (``env_url``, ``mcp_tool``, ...) or rendered by
AgileRL's observation processors are refused in one line each: environments run in the
member's process here and return their observations as text.
"""

from __future__ import annotations

from typing import Any

from pbt.config.agilerl.rules import Translation

SOURCES = ("entrypoint", "factory", "env_name", "env_url")
"""The keys that say where AgileRL's environment comes from."""

GEM_FACTORY = "gem:make"
GEM_GAMES = {
    "game:GuessTheNumber-v0-easy": {"low": 1, "high": 10, "max_turns": 4},
    "game:GuessTheNumber-v0-hard": {"low": 1, "high": 50, "max_turns": 7},
}
"""GEM's registered guessing games -> ``builtin:guess_number``'s arguments (GEM's range and
turns)."""
_GEM_ARGUMENTS = {"min_number": "low", "max_number": "high", "max_turns": "max_turns"}
"""GEM's ``GuessTheNumberEnv`` keyword -> ``builtin:guess_number``'s."""

_REMOTE = "environments run in the member's process here, not behind a URL"
_REFUSED = {
    "env_url": f"{_REMOTE}; write the environment as a class in a .py file and give "
    "entrypoint: file.py:Class",
    "mcp_tool": f"{_REMOTE}; give the environment its tools as Python functions (its tools "
    "attribute, see docs/environments.md)",
    "request_timeout_s": f"{_REMOTE}; task.env_timeout_s bounds each reset, step and tool call",
    "observation_field": "an environment's reset() and step() return the observation as text "
    "here; render it there and remove the key",
    "observation_processor": "an environment's reset() and step() return the observation as "
    "text here; render it there and remove the key",
}
MULTITURN_KEYS = (
    *SOURCES, "env_config", "env_packages", "max_turns", "strict_chat_template_boundary",
    "action_field", "chat_template_kwargs", "mcp_tool", "request_timeout_s",
    "observation_field", "observation_processor",
)  # fmt: skip
"""Every environment-backed key of AgileRL's ``LLMEnvSpec`` read by :func:`translate_multiturn`."""


def translate_multiturn(out: Translation, block: dict[str, Any]) -> None:
    """The environment-backed keys of ``environment:`` -> ``task.env`` (and notes, problems)."""
    env = _environment(out, block)
    if env is not None:
        if "max_turns" in block:
            env["max_turns"] = block["max_turns"]
        out.sets.append(("task.env", env, _origin(block)))
    elif not any(key in block for key in SOURCES):
        out.problems.append(
            f"environment.env_type ({block.get('env_type')!r}) names no environment; give "
            "environment.entrypoint: file.py:Class (or env_name: a GEM guessing game)"
        )
    _other_keys(out, block)


def translate_dataset_keys(out: Translation, block: dict[str, Any]) -> None:
    """The same keys beside rows (a single-turn ``environment:``): ``max_turns`` 1 is what
    rows are; ``env_config`` without an entrypoint is refused, as AgileRL refuses it."""
    if block.get("max_turns", 1) != 1:
        out.problems.append(
            f"environment.max_turns ({block['max_turns']!r}) is refused: rows are single-turn "
            "(AgileRL: max_turns is 1 with a dataset); remove it, or name an environment with "
            "environment.entrypoint: file.py:Class"
        )
    if "env_config" in block:
        out.problems.append(
            "environment.env_config is refused: it is the keyword arguments of an "
            "environment.entrypoint, and none is named"
        )
    _other_keys(out, block)


def _other_keys(out: Translation, block: dict[str, Any]) -> None:
    for key, why in _REFUSED.items():
        if key in block:
            out.problems.append(f"environment.{key} ({block[key]!r}) is refused: {why}")
    _harmless(out, block)


def _origin(block: dict[str, Any]) -> str:
    for key in ("env_name", "entrypoint"):
        if key in block:
            return f"environment.{key}"
    return "environment"


def _environment(out: Translation, block: dict[str, Any]) -> dict[str, Any] | None:
    """``task.env`` from the source keys, or None (with a problem where one was given)."""
    config = block.get("env_config") or {}
    if not isinstance(config, dict):
        out.problems.append(
            f"environment.env_config ({config!r}) must map keyword arguments to values"
        )
        return None
    factory, entrypoint = block.get("factory"), block.get("entrypoint")
    if "env_name" in block:
        return _gem_game(out, "environment.env_name", block["env_name"], config)
    if factory is not None:
        if factory != GEM_FACTORY:
            out.problems.append(
                f"environment.factory ({factory!r}) is refused: only {GEM_FACTORY}'s "
                "guess-the-number games map here; give entrypoint: file.py:Class instead"
            )
            return None
        return _gem_game(out, "environment.entrypoint", entrypoint, config)
    if entrypoint is None:
        return None  # env_url, refused by the caller
    if entrypoint == GEM_FACTORY:
        rest = {k: v for k, v in config.items() if k != "env_id"}
        return _gem_game(out, "environment.env_config.env_id", config.get("env_id"), rest)
    return _entrypoint(out, str(entrypoint), config)


def _entrypoint(out: Translation, entrypoint: str, config: dict[str, Any]) -> dict | None:
    """``path/to/file.py:Attr`` -> ``{file, class, kwargs}``; a module's attribute is refused."""
    path, sep, attr = entrypoint.rpartition(":")
    if not sep or not path.endswith(".py") or not attr:
        out.problems.append(
            f"environment.entrypoint ({entrypoint!r}) is refused: task.env reads a class from "
            "a .py file (a module's factory is not imported here); give "
            "entrypoint: path/to/file.py:Class, relative to the manifest's folder"
        )
        return None
    return {"file": path, "class": attr, "kwargs": dict(config)}


def _gem_game(out: Translation, where: str, env_id: Any, config: dict[str, Any]) -> dict | None:
    """One of GEM's guessing games as ``builtin:guess_number`` (with a note); others refused."""
    game = GEM_GAMES.get(str(env_id))
    if game is None:
        known = " and ".join(GEM_GAMES)
        out.problems.append(
            f"{where} ({env_id!r}) is refused: GEM's environments are not bundled here (only "
            f"{known} map, onto builtin:guess_number); write the environment as a class in a "
            ".py file and give environment.entrypoint: file.py:Class"
        )
        return None
    kwargs = dict(game)
    for key, value in config.items():
        ours = _GEM_ARGUMENTS.get(str(key))
        if ours is None:
            out.problems.append(
                f"environment.env_config.{key} is not an argument of GEM's guess-the-number "
                f"game; use {', '.join(_GEM_ARGUMENTS)}"
            )
        else:
            kwargs[ours] = value
    out.notes.append(
        f"{where} ({env_id!r}): GEM's guess-the-number game is played by builtin:guess_number "
        f"over the same range ({kwargs['low']} to {kwargs['high']}) and turns "
        f"({kwargs['max_turns']}); its replies are a bare number (GEM's: \\boxed{{n}}) and its "
        "reward is 1 less 0.1 per wrong guess (GEM's: 1 on success, by distance at the last "
        "turn, a penalty for an invalid guess)"
    )
    return {"class": "builtin:guess_number", "kwargs": kwargs}


def _harmless(out: Translation, block: dict[str, Any]) -> None:
    """Keys whose AgileRL value is what happens here anyway (silently), or that only install
    or name things (a note); any other value would change results (a problem)."""
    if "env_packages" in block:
        out.notes.append(
            f"environment.env_packages ({block['env_packages']!r}): nothing is installed here; "
            "install what the environment imports into the Python that runs the members"
        )
    if block.get("strict_chat_template_boundary", True) is not True:
        out.problems.append(
            "environment.strict_chat_template_boundary (False) is refused: a chat template "
            "whose turns do not append is always an error here (never replaced by ChatML "
            "markers); remove the key, or set model.name to a chat model whose turns append"
        )
    if block.get("action_field", "message") != "message":
        out.problems.append(
            f"environment.action_field ({block['action_field']!r}) is refused: step() receives "
            "the reply as a string here; remove the key"
        )
    if block.get("chat_template_kwargs"):
        out.problems.append(
            f"environment.chat_template_kwargs ({block['chat_template_kwargs']!r}) is refused: "
            "the chat template is rendered with its defaults here; remove the key"
        )
