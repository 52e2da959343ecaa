"""Run tracking: phase timers, a metrics logger (TensorBoard + JSON lines + console) and a reader.

Only one rank writes (the last pipeline stage's data-parallel rank 0); every other rank builds
its logger with `enabled=False` and the same calls become no-ops, so the loop has no rank
branches. Metric names are namespaced tags (`bapo/rho_after`, `reward/mean`, `time/rollout`).

    timer = PhaseTimer()
    with MetricsLogger(run_dir / "tb", enabled=is_writer, purge_step=resume_step) as logger:
        for step in range(resume_step, total_steps):
            timer.reset()
            with timer.phase("rollout"):
                ...
            logger.log(step, {**train_metrics, **timer.metrics()})

Files in `log_dir`: TensorBoard event files (one per writer session) and `metrics.jsonl`, one
JSON object `{"step": s, **metrics}` a line, for scripts. Non-finite values are kept as
Python's json writes them (`NaN`, `Infinity`): `json.loads` reads them, strict JSON parsers
do not.

Resuming after a crash: `purge_step=s` drops what the crashed run wrote at steps >= s. For
TensorBoard this is a marker (a SessionLog START event at step s, written by SummaryWriter)
that the reader honours when it meets it: the crashed run's event file keeps its bytes, and
readers that iterate raw events rather than use TensorBoard's EventAccumulator (as
`read_scalars` does) still see them. `metrics.jsonl` is rewritten without those lines.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Self

import numpy as np
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter

from bapo_megatron.files.atomic import write_text_atomically

JSONL_NAME = "metrics.jsonl"
_EVENTS_PREFIX = "events.out.tfevents."

# Keys shown by `console_line`, in order. Consecutive keys with the same label share one field
# ("c 0.62/1.35"); "time/step" shows the step's seconds followed by the other time/* phases.
DEFAULT_CONSOLE_KEYS: tuple[str, ...] = (
    "reward/mean",
    "bapo/rho_after",
    "bapo/c_low",
    "bapo/c_high",
    "reward/accuracy",
    "entropy",
    "grad_norm",
    "response_length/mean",
    "time/step",
)
# Short console labels; a key without one is shown under its full name.
CONSOLE_LABELS: dict[str, str] = {
    "reward/mean": "reward",
    "bapo/rho_after": "rho",
    "bapo/c_low": "c",
    "bapo/c_high": "c",
    "reward/accuracy": "acc",
    "entropy": "entropy",
    "grad_norm": "grad",
    "response_length/mean": "len",
}


class PhaseTimer:
    """Wall seconds per named phase of a step.

    `with timer.phase("rollout"): ...` adds the block's duration to "rollout" (also when the
    block raises). `metrics()` gives {"time/<phase>": seconds, ..., "time/step": total} for
    the phases seen since the last `reset()`, in first-seen order. Phases may nest (e.g.
    "weight_sync" inside "train"); "time/step" sums only the outermost ones, so it is the wall
    time spent inside phases, counted once. `clock` is injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._seconds: dict[str, float] = {}
        self._total = 0.0
        self._open: list[str] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name == "step":
            raise ValueError("PhaseTimer.phase: 'step' is reserved for the total (time/step)")
        if name in self._open:
            raise ValueError(f"PhaseTimer.phase: phase {name!r} is already running")
        self._open.append(name)
        self._seconds.setdefault(name, 0.0)  # first-seen order is start order
        start = self._clock()
        try:
            yield
        finally:
            elapsed = self._clock() - start
            self._open.pop()
            self._seconds[name] += elapsed
            if not self._open:
                self._total += elapsed

    def metrics(self) -> dict[str, float]:
        """Completed phases since the last reset (a phase still running is not counted yet)."""
        if not self._seconds:
            return {}
        out = {f"time/{name}": seconds for name, seconds in self._seconds.items()}
        out["time/step"] = self._total
        return out

    def reset(self) -> None:
        self._seconds.clear()
        self._total = 0.0


def _as_float(key: str, value: object) -> float:
    """A metric value as a Python float; ValueError naming the key for anything not a number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()  # one-element tensors, e.g. the loss's metrics
    elif isinstance(value, np.ndarray) and value.size == 1:
        value = value.item()
    if isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        return float(value)
    raise ValueError(
        f"metric {key!r}: expected a real number, got {type(value).__name__} {value!r:.80}"
    )


def _validated(metrics: Mapping[str, object]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"metric key {key!r}: expected a non-empty string")
        if key == "step":
            raise ValueError("metric 'step': reserved for the step number in metrics.jsonl")
        out[key] = _as_float(key, value)
    return out


def _format_value(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if magnitude == 0 or 0.01 <= magnitude < 10:
        return f"{value:.2f}"
    if 10 <= magnitude < 1e5:
        return f"{value:.1f}"
    return f"{value:.2e}"


class MetricsLogger:
    """Scalars to TensorBoard event files and `metrics.jsonl` in `log_dir`, plus a console line.

    enabled: False on every rank but the writer; then every method does nothing (no files, no
        output; `console_line` still formats, it has no side effects).
    log_dir: None for console output only.
    console: print `console_line` on each `log`.
    purge_step: on resume, drop what an earlier (crashed) run wrote at steps >= purge_step, from
        TensorBoard (SummaryWriter's purge marker) and from `metrics.jsonl` (rewritten).
    console_keys: metric keys shown by `console_line`.
    """

    def __init__(
        self,
        log_dir: str | Path | None,
        *,
        enabled: bool = True,
        console: bool = True,
        purge_step: int | None = None,
        console_keys: Sequence[str] = DEFAULT_CONSOLE_KEYS,
    ):
        self.enabled = enabled
        self.console = console
        self.console_keys = tuple(console_keys)
        self.log_dir = None if log_dir is None else Path(log_dir)
        self._writer: SummaryWriter | None = None
        self._jsonl = None
        self._closed = False
        if not enabled or self.log_dir is None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        jsonl_path = self.log_dir / JSONL_NAME
        if purge_step is not None:
            _purge_jsonl(jsonl_path, purge_step)
        _wait_to_sort_last(self.log_dir)
        self._writer = SummaryWriter(str(self.log_dir), purge_step=purge_step)
        self._jsonl = jsonl_path.open("a", encoding="utf-8")
        if self._jsonl.tell() > 0 and not _ends_with_newline(jsonl_path):
            self._jsonl.write("\n")  # a killed run's partial last line stays on its own line

    def log(
        self,
        step: int,
        metrics: Mapping[str, float],
        *,
        total_steps: int | None = None,
        console: bool = True,
    ) -> None:
        """Record `metrics` at `step` and flush, so a killed run loses at most the step being
        logged. Values: real numbers (numpy scalars and one-element tensors too; NaN and inf
        kept); anything else is refused with a ValueError naming its key, before anything is
        written. `total_steps` only shapes the console line ("step 12/200"); `console=False`
        keeps this record off the console (per-optimizer-step records of a rollout step)."""
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log: the logger is closed")
        values = _validated(metrics)
        step = int(step)
        if self._writer is not None:
            # one event holding every scalar of the record: what add_scalar writes per key
            # (a simple_value), at a tenth of its cost per record (a slow trainer step is the
            # bottleneck of asynchronous training)
            summary = Summary(
                value=[Summary.Value(tag=key, simple_value=value) for key, value in values.items()]
            )
            self._writer._get_file_writer().add_summary(summary, step, walltime=time.time())
            self._writer.flush()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self._jsonl.flush()
        if self.console and console:
            print(self.console_line(step, values, total_steps), flush=True)

    def console_line(
        self, step: int, metrics: Mapping[str, float], total_steps: int | None = None
    ) -> str:
        """One line of progress, e.g. "step 12/200 | reward 0.41 | rho 0.38 | c 0.62/1.35 |
        ... | 3.1 s (rollout 1.2, train 1.5)"; keys absent from `metrics` are skipped."""
        fields = [f"step {step}" if total_steps is None else f"step {step}/{total_steps}"]
        last_label = None
        for key in self.console_keys:
            if key not in metrics:
                continue
            value = float(metrics[key])
            if key == "time/step":
                phases = [
                    f"{k[len('time/') :]} {float(v):.1f}"
                    for k, v in metrics.items()
                    if k.startswith("time/") and k != "time/step"
                ]
                fields.append(f"{value:.1f} s" + (f" ({', '.join(phases)})" if phases else ""))
                last_label = None
                continue
            label = CONSOLE_LABELS.get(key, key)
            if label == last_label:  # c_low/c_high share one field
                fields[-1] += f"/{_format_value(value)}"
            else:
                fields.append(f"{label} {_format_value(value)}")
            last_label = label
        return " | ".join(fields)

    def close(self) -> None:
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


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


def _wait_to_sort_last(log_dir: Path) -> None:
    """TensorBoard reads a directory's event files in name order, and a purge marker only
    removes what was read before it. Names are "events.out.tfevents.<unix seconds>.<host>.
    <pid>.<counter>": within one second the counter (…9 sorts after …10) or the pid can put
    a new file before an older one. Wait, if needed, until the clock has passed the newest
    file's second, so the new file sorts last. Only a restart within a second (tests) waits."""
    newest = -1
    for path in log_dir.glob(_EVENTS_PREFIX + "*"):
        stamp = path.name[len(_EVENTS_PREFIX) :].split(".", 1)[0]
        if stamp.isdigit():
            newest = max(newest, int(stamp))
    while int(time.time()) <= newest:
        time.sleep(0.05)


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars in `log_dir`'s event files, read with TensorBoard's EventAccumulator (all of
    them kept, purge markers honoured): tag -> [(step, value)] sorted by step. Values are
    float32, as TensorBoard stores them. A step recorded twice (a resume without purge_step)
    keeps the value written last."""
    log_dir = Path(log_dir)
    if not log_dir.is_dir():
        raise FileNotFoundError(f"read_scalars: no directory {log_dir}")
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    out = {}
    for tag in accumulator.Tags()["scalars"]:
        by_step = {}
        for event in accumulator.Scalars(tag):  # in reading order: later writes win
            by_step[event.step] = event.value
        out[tag] = sorted(by_step.items())
    return out
