"""Experiment trackers (W&B, MLflow) run in a thread of their own, so that a slow, unreachable or
refusing tracker server never stops or stalls training.

Every wait on a tracker is bounded by ``logging.tracker_timeout_s``: its start (waited for only
when a checkpoint asks for its run id), each record (handed over through a bounded queue, never
waited for), and its end. The first failure of a tracker (an exception from its library, a start
or end past the timeout, a queue that stays full) is reported once, as a warning naming the
tracker; from then on its records are dropped and the run goes on, with TensorBoard and
``metrics.jsonl`` holding every record.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bapo_megatron.config.run import LoggingConfig
from bapo_megatron.trainer.sinks import TrackerRun
from bapo_megatron.trainer.sinks.mlflow_run import MlflowRun
from bapo_megatron.trainer.sinks.wandb_run import WandbRun

log = logging.getLogger(__name__)

MAX_PENDING_RECORDS = 10_000
"""Records a tracker may fall behind by before it is given up (a tracker that stopped taking
records must not hold the run's memory)."""
_END = object()


class BackgroundTracker:
    """``tracker`` opened, fed and finished in a daemon thread; the sink the metrics logger sees.

    resume_id: the tracker run an earlier session of this training run opened (from the
        checkpoint the run resumes from); None: a new tracker run.
    timeout_s: the longest any call here waits for the tracker.
    """

    def __init__(
        self,
        tracker: TrackerRun,
        hyperparameters: Mapping[str, Any],
        *,
        resume_id: str | None,
        timeout_s: float,
        max_pending: int = MAX_PENDING_RECORDS,
    ):
        self.name = tracker.name
        self.key = tracker.key
        self._tracker = tracker
        self._timeout_s = timeout_s
        self._resume_id = resume_id
        self._run_id: str | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._opened = threading.Event()
        self._report_lock = threading.Lock()
        self._failed = False
        self._thread = threading.Thread(
            target=self._serve, args=(dict(hyperparameters),), name=f"tracker {self.name}"
        )
        self._thread.daemon = True  # a tracker stuck in a call must not keep the process alive
        self._thread.start()

    @property
    def failed(self) -> bool:
        """Whether the tracker failed (and was reported); its records are dropped since."""
        return self._failed

    def run_id(self) -> str | None:
        """The tracker run's id, to store in a checkpoint: waits (up to the timeout) for the
        tracker to start; a tracker that could not start keeps the id it was to resume."""
        # a tracker given up is not waited for again (one stuck start costs one timeout)
        if not self._failed and not self._opened.wait(self._timeout_s):
            self._report(f"did not start within {self._timeout_s:g} s")
        return self._run_id or self._resume_id

    def write(self, step: int, values: Mapping[str, float]) -> None:
        """Hand the record to the tracker's thread (never waits)."""
        if self._failed:
            return
        try:
            self._queue.put_nowait((step, dict(values)))
        except queue.Full:
            self._report(f"fell {self._queue.maxsize} records behind")

    def close(self, *, failed: bool = False) -> None:
        """End the tracker run (marked failed with ``failed``), waiting for its records to be
        sent for at most the timeout."""
        deadline = time.monotonic() + self._timeout_s
        try:
            self._queue.put((_END, failed), timeout=self._timeout_s)
        except queue.Full:
            self._report(f"took no record for {self._timeout_s:g} s")
            return
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._report(
                f"did not finish within {self._timeout_s:g} s (logging.tracker_timeout_s); "
                "its last records may be missing"
            )

    def _serve(self, hyperparameters: dict[str, Any]) -> None:
        try:
            self._run_id = self._tracker.open(hyperparameters, self._resume_id)
        except Exception as error:  # noqa: BLE001 - any tracker failure is reported, not raised
            self._report(f"could not start ({_describe(error)})")
        finally:
            self._opened.set()
        while True:
            item = self._queue.get()
            if item[0] is _END:
                break
            if self._failed:
                continue  # drain: the records of a failed tracker are dropped
            try:
                self._tracker.write(*item)
            except Exception as error:  # noqa: BLE001
                self._report(f"failed to record step {item[0]} ({_describe(error)})")
        if not self._failed:
            try:
                self._tracker.finish(item[1])
            except Exception as error:  # noqa: BLE001
                self._report(f"failed to end its run ({_describe(error)})")

    def _report(self, what: str) -> None:
        """Warn once per tracker; later failures of it are silent."""
        with self._report_lock:
            if self._failed:
                return
            self._failed = True
        log.warning(
            "experiment tracker %s %s; the run goes on without it (TensorBoard and "
            "metrics.jsonl keep every record)",
            self.name,
            what,
        )


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first[:300]}" if first else type(error).__name__


def start_trackers(
    cfg: LoggingConfig,
    hyperparameters: Mapping[str, Any],
    output_dir: Path,
    resume_ids: Mapping[str, str],
) -> list[BackgroundTracker]:
    """The trackers ``cfg`` enables, each started in its thread with the run's resolved config
    as its hyperparameters, reopening the tracker run of ``resume_ids`` (tracker key -> run id,
    from the checkpoint) where there is one. Call on the writing rank only."""
    trackers: list[TrackerRun] = []
    if cfg.wandb.enabled:
        trackers.append(WandbRun(cfg.wandb, output_dir, timeout_s=cfg.tracker_timeout_s))
    if cfg.mlflow.enabled:
        trackers.append(MlflowRun(cfg.mlflow))
    return [
        BackgroundTracker(
            tracker,
            hyperparameters,
            resume_id=resume_ids.get(tracker.key),
            timeout_s=cfg.tracker_timeout_s,
        )
        for tracker in trackers
    ]
