"""Metric records as an MLflow run (``logging.mlflow``), written from the tracker's thread
(:class:`~bapo_megatron.trainer.sinks.background.BackgroundTracker`) through ``MlflowClient``,
which talks to the tracking store directly: no active-run state of the ``mlflow`` module is
touched, so the trainer's process keeps none.

The resolved config becomes the run's parameters, one per dotted key (``loss.clip.c_high_max``),
its values written as YAML/JSON scalars (``null``, ``true``, ``0.001``). MLflow never changes a
parameter once logged: a resumed run logs only the keys its run lacks and tags the run
``bapo.resumed_with_changes`` with the keys whose value changed (e.g. a raised ``train.steps``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

from bapo_megatron.config.trackers import MlflowConfig

CHANGED_TAG = "bapo.resumed_with_changes"


class MlflowRun:
    """One MLflow run of a training run. MLflow is imported when the run opens (an optional
    extra)."""

    name = "MLflow"
    key = "mlflow"

    def __init__(self, cfg: MlflowConfig):
        self._cfg = cfg
        self._client: Any = None
        self._run_id: str | None = None

    def open(self, hyperparameters: Mapping[str, Any], resume_id: str | None) -> str:
        try:
            from mlflow.entities import Param, RunStatus
            from mlflow.tracking import MlflowClient
            from mlflow.utils import validation
        except ImportError as error:
            raise ImportError(
                f"logging.mlflow needs the mlflow package: pip install 'bapo-megatron[mlflow]' "
                f"({error})"
            ) from None
        cfg = self._cfg
        client = MlflowClient(tracking_uri=cfg.tracking_uri)
        if resume_id is not None:
            run = client.get_run(resume_id)
            client.update_run(resume_id, status=RunStatus.to_string(RunStatus.RUNNING))
            logged = dict(run.data.params)
        else:
            experiment = client.get_experiment_by_name(cfg.experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else client.create_experiment(cfg.experiment)
            )
            run = client.create_run(experiment_id, run_name=cfg.run_name, tags=dict(cfg.tags))
            logged = {}
        self._client, self._run_id = client, run.info.run_id
        params = {
            key: value[: validation.MAX_PARAM_VAL_LENGTH]
            for key, value in flattened(hyperparameters)
        }
        new = [Param(key, value) for key, value in params.items() if key not in logged]
        for start in range(0, len(new), validation.MAX_PARAMS_TAGS_PER_BATCH):
            chunk = new[start : start + validation.MAX_PARAMS_TAGS_PER_BATCH]
            client.log_batch(self._run_id, params=chunk)
        changed = sorted(key for key in params if key in logged and logged[key] != params[key])
        if changed:
            text = ", ".join(changed)[: validation.MAX_TAG_VAL_LENGTH]
            client.set_tag(self._run_id, CHANGED_TAG, text)
        return self._run_id

    def write(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        milliseconds = int(time.time() * 1000)
        metrics = [Metric(key, value, milliseconds, step) for key, value in values.items()]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self._client.log_batch(
                self._run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH]
            )

    def finish(self, failed: bool) -> None:
        self._client.set_terminated(self._run_id, "FAILED" if failed else "FINISHED")


def flattened(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(dotted key, value as a YAML/JSON scalar)`` of every leaf of a nested mapping (the
    config as ``dataclasses.asdict`` gives it); an empty mapping is a leaf (``{}``)."""
    for key, value in tree.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            yield from flattened(value, dotted)
        elif isinstance(value, str):
            yield dotted, value
        else:
            yield dotted, json.dumps(value)
