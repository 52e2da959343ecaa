"""Prompt sets: rows of (prompt, ground-truth answer, optional id, data source and extra
information) from JSONL or parquet files.

A row's prompt is read from the field ``prompt_key`` names (default ``prompt``, or ``problem``,
as benchmarks in the AIME format name it, in a row without ``prompt``), its answer from
``answer_key`` (default ``answer``). Either may be a dotted path into nested objects
(``reward_model.ground_truth``, where verl's preprocessed data sets keep the answer). The prompt
is a non-empty string or a list of chat messages (``[{"role": "user", "content": ...}]``, the
layout of verl's and OpenRLHF's data); the answer is a string or a number (numbers are kept as
their text); ``id`` is optional (missing or null: the row's 0-based position among the rows).
``data_source`` and ``extra_info`` are kept when a row has them, for rewards that read them
(:mod:`bapo_megatron.rewards.calling`). The fields are read by
:mod:`~bapo_megatron.data.record_fields`.

A malformed row raises ``ValueError`` naming the file, where in it, and the field, or, with
``skip_bad_rows``, is skipped and counted. Where in the file is ``path:N`` for JSONL, N the
1-based line number as editors show it (blank lines counted), and ``path 0-based row N`` for
parquet, N the index pyarrow and pandas use.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from bapo_megatron.data.record_fields import (
    MISSING,
    ChatMessage,
    answer_value,
    data_source_value,
    extra_info_value,
    field_value,
    missing_message,
    prompt_value,
)

DEFAULT_PROMPT_KEY = "prompt"
DEFAULT_ANSWER_KEY = "answer"
_AIME_PROMPT_KEY = "problem"  # read, with the default prompt key, in rows without `prompt`


@dataclass(frozen=True)
class PromptRow:
    """One problem of the prompt set."""

    id: str
    prompt: str | tuple[ChatMessage, ...]
    """The prompt as text (one user turn) or as chat messages, put in the chat template as
    they are."""
    answer: str
    data_source: str | None = None
    """The row's ``data_source`` (the data set it comes from), if it has one."""
    extra_info: dict | None = None
    """The row's ``extra_info`` object (plain values), if it has one."""


@dataclass
class PromptSet:
    """The rows read from one file, and what was skipped."""

    path: Path
    rows: list[PromptRow]
    skipped: list[str] = field(default_factory=list)
    """One message per skipped row (``skip_bad_rows``), naming where and why."""


def _value(record: dict, path: str) -> Any:
    """The value at ``path``; None for a missing top-level field (as a parquet null), an error
    naming the missing part for a dotted path that leads nowhere."""
    value = field_value(record, path)
    if value is MISSING:
        if "." in path:
            raise ValueError(missing_message(record, path))
        return None
    return value


def _row(record: Any, where: str, index: int, prompt_key: str, answer_key: str) -> PromptRow:
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: expected an object with {prompt_key!r} and {answer_key!r}, "
            f"got {type(record).__name__}"
        )
    try:
        key = prompt_key
        # `problem` is read only when there is no `prompt` (a parquet column of nulls counts
        # as none)
        if key == DEFAULT_PROMPT_KEY and record.get(key) is None and _AIME_PROMPT_KEY in record:
            key = _AIME_PROMPT_KEY
        prompt = prompt_value(_value(record, key), key)
        answer = answer_value(_value(record, answer_key), answer_key)
        row_id = record.get("id")
        if row_id is None:  # a parquet file with ids on some rows only stores null on the others
            row_id = index
        if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
            raise ValueError(f"field 'id' must be a string or an integer, got {row_id!r}")
        data_source = data_source_value(record.get("data_source"))
        extra_info = extra_info_value(record.get("extra_info"))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return PromptRow(
        id=str(row_id),
        prompt=prompt,
        answer=answer,
        data_source=data_source,
        extra_info=extra_info,
    )


def _records(path: Path) -> list[tuple[str, Any]]:
    if path.suffix == ".jsonl":
        records = []
        # read as bytes and decode line by line: a byte that is not UTF-8 makes that line bad,
        # not the whole file
        with path.open("rb") as lines:
            for number, raw in enumerate(lines, start=1):
                where = f"{path}:{number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    records.append(
                        (
                            where,
                            ValueError(
                                f"{where}: not valid UTF-8 "
                                f"(byte {raw[err.start]:#04x} at column {err.start + 1})"
                            ),
                        )
                    )
                    continue
                if not line.strip():
                    continue
                try:
                    records.append((where, json.loads(line)))
                except json.JSONDecodeError as err:
                    records.append((where, ValueError(f"{where}: not valid JSON ({err.msg})")))
        return records
    if path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except Exception as err:  # noqa: BLE001 - any reader failure is a bad file
            raise ValueError(f"{path}: cannot be read as parquet ({err})") from None
        return [(f"{path} 0-based row {i}", record) for i, record in enumerate(table.to_pylist())]
    raise ValueError(
        f"{path}: unsupported prompt file type {path.suffix!r}; expected .jsonl or .parquet"
    )


def load_prompts(
    path: str | Path,
    *,
    prompt_key: str = DEFAULT_PROMPT_KEY,
    answer_key: str = DEFAULT_ANSWER_KEY,
    skip_bad_rows: bool = False,
    check_row: Callable[[PromptRow], None] | None = None,
) -> PromptSet:
    """Read a prompt set, its prompts from the field ``prompt_key`` and its answers from
    ``answer_key`` (dotted paths into nested objects; see the module docstring). Raises
    ``ValueError`` for a missing or unreadable file, an empty set, and (unless
    ``skip_bad_rows``) the first malformed row. ``check_row`` adds a condition of the caller's
    (a prompt that fits the model): its ``ValueError`` makes the row malformed, with the row's
    place in the file put before its message."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    result = PromptSet(path=path, rows=[])
    for index, (where, record) in enumerate(_records(path)):
        try:
            if isinstance(record, ValueError):
                raise record
            row = _row(record, where, index, prompt_key, answer_key)
            if check_row is not None:
                try:
                    check_row(row)
                except ValueError as err:
                    raise ValueError(f"{where}: {err}") from None
            result.rows.append(row)
        except ValueError as err:
            if not skip_bad_rows:
                raise
            result.skipped.append(str(err))
    if not result.rows:
        raise ValueError(f"{path}: no usable rows ({len(result.skipped)} skipped)")
    return result


def chat_messages(row: PromptRow, *, system: str | None = None) -> list[dict[str, str]]:
    """The chat template's messages of ``row``: its prompt text as a user turn, or its own
    messages as they are; ``system`` (when given) as a system turn before them, unless the row
    brings a system message of its own."""
    if isinstance(row.prompt, str):
        turns = [{"role": "user", "content": row.prompt}]
    else:
        turns = [{"role": m.role, "content": m.content} for m in row.prompt]
    if system and not any(turn["role"] == "system" for turn in turns):
        turns.insert(0, {"role": "system", "content": system})
    return turns


def prompt_token_ids(tokenizer, row: PromptRow, *, system: str | None = None) -> list[int]:
    """The token ids of ``row``'s prompt in the tokenizer's chat template
    (:func:`chat_messages`), with the assistant turn opened (generation starts right after)."""
    try:
        ids = tokenizer.apply_chat_template(
            chat_messages(row, system=system), tokenize=True, add_generation_prompt=True
        )
    except Exception as err:  # noqa: BLE001 - tokenizers raise bare Exceptions for text they cannot encode
        raise ValueError(
            f"the tokenizer cannot encode the prompt ({type(err).__name__}: {err})"
        ) from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
