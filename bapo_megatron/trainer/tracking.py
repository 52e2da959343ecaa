"""Run tracking: phase timers and the metrics logger (one validated record a call, fed to every
sink of :mod:`bapo_megatron.trainer.sinks`: TensorBoard, ``metrics.jsonl``, the experiment
trackers) with its console line.

Only one rank writes (rank 0); every other rank builds its logger with `enabled=False` and the
same calls become no-ops, so the loop has no rank branches. Metric names are namespaced tags
(`bapo/rho_after`, `reward/mean`, `time/rollout`).

    timer = PhaseTimer()
    with MetricsLogger(run_dir / "tb", enabled=is_writer, purge_step=resume_step) as logger:
        for step in range(resume_step, total_steps):
            timer.reset()
            with timer.phase("rollout"):
                ...
            logger.log(step, {**train_metrics, **timer.metrics()})

Files in `log_dir`: TensorBoard event files (one per writer session) and `metrics.jsonl`
(:mod:`~bapo_megatron.trainer.sinks.jsonl`). Resuming after a crash: `purge_step=s` drops what
the crashed run wrote at steps >= s from both (:mod:`~bapo_megatron.trainer.sinks.tensorboard`).
The experiment trackers cannot forget points: a killed run's records past its last checkpoint
stay in its W&B or MLflow run, and the resumed run logs those steps again.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Self

import numpy as np
import torch

from bapo_megatron.trainer.sinks import MetricsSink
from bapo_megatron.trainer.sinks.background import BackgroundTracker
from bapo_megatron.trainer.sinks.jsonl import JSONL_NAME, JsonlSink
from bapo_megatron.trainer.sinks.tensorboard import TensorBoardSink, read_scalars

__all__ = ["JSONL_NAME", "MetricsLogger", "PhaseTimer", "read_scalars"]

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
    """Scalars to TensorBoard event files and `metrics.jsonl` in `log_dir`, to the experiment
    trackers given, and a console line.

    enabled: False on every rank but the writer; then every method does nothing (no files, no
        output; `console_line` still formats, it has no side effects).
    log_dir: None for no files (console and trackers only).
    console: print `console_line` on each `log`.
    purge_step: on resume, drop what an earlier (crashed) run wrote at steps >= purge_step, from
        TensorBoard (SummaryWriter's purge marker) and from `metrics.jsonl` (rewritten).
    console_keys: metric keys shown by `console_line`.
    trackers: experiment trackers (W&B, MLflow) fed the same records, closed with the logger.
    """

    def __init__(
        self,
        log_dir: str | Path | None,
        *,
        enabled: bool = True,
        console: bool = True,
        purge_step: int | None = None,
        console_keys: Sequence[str] = DEFAULT_CONSOLE_KEYS,
        trackers: Sequence[BackgroundTracker] = (),
    ):
        self.enabled = enabled
        self.console = console
        self.console_keys = tuple(console_keys)
        self.log_dir = None if log_dir is None else Path(log_dir)
        self._trackers = list(trackers) if enabled else []
        self._sinks: list[MetricsSink] = []
        self._closed = False
        if enabled and self.log_dir is not None:
            self._sinks.append(JsonlSink(self.log_dir, purge_step=purge_step))
            self._sinks.append(TensorBoardSink(self.log_dir, purge_step=purge_step))
        self._sinks.extend(self._trackers)

    def log(
        self,
        step: int,
        metrics: Mapping[str, float],
        *,
        total_steps: int | None = None,
        console: bool = True,
    ) -> None:
        """Record `metrics` at `step` in every sink (the files are flushed, so a killed run
        loses at most the step being logged). Values: real numbers (numpy scalars and
        one-element tensors too; NaN and inf kept); anything else is refused with a ValueError
        naming its key, before anything is written. `total_steps` only shapes the console line
        ("step 12/200"); `console=False` keeps this record off the console (per-optimizer-step
        records of a rollout step)."""
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log: the logger is closed")
        values = _validated(metrics)
        step = int(step)
        for sink in self._sinks:
            sink.write(step, values)
        if self.console and console:
            print(self.console_line(step, values, total_steps), flush=True)

    def tracker_runs(self) -> dict[str, str]:
        """The experiment trackers' run ids by tracker key (``{"wandb": ..., "mlflow": ...}``),
        for the checkpoint: a resumed run reopens them. Waits, bounded, for trackers still
        starting; one without an id is left out."""
        runs = {tracker.key: tracker.run_id() for tracker in self._trackers}
        return {key: run_id for key, run_id in runs.items() if run_id is not None}

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

    def close(self, *, failed: bool = False) -> None:
        """Close every sink; ``failed`` marks the trackers' runs as failed."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        for sink in self._sinks:
            sink.close(failed=failed)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self.close(failed=exc_type is not None)
