"""The fields of one prompt-file record, read as the field's layouts write them: a value at a
dotted path into nested objects (verl's ``reward_model.ground_truth``), a prompt given as text
or as a list of chat messages (``[{"role": "user", "content": ...}]``), and the free-form
``extra_info`` a reward may read.

Every reader raises ``ValueError`` with a message that names the field (the caller puts the
file and row before it); none knows about files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")
"""Roles a chat message of a prompt may have."""

MISSING = object()
"""What :func:`field_value` returns for a path that leads nowhere."""


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a prompt given as a list of chat messages."""

    role: str
    """One of :data:`ROLES`."""
    content: str


def field_value(record: dict, path: str) -> Any:
    """The value at ``path`` in ``record``: the key itself when the record has it (a flat
    column whose name holds a dot), else the dotted path walked through nested objects.
    :data:`MISSING` when the walk meets a missing key; ``ValueError`` naming the path when it
    meets something that is not an object (``reward_model`` a string, say)."""
    if path in record:
        return record[path]
    value: Any = record
    walked: list[str] = []
    for key in path.split("."):
        if value is None:  # a parquet struct that is null on this row
            return MISSING
        if not isinstance(value, dict):
            raise ValueError(
                f"field {path!r}: {'.'.join(walked)!r} is {_short(value)}, not an object "
                f"with a key {key!r}"
            )
        if key not in value:
            return MISSING
        value = value[key]
        walked.append(key)
    return value


def missing_message(record: dict, path: str) -> str:
    """Why ``path`` leads nowhere in ``record``: which part of it is absent."""
    parts = path.split(".")
    value: Any = record
    for depth, key in enumerate(parts):
        if not isinstance(value, dict) or key not in value:
            if depth == 0:
                return f"field {path!r} is missing"
            parent = ".".join(parts[:depth])
            if value is None:
                return f"field {path!r} is missing ({parent!r} is null)"
            return f"field {path!r} is missing ({parent!r} has no key {key!r})"
        value = value[key]
    return f"field {path!r} is missing"


def prompt_value(value: Any, name: str) -> str | tuple[ChatMessage, ...]:
    """The prompt in field ``name``: a non-empty string, or a non-empty list of chat messages
    (objects with a ``role`` of :data:`ROLES` and a string ``content``; other keys, as a parquet
    struct column adds for fields other rows have, are ignored) holding a user message with
    text."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"field {name!r} must be a non-empty string, got {value!r}")
        return value
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"field {name!r} must be a non-empty string or a list of chat messages "
            f"(objects with 'role' and 'content'), got {_short(value)}"
        )
    if not value:
        raise ValueError(f"field {name!r} is an empty list of chat messages")
    messages = []
    for index, message in enumerate(value):
        where = f"field {name!r} message {index}"
        if not isinstance(message, dict):
            raise ValueError(
                f"{where} must be an object with 'role' and 'content', got {_short(message)}"
            )
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}: 'role' must be one of {list(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: 'content' must be a string, got {_short(content)}")
        messages.append(ChatMessage(role=role, content=content))
    if not any(m.role == "user" and m.content.strip() for m in messages):
        raise ValueError(f"field {name!r} has no user message with text")
    return tuple(messages)


def answer_value(value: Any, name: str) -> str:
    """The ground truth in field ``name``: a non-empty string, or a finite number kept as its
    text (a float NaN/inf is how pandas and parquet write a missing number: never an answer)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (str, int, float))
        or str(value).strip() == ""
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise ValueError(
            f"field {name!r} must be a non-empty string or a finite number, got {value!r}"
        )
    return str(value)


def data_source_value(value: Any) -> str | None:
    """``data_source``: a string naming the row's data set (a reward may dispatch on it)."""
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"field 'data_source' must be a string, got {_short(value)}")


def extra_info_value(value: Any) -> dict | None:
    """``extra_info``: an object of plain values (strings, numbers, booleans, null, lists and
    objects of them), handed to rewards as it is; plain, so that a checkpoint holding the row
    stays plain data."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"field 'extra_info' must be an object, got {_short(value)}")
    problem = _not_plain(value, "extra_info")
    if problem is not None:
        raise ValueError(problem)
    return value


def _not_plain(value: Any, where: str) -> str | None:
    """Why ``value`` (at ``where``) is not plain data, or None."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return None
    if isinstance(value, list):
        for i, item in enumerate(value):
            problem = _not_plain(item, f"{where}[{i}]")
            if problem is not None:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"field {where!r} has a key that is not a string: {key!r}"
            problem = _not_plain(item, f"{where}.{key}")
            if problem is not None:
                return problem
        return None
    return (
        f"field {where!r} holds a {type(value).__name__} ({_short(value)}); it may hold only "
        "strings, numbers, booleans, null, lists and objects"
    )


def _short(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters (a whole message list would drown the
    error)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
