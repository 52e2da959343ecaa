"""A training run reporting to W&B (offline) and MLflow (local file store), killed with SIGKILL
after its second checkpoint and started again with the same command: the resumed run continues
the same W&B and MLflow runs (their ids come from the checkpoint), and each tracker holds the
records of metrics.jsonl under the same names and steps."""

from __future__ import annotations

import math

import pytest

from tests.helpers.tracker_runs import mlflow_history, mlflow_runs, wandb_sessions
from tests.helpers.train_runs import kill_after, read_metrics, run_in_process

pytest.importorskip("wandb")  # optional extras
pytest.importorskip("mlflow")


def test_a_run_killed_and_resumed_continues_its_tracker_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's folder store, opted in
    store = (tmp_path / "mlruns").as_uri()
    output = tmp_path / "run"
    overrides = [
        "train.steps=3",
        "checkpoint.interval=1",
        "algorithm.optimizer_steps_per_rollout=1",
        "logging.wandb.mode=offline",
        "logging.wandb.project=tiny",
        "logging.mlflow.enabled=true",
        f"logging.mlflow.tracking_uri={store}",
        "logging.mlflow.experiment=tiny",
    ]
    kill_after(output, overrides, checkpoint_step=2, extra_delay=0.0)
    records = run_in_process(output, *overrides)  # resumes from checkpoint 2
    assert [r["rollout_step"] for r in records if "reward/mean" in r] == [1, 2, 3]

    (run,) = mlflow_runs(store, "tiny")  # the killed session's run, continued
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "3"
    keys = ("reward/mean", "loss", "warmup/cross_entropy")
    history = mlflow_history(store, run.info.run_id, keys)
    for key in keys:
        # the last value MLflow holds at each step is metrics.jsonl's (a step the killed run
        # logged after its last checkpoint is logged again by the resumed run)
        last = dict(sorted(history[key], key=lambda point: point[0]))
        expected = {r["step"]: r[key] for r in records if key in r}
        assert last.keys() == expected.keys(), key
        assert all(math.isclose(last[s], expected[s], rel_tol=1e-12) for s in expected), key

    killed, resumed = wandb_sessions(output)
    # one W&B run: each session's folder is named offline-run-<time>-<run id> (the killed
    # session's transaction log may be empty: W&B buffers it, and SIGKILL loses the buffer)
    assert resumed.run_id and killed.folder.name.endswith(f"-{resumed.run_id}")
    assert resumed.exit_code == 0
    # the resumed session logs from the checkpoint's policy version on, as metrics.jsonl keeps
    assert resumed.history == [r for r in read_metrics(output) if r["step"] > 2]
    assert resumed.config["logging"]["mlflow"]["tracking_uri"] == store


def test_a_run_that_fails_marks_its_tracker_run_failed(tmp_path, monkeypatch):
    # the run fails while it starts (its initial weights cannot be read), after its MLflow run
    # began: that run is ended as FAILED, not left RUNNING
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = (tmp_path / "mlruns").as_uri()
    with pytest.raises(ValueError, match="missing"):
        run_in_process(
            tmp_path / "run",
            "warmup.steps=0",
            f"train.load_checkpoint={tmp_path / 'missing'}",
            "logging.mlflow.enabled=true",
            f"logging.mlflow.tracking_uri={store}",
            "logging.mlflow.experiment=tiny",
        )
    (run,) = mlflow_runs(store, "tiny")
    assert run.info.status == "FAILED"
