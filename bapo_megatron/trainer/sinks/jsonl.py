"""Metric records as ``metrics.jsonl``: one JSON object ``{"step": s, **metrics}`` a line, for
scripts. Non-finite values are kept as Python's json writes them (``NaN``, ``Infinity``):
``json.loads`` reads them, strict JSON parsers do not. On resume, ``purge_step=s`` rewrites the
file without the lines at steps >= s (written aside and renamed into place)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from bapo_megatron.files.atomic import write_text_atomically

JSONL_NAME = "metrics.jsonl"


class JsonlSink:
    """Appends to ``log_dir/metrics.jsonl`` (created if needed)."""

    name = JSONL_NAME

    def __init__(self, log_dir: Path, *, purge_step: int | None = None):
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / JSONL_NAME
        if purge_step is not None:
            _purge_jsonl(path, purge_step)
        self._file = path.open("a", encoding="utf-8")
        if self._file.tell() > 0 and not _ends_with_newline(path):
            self._file.write("\n")  # a killed run's partial last line stays on its own line

    def write(self, step: int, values: Mapping[str, float]) -> None:
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()  # a killed run loses at most the record being written

    def close(self, *, failed: bool = False) -> None:
        self._file.close()


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _purge_jsonl(path: Path, purge_step: int) -> None:
    """Keep the lines of `path` at steps < purge_step (and drop unreadable ones, such as a
    line cut short by a kill), atomically: write aside, then os.replace."""
    if not path.exists():
        return
    kept = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
                keep = int(record["step"]) < purge_step
            except (ValueError, KeyError, TypeError):
                continue
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
    write_text_atomically(path, "".join(kept))
