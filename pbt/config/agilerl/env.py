"""AgileRL's ``environment:`` and ``network:`` sections, onto ``task``, ``model`` and ``lora``."""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

from pbt.config.agilerl.multiturn import (
    MULTITURN_KEYS,
    SOURCES,
    translate_dataset_keys,
    translate_multiturn,
)
from pbt.config.agilerl.rules import INIT_HP_RULES, Translation
from pbt.config.sections.task import HUB_PREFIX

_FIELDS = {"question": "question_field", "answer": "answer_field", "prompt": "prompt_field",
           "response": "response_field", "chosen": "chosen_field", "rejected": "rejected_field"}  # fmt: skip
"""The column a row is renamed to in AgileRL -> the task field that names it here."""
_FILE_SUFFIXES = (".parquet", ".pq", ".jsonl", ".json", ".csv", ".arrow")


def translate_environment(out: Translation, block: dict[str, Any]) -> None:
    """``environment:`` -> ``task``: rows, field names, prompt turns, held-out share, reward;
    or a multi-turn environment (:mod:`pbt.config.agilerl.multiturn`)."""
    if any(key in block for key in SOURCES) or block.get("env_type") == "multiturn":
        translate_multiturn(out, block)
    else:
        translate_dataset_keys(out, block)
    block = {k: v for k, v in block.items() if k not in MULTITURN_KEYS}
    columns = block.get("columns") or {}
    if not isinstance(columns, dict):
        out.problems.append(f"environment.columns ({columns!r}) must map a column to its role")
        columns = {}
    renamed = {str(role): str(column) for column, role in columns.items()}
    for key, value in block.items():
        handler = _ENV_KEYS.get(str(key))
        if handler is None:
            known = ", ".join(sorted({*_ENV_KEYS, *MULTITURN_KEYS}))
            out.problems.append(f"environment.{key} is not a known key; known: {known}")
            continue
        handler(out, value, renamed)
    _reward(out, block)


def _reward(out: Translation, block: dict[str, Any]) -> None:
    """The file and the name in it of the reward -> ``task.reward``. AgileRL reads
    ``rubric_file_path`` and ``reward_file_path`` as one key, and ``rubric_name`` and
    ``reward_fn_name`` as another; the name is a reward function or an OpenEnv rubric."""
    values = []
    for keys in (("rubric_file_path", "reward_file_path"), ("rubric_name", "reward_fn_name")):
        given = [k for k in keys if k in block]
        if len(given) > 1:
            out.problems.append(
                f"environment.{given[0]} and environment.{given[1]} are one key in AgileRL; "
                "give one of them"
            )
            return
        values.append(block[given[0]] if given else None)
    file, name = values
    if file is None and name is None:
        return
    if file is None or name is None:
        out.problems.append(
            "environment.reward_file_path (or rubric_file_path) and reward_fn_name (or "
            "rubric_name) go together; give the file and the name in it of "
            "reward_fn(completion, answer, question) or of an OpenEnv rubric"
        )
        return
    out.sets.append(("task.reward", {"file": file, "function": name}, "environment.reward"))
    if "rubric_name" in block:
        out.notes.append(
            f"environment.rubric_name ({name!r}): a rubric is scored as task.reward, called with "
            "the completion as action.message and the row's question and answer; only its total "
            f"is logged (reward/{name}), not each component's score"
        )


def _dataset(out: Translation, value: Any, _: dict[str, str]) -> None:
    path = str(value)
    local = PurePath(path).suffix in _FILE_SUFFIXES or path.startswith((".", "/"))
    out.sets.append(("task.train", path if local else HUB_PREFIX + path, "environment.dataset"))


def _columns(out: Translation, value: Any, renamed: dict[str, str]) -> None:
    for role, column in renamed.items():
        if role not in _FIELDS:
            out.problems.append(
                f"environment.columns.{column} ({role!r}) names no role here; use one of "
                f"{', '.join(_FIELDS)}"
            )
        else:
            out.sets.append((f"task.{_FIELDS[role]}", column, f"environment.columns.{column}"))


def _response(out: Translation, value: Any, _: dict[str, str]) -> None:
    out.sets.append(("task.response_field", value, "environment.response_column"))


def _split(out: Translation, value: Any, _: dict[str, str]) -> None:
    if not isinstance(value, (int, float)) or not 0 < value < 1:
        out.problems.append(
            f"environment.train_test_split ({value!r}) must be a training share in (0, 1)"
        )
        return
    out.sets.append(("task.eval_fraction", round(1.0 - value, 10), "environment.train_test_split"))


def _template(out: Translation, value: Any, renamed: dict[str, str]) -> None:
    """Turns ``{role}_{index}``, in order: a system turn, one user turn and, last, an assistant
    turn that starts the reply (``task.assistant_prefill``). The user turn's ``{question}`` and
    ``{answer}`` name the row's own columns here, as AgileRL's rename made them.

    The order is the turns' indices (AgileRL takes the mapping's order, which its names spell
    out): a copy whose keys were sorted, as a campaign's store keeps it, means the same.
    Without an index on every turn, the mapping's order stands."""
    if not isinstance(value, dict):
        out.problems.append(f"environment.prompt_template ({value!r}) must map turns to text")
        return
    turns = list(value.items())
    if all(_turn_index(turn) is not None for turn, _ in turns):
        turns.sort(key=lambda item: _turn_index(item[0]))
    last = turns[-1][0] if turns else None
    for turn, text in turns:
        role = str(turn).rsplit("_", 1)[0]
        where = f"environment.prompt_template.{turn}"
        if role == "system":
            out.sets.append(("task.system_prompt", text, where))
        elif role == "user":
            for name in ("question", "answer"):
                text = str(text).replace("{" + name + "}", "{" + renamed.get(name, name) + "}")
            out.sets.append(("task.prompt_template", text, where))
        elif role == "assistant" and turn == last:
            _prefill(out, str(text), where)
        else:
            out.problems.append(
                f"{where} is refused: only a last assistant turn (the start of the reply) is "
                f"supported here, not a {role} turn before it, and dropping it would change what "
                "the model is asked; move its text into the user turn or remove it"
            )


def _turn_index(turn: Any) -> int | None:
    """The index of a ``{role}_{index}`` turn; None for a name without one."""
    head, _, index = str(turn).rpartition("_")
    return int(index) if head and index.isdigit() else None


def _prefill(out: Translation, text: str, where: str) -> None:
    if "{question}" in text or "{answer}" in text:
        out.problems.append(
            f"{where} is refused: task.assistant_prefill is literal text, the same for every "
            "row; move {question} or {answer} into the user turn"
        )
        return
    out.sets.append(("task.assistant_prefill", text, where))


def _env_type(out: Translation, value: Any, _: dict[str, str]) -> None:
    if value not in ("rollout", "reasoning", "preference", "dataset", "multiturn"):
        out.problems.append(
            f"environment.env_type ({value!r}) is refused: prompt datasets (rollout, reasoning, "
            "preference) and environments (rollout or multiturn, with an entrypoint) are read here"
        )


def _max_reward(out: Translation, value: Any, _: dict[str, str]) -> None:
    """AgileRL's reasoning loop logs ``accuracy``, the share of a step's rewards equal to
    ``max_reward``; it neither stops training nor enters fitness, so it is a note here."""
    out.notes.append(
        f"environment.max_reward ({value!r}): AgileRL only logs the share of training rewards "
        "equal to it (accuracy) and does not stop there; it is not logged here, and fitness is "
        "the mean held-out reward: give budget.target_fitness to stop at a score"
    )


def _skip(out: Translation, value: Any, _: dict[str, str]) -> None:
    """Read together with its partner key, in :func:`translate_environment`."""


_ENV_KEYS = {
    "env_type": _env_type,
    "dataset": _dataset,
    "columns": _columns,
    "response_column": _response,
    "train_test_split": _split,
    "prompt_template": _template,
    "max_reward": _max_reward,
    "reward_file_path": _skip,
    "reward_fn_name": _skip,
    "rubric_file_path": _skip,
    "rubric_name": _skip,
}


def translate_network(out: Translation, block: dict[str, Any]) -> None:
    """``network:`` -> the base model, the vLLM context length and the LoRA adapter."""
    for key, value in block.items():
        where = f"network.{key}"
        if key == "pretrained_model_name_or_path":
            out.sets.append(("model.name", value, where))
        elif key == "max_context_length":
            out.apply(INIT_HP_RULES["MAX_MODEL_LEN"], where, value)
        elif key == "lora_config":
            out.apply(INIT_HP_RULES["LORA"], where, value)
        else:
            out.problems.append(
                f"{where} is not a known key; known: pretrained_model_name_or_path, "
                "max_context_length, lora_config"
            )
