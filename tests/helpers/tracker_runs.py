"""Read experiment-tracker runs back with the trackers' own readers: a W&B offline run's
transaction log (``run-<id>.wandb``) with wandb's ``DataStore`` and its protobuf records, and an
MLflow run with ``MlflowClient``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class WandbSession:
    """One session (offline-run folder) of a W&B run, as its transaction log holds it."""

    folder: Path
    run_id: str = ""
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    exit_code: int | None = None


def wandb_sessions(output_dir: Path) -> list[WandbSession]:
    """Every offline session under ``output_dir/wandb``, oldest first (folder names start with
    the session's start time)."""
    import wandb

    # W&B's service process writes the logs and may still be closing one when a run's
    # finish() has returned; teardown ends the service, which finishes every log first
    wandb.teardown()
    folders = sorted((Path(output_dir) / "wandb").glob("offline-run-*"))
    return [read_wandb_session(folder) for folder in folders]


def read_wandb_session(folder: Path) -> WandbSession:
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    (log_file,) = folder.glob("run-*.wandb")
    session = WandbSession(folder)
    store = datastore.DataStore()
    store.open_for_scan(str(log_file))
    try:
        records = list(iter(store.scan_data, None))
    finally:
        store.close()
    for data in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            session.run_id = record.run.run_id
            session.config.update(_items(record.run.config.update))
        elif kind == "config":
            session.config.update(_items(record.config.update))
        elif kind == "history":
            row = _items(record.history.item)
            session.history.append({k: v for k, v in row.items() if not k.startswith("_")})
        elif kind == "exit":
            session.exit_code = record.exit.exit_code
    return session


def _items(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def mlflow_runs(tracking_uri: str, experiment: str) -> list:
    """The MLflow runs of ``experiment`` (MlflowClient's ``Run`` objects)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    return client.search_runs([found.experiment_id])


def mlflow_history(tracking_uri: str, run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    """key -> [(step, value)] in the order MLflow returns them."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    return {
        key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in keys
    }
