"""Metric records as a Weights & Biases run (``logging.wandb``), written from the tracker's
thread (:class:`~bapo_megatron.trainer.sinks.background.BackgroundTracker`).

The run's x axis is the trainer's logging step, logged as the metric ``step`` (the key
``metrics.jsonl`` uses) and declared the step metric of every other one: W&B's own ``_step``
must start at 0 and only grow, while the trainer's step starts negative (the warm-up) and a
resumed run logs again from its checkpoint's step. A resume reopens the run with the id the
checkpoint holds (``resume="allow"``); in offline mode each session writes a folder
``<output_dir>/wandb/offline-run-<time>-<id>`` and ``wandb sync`` joins them into that run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bapo_megatron.config.trackers import WandbConfig

STEP_METRIC = "step"


class WandbRun:
    """One W&B run of a training run. W&B is imported when the run opens (an optional extra)."""

    name = "W&B"
    key = "wandb"

    def __init__(self, cfg: WandbConfig, output_dir: Path, *, timeout_s: float):
        self._cfg = cfg
        self._output_dir = Path(output_dir)
        self._timeout_s = timeout_s
        self._run: Any = None

    def open(self, hyperparameters: Mapping[str, Any], resume_id: str | None) -> str:
        try:
            import wandb
        except ImportError as error:
            raise ImportError(
                f"logging.wandb needs the wandb package: pip install 'bapo-megatron[wandb]' "
                f"({error})"
            ) from None
        cfg = self._cfg
        self._output_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name,
            group=cfg.group,
            tags=list(cfg.tags) or None,
            mode=cfg.mode,
            dir=str(self._output_dir),
            id=resume_id,
            resume="allow" if resume_id else None,
            config=dict(hyperparameters),
            # several trainer runs in one process (tests, sweeps) each get a run of their own
            reinit="create_new",
            settings=wandb.Settings(
                init_timeout=self._timeout_s,
                # W&B would wrap this process's stdout from the tracker's thread: the console
                # lines stay the trainer's (they are in metrics.jsonl anyway)
                console="off",
            ),
        )
        self._run.define_metric(STEP_METRIC)
        self._run.define_metric("*", step_metric=STEP_METRIC)
        return self._run.id

    def write(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log({STEP_METRIC: step, **values})

    def finish(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)
