"""Where metric records go: one writer ("sink") per destination, all fed the same records by
:class:`~bapo_megatron.trainer.tracking.MetricsLogger`, which validates each record once.

A record is ``(step, {name: float})``: the logging step (the policy version; warm-up steps are
negative) and namespaced scalars (``bapo/rho_after``, ``reward/mean``). Every sink gets the same
names and steps:

- :mod:`.tensorboard`: TensorBoard event files;
- :mod:`.jsonl`: ``metrics.jsonl``, one JSON object a line;
- :mod:`.wandb_run`: a Weights & Biases run (``logging.wandb``);
- :mod:`.mlflow_run`: an MLflow run (``logging.mlflow``).

The two files on disk are written in the calling thread (they are fast and must hold every
record); the experiment trackers talk to servers that can be slow, down or refuse the
credentials, so each runs in a thread of its own behind :class:`.background.BackgroundTracker`,
which bounds every wait and reports a failure once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class MetricsSink(Protocol):
    """A destination of metric records."""

    name: str
    """What the sink writes to, for messages ("TensorBoard", "W&B")."""

    def write(self, step: int, values: Mapping[str, float]) -> None:
        """Record ``values`` (validated floats, NaN and inf kept) at ``step``."""
        ...

    def close(self, *, failed: bool = False) -> None:
        """Flush and release what the sink holds (``failed``: the training run ended with an
        error, for sinks that record how a run ended)."""
        ...


class TrackerRun(Protocol):
    """An experiment tracker's run (W&B, MLflow): opened with the run's hyperparameters, fed
    records, ended with a status. Its id is stored in the trainer's checkpoints, so that a
    resumed training run reopens the same tracker run. Run by
    :class:`.background.BackgroundTracker`, in a thread of its own: its methods may block or
    raise, and are never called concurrently."""

    name: str
    """The tracker, for messages ("W&B", "MLflow")."""
    key: str
    """The tracker's key in the checkpoint's record of run ids ("wandb", "mlflow")."""

    def open(self, hyperparameters: Mapping[str, Any], resume_id: str | None) -> str:
        """Start the run (or reopen ``resume_id``, the id an earlier session of the same
        training run returned) and return its id."""
        ...

    def write(self, step: int, values: Mapping[str, float]) -> None:
        """Record ``values`` at ``step`` (as :meth:`MetricsSink.write`)."""
        ...

    def finish(self, failed: bool) -> None:
        """End the run, marked failed when the training run ended with an error."""
        ...
