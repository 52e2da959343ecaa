"""Prompt sets: rows of (prompt, ground-truth answer, optional id) from JSONL or parquet files.

Each row must have a non-empty string ``prompt`` (or ``problem``, as benchmarks in the AIME
format name it) and an ``answer`` (string or number; numbers are kept as their text); ``id`` is
optional (missing or null: the row's 0-based position among the rows). A malformed row raises
``ValueError`` naming the file, where in it, and the field, or, with ``skip_bad_rows``, is
skipped and counted. Where in the file is ``path:N`` for JSONL, N the 1-based line number as
editors show it (blank lines counted), and ``path 0-based row N`` for parquet, N the index
pyarrow and pandas use.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq


@dataclass(frozen=True)
class PromptRow:
    """One problem of the prompt set."""

    id: str
    prompt: str
    answer: str


@dataclass
class PromptSet:
    """The rows read from one file, and what was skipped."""

    path: Path
    rows: list[PromptRow]
    skipped: list[str] = field(default_factory=list)
    """One message per skipped row (``skip_bad_rows``), naming where and why."""


def _row(record: Any, where: str, index: int) -> PromptRow:
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: expected an object with 'prompt' and 'answer', got {type(record).__name__}"
        )
    # `problem` is read only when there is no `prompt` (a parquet column of nulls counts as none).
    key = "problem" if record.get("prompt") is None and "problem" in record else "prompt"
    prompt = record.get(key)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: field {key!r} must be a non-empty string, got {prompt!r}")
    answer = record.get("answer")
    # a float NaN/inf is how pandas and parquet write a missing number: never an answer
    if (
        isinstance(answer, bool)
        or not isinstance(answer, (str, int, float))
        or str(answer).strip() == ""
        or (isinstance(answer, float) and not math.isfinite(answer))
    ):
        raise ValueError(
            f"{where}: field 'answer' must be a non-empty string or a finite number, got {answer!r}"
        )
    row_id = record.get("id")
    if row_id is None:  # a parquet file with ids on some rows only stores null on the others
        row_id = index
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
        raise ValueError(f"{where}: field 'id' must be a string or an integer, got {row_id!r}")
    return PromptRow(id=str(row_id), prompt=prompt, answer=str(answer))


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
    skip_bad_rows: bool = False,
    check_row: Callable[[PromptRow], None] | None = None,
) -> PromptSet:
    """Read a prompt set. Raises ``ValueError`` for a missing or unreadable file, an empty set,
    and (unless ``skip_bad_rows``) the first malformed row. ``check_row`` adds a condition of
    the caller's (a prompt that fits the model): its ``ValueError`` makes the row malformed, with
    the row's place in the file put before its message."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    result = PromptSet(path=path, rows=[])
    for index, (where, record) in enumerate(_records(path)):
        try:
            if isinstance(record, ValueError):
                raise record
            row = _row(record, where, index)
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


def prompt_token_ids(tokenizer, row: PromptRow, *, system: str | None = None) -> list[int]:
    """The token ids of ``row``'s prompt as a user turn in the tokenizer's chat template, with
    the assistant turn opened (generation starts right after)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": row.prompt}
    ]
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - tokenizers raise bare Exceptions for text they cannot encode
        raise ValueError(
            f"the tokenizer cannot encode the prompt ({type(err).__name__}: {err})"
        ) from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
