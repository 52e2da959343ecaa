"""Experiment trackers beside TensorBoard, with the real packages and no mocks: W&B in offline
mode, read back with wandb's own reader of its transaction log, and MLflow on a local file
store, read back with MlflowClient. Each gets the records metrics.jsonl gets (same names, same
steps, negative warm-up steps and NaN included), the config as hyperparameters, and a resumed
session reopens the same run. A tracker that fails or hangs is reported once and the records
still reach TensorBoard and metrics.jsonl."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import socket
import sys
import time

import pytest

from bapo_megatron.config import LoggingConfig, load_config
from bapo_megatron.config.trackers import MlflowConfig, WandbConfig, check_tracker_packages
from bapo_megatron.trainer.sinks.background import start_trackers
from bapo_megatron.trainer.sinks.mlflow_run import CHANGED_TAG, flattened
from bapo_megatron.trainer.tracking import MetricsLogger, read_scalars
from tests.helpers.tracker_runs import mlflow_history, mlflow_runs, wandb_sessions

RECORDS = [
    (-2, {"warmup/cross_entropy": 2.5}),
    (-1, {"warmup/cross_entropy": 1.25}),
    (1, {"loss": 0.5, "bapo/rho_after": math.nan, "reward/mean": 0.25}),
    (2, {"loss": -0.125, "bapo/rho_after": 0.75, "reward/mean": 0.5}),
]
HYPERPARAMETERS = {"loss": {"clip": {"c_high_max": 2.5}, "preset": "paper"}, "train": {"steps": 4}}


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def log_session(tmp_path, logging_cfg, records, resume_ids=None, hyperparameters=None):
    """One session of a run: trackers started as the trainer starts them, records logged, the
    trackers' run ids taken (as a checkpoint takes them), closed."""
    trackers = start_trackers(
        logging_cfg, hyperparameters or HYPERPARAMETERS, tmp_path, resume_ids or {}
    )
    with MetricsLogger(tmp_path / "tensorboard", console=False, trackers=trackers) as logger:
        for step, values in records:
            logger.log(step, values)
        runs = logger.tracker_runs()
    return runs


def jsonl(tmp_path) -> list[dict]:
    lines = (tmp_path / "tensorboard" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def assert_same_records(ours: list[dict], reference: list[dict]) -> None:
    assert [r.keys() for r in ours] == [r.keys() for r in reference]
    for a, b in zip(ours, reference):
        assert all(same(a[k], b[k]) for k in b), (a, b)


@pytest.fixture
def file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")  # an optional extra
    # MLflow 3 keeps its folder store for existing users only unless this is set
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


def test_wandb_offline_run_holds_every_record_and_resumes_the_same_run(tmp_path):
    pytest.importorskip("wandb")  # an optional extra
    cfg = LoggingConfig(wandb=WandbConfig(mode="offline", project="p", tags=("a",)))
    runs = log_session(tmp_path, cfg, RECORDS[:3])
    assert set(runs) == {"wandb"}
    # W&B names a session's folder offline-run-<start second>-<run id>: a resume in the same
    # second would reuse the first session's folder (a trainer cannot resume that fast)
    (started,) = (tmp_path / "wandb").glob("offline-run-*")
    while time.strftime("%Y%m%d_%H%M%S") <= started.name.split("-")[2]:
        time.sleep(0.05)
    resumed = log_session(tmp_path, cfg, RECORDS[3:], resume_ids=runs)
    assert resumed == runs

    first, second = wandb_sessions(tmp_path)
    assert first.run_id == second.run_id == runs["wandb"]
    assert first.exit_code == second.exit_code == 0
    # the same names and steps as metrics.jsonl (W&B's x axis is the metric "step")
    assert_same_records(first.history + second.history, jsonl(tmp_path))
    assert first.config["loss"] == {"clip": {"c_high_max": 2.5}, "preset": "paper"}
    assert first.config["train"] == {"steps": 4}


def test_mlflow_run_holds_every_record_params_and_resumes_the_same_run(tmp_path, file_store):
    cfg = LoggingConfig(
        mlflow=MlflowConfig(enabled=True, tracking_uri=file_store, experiment="e", tags={"k": "v"})
    )
    runs = log_session(tmp_path, cfg, RECORDS[:3])
    changed = {**HYPERPARAMETERS, "train": {"steps": 8}, "data": {"shuffle": False}}
    resumed = log_session(tmp_path, cfg, RECORDS[3:], resume_ids=runs, hyperparameters=changed)
    assert resumed == runs

    (run,) = mlflow_runs(file_store, "e")  # one run, not one per session
    assert run.info.run_id == runs["mlflow"]
    assert run.info.status == "FINISHED"
    assert run.data.tags["k"] == "v"
    # parameters: the first session's config, plus what the resumed one added; a changed value
    # cannot be logged again (MLflow keeps the first) and is named in a tag
    assert run.data.params == {
        "loss.clip.c_high_max": "2.5",
        "loss.preset": "paper",
        "train.steps": "4",
        "data.shuffle": "false",
    }
    assert run.data.tags[CHANGED_TAG] == "train.steps"

    reference = jsonl(tmp_path)
    keys = {k for r in reference for k in r if k != "step"}
    history = mlflow_history(file_store, run.info.run_id, keys)
    for key in keys:
        expected = [(r["step"], r[key]) for r in reference if key in r]
        got = sorted(history[key])
        assert len(got) == len(expected) and all(
            a[0] == b[0] and same(a[1], b[1]) for a, b in zip(got, expected)
        ), key


def test_a_failing_tracker_is_reported_once_and_the_records_still_reach_the_files(
    tmp_path, file_store, caplog
):
    # a store MLflow cannot create: its folder would have to be made inside a regular file
    (tmp_path / "a_file").write_text("")
    broken = (tmp_path / "a_file" / "mlruns").as_uri()
    cfg = LoggingConfig(mlflow=MlflowConfig(enabled=True, tracking_uri=broken))
    with caplog.at_level(logging.WARNING):
        runs = log_session(tmp_path, cfg, RECORDS)
    reports = [r.getMessage() for r in caplog.records if "experiment tracker" in r.getMessage()]
    assert len(reports) == 1, reports
    assert "experiment tracker MLflow could not start" in reports[0]
    assert runs == {}
    assert_same_records(jsonl(tmp_path), [{"step": s, **v} for s, v in RECORDS])
    assert read_scalars(tmp_path / "tensorboard")["loss"] == [(1, 0.5), (2, -0.125)]


def test_a_tracker_that_never_answers_is_given_up_after_the_timeout(tmp_path, caplog):
    pytest.importorskip("mlflow")
    # a server that takes connections and never answers: every MLflow request waits
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    try:
        host, port = server.getsockname()
        cfg = LoggingConfig(
            mlflow=MlflowConfig(enabled=True, tracking_uri=f"http://{host}:{port}"),
            tracker_timeout_s=0.5,
        )
        trackers = start_trackers(cfg, HYPERPARAMETERS, tmp_path, {})
        with caplog.at_level(logging.WARNING):
            with MetricsLogger(tmp_path / "tensorboard", console=False, trackers=trackers) as log:
                runs_asked = []
                for step, values in RECORDS:
                    log.log(step, values)
                    if step > 0:  # two checkpoints: the second does not wait again
                        runs_asked.append(log.tracker_runs())
            assert trackers[0].failed
    finally:
        server.close()
    reports = [r.getMessage() for r in caplog.records if "experiment tracker" in r.getMessage()]
    assert len(reports) == 1, reports
    assert "MLflow did not start within 0.5 s" in reports[0]
    assert len(runs_asked) == 2 and runs_asked[1] == {}
    assert len(jsonl(tmp_path)) == len(RECORDS)


def test_hyperparameters_are_the_resolved_config_flattened():
    cfg = load_config(None, ["logging.mlflow.tags={team: rl}", "loss.truncated_is_cap=2.0"])
    params = dict(flattened(dataclasses.asdict(cfg)))
    assert params["loss.truncated_is_cap"] == "2.0"
    assert params["logging.mlflow.tags.team"] == "rl"
    assert params["model"] == "null"
    assert params["logging.wandb.tags"] == "[]"
    assert params["reward.name"] == "math"


def test_tracker_config_is_checked():
    overrides = ["logging.wandb.mode=offline", "logging.wandb.tags=[x, y]"]
    cfg = load_config(None, [*overrides, "logging.mlflow.tags={a: b}"])
    assert cfg.logging.wandb.enabled and cfg.logging.wandb.tags == ("x", "y")
    assert cfg.logging.mlflow.tags == {"a": "b"}
    assert not load_config(None).logging.wandb.enabled
    assert not load_config(None).logging.mlflow.enabled
    with pytest.raises(ValueError, match="logging.wandb.mode: expected one of"):
        load_config(None, ["logging.wandb.mode=cloud"])
    with pytest.raises(ValueError, match="logging.mlflow.tags: expected a mapping"):
        load_config(None, ["logging.mlflow.tags=[a]"])
    with pytest.raises(ValueError, match=r"logging.mlflow.tags.a: expected a string"):
        load_config(None, ["logging.mlflow.tags={a: 1}"])
    with pytest.raises(ValueError, match="logging.tracker_timeout_s must be a number > 0"):
        load_config(None, ["logging.tracker_timeout_s=0"])


@pytest.mark.parametrize(
    "module, setting", [("wandb", "wandb.mode=online"), ("mlflow", "mlflow.enabled=true")]
)
def test_a_missing_tracker_package_names_its_extra(monkeypatch, module, setting):
    monkeypatch.setitem(sys.modules, module, None)  # what an uninstalled package looks like
    cfg = load_config(None, [f"logging.{setting}"])
    with pytest.raises(ValueError, match=rf"needs the {module} package.*bapo-megatron\[{module}\]"):
        check_tracker_packages(cfg.logging.wandb, cfg.logging.mlflow)
    check_tracker_packages(WandbConfig(), MlflowConfig())  # nothing enabled: nothing needed
