"""Metric records as TensorBoard event files, and a reader of them (:func:`read_scalars`).

Resuming after a crash: ``purge_step=s`` drops what the crashed run wrote at steps >= s. This is
a marker (a SessionLog START event at step s, written by SummaryWriter) that the reader honours
when it meets it: the crashed run's event file keeps its bytes, and readers that iterate raw
events rather than use TensorBoard's EventAccumulator (as :func:`read_scalars` does) still see
them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter

_EVENTS_PREFIX = "events.out.tfevents."


class TensorBoardSink:
    """One event file per writer session in ``log_dir`` (created if needed)."""

    name = "TensorBoard"

    def __init__(self, log_dir: Path, *, purge_step: int | None = None):
        log_dir.mkdir(parents=True, exist_ok=True)
        _wait_to_sort_last(log_dir)
        self._writer: SummaryWriter | None = SummaryWriter(str(log_dir), purge_step=purge_step)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        # one event holding every scalar of the record: what add_scalar writes per key (a
        # simple_value), at a tenth of its cost per record (a slow trainer step is the
        # bottleneck of asynchronous training); flushed, so a killed run loses at most this one
        summary = Summary(
            value=[Summary.Value(tag=key, simple_value=value) for key, value in values.items()]
        )
        self._writer._get_file_writer().add_summary(summary, step, walltime=time.time())
        self._writer.flush()

    def close(self, *, failed: bool = False) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


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
