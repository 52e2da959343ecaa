"""The experiment trackers a run may report to beside TensorBoard: Weights & Biases
(``logging.wandb``) and MLflow (``logging.mlflow``). Both are off by default and need their
optional extra (``pip install 'bapo-megatron[wandb]'``, ``[mlflow]``); the writers are in
:mod:`bapo_megatron.trainer.sinks`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal

WandbMode = Literal["online", "offline", "disabled"]


@dataclass(kw_only=True)
class WandbConfig:
    """A Weights & Biases run fed with every metric record (rank 0). Its files go under
    ``<train.output_dir>/wandb``; the credentials are W&B's own (``wandb login`` or the
    ``WANDB_API_KEY`` environment variable), never part of the config."""

    mode: WandbMode = "disabled"
    """`online` (stream to the W&B server), `offline` (write the run's files only; ``wandb sync``
    uploads them later) or `disabled` (no W&B run)."""
    project: str = "bapo-megatron"
    """W&B project the run belongs to."""
    entity: str | None = None
    """W&B user or team owning the project; None: the account's default entity."""
    name: str | None = None
    """Display name of the run; None: one W&B makes up."""
    group: str | None = None
    """W&B group the run is shown in (e.g. the seeds of one setting); None: none."""
    tags: tuple[str, ...] = ()
    """Tags of the run."""

    def __post_init__(self) -> None:
        if self.mode not in ("online", "offline", "disabled"):
            raise ValueError(
                f"logging.wandb.mode must be 'online', 'offline' or 'disabled', got {self.mode!r}"
            )
        if not self.project.strip():
            raise ValueError("logging.wandb.project must name a W&B project, got an empty string")

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"


@dataclass(kw_only=True)
class MlflowConfig:
    """An MLflow run fed with every metric record (rank 0); the resolved config becomes its
    parameters."""

    enabled: bool = False
    """Report the run to MLflow."""
    tracking_uri: str | None = None
    """Where MLflow keeps runs: a server (``http://host:5000``), a database
    (``sqlite:///mlflow.db``) or a folder (``file:///path/mlruns``); None: MLflow's own default
    (the ``MLFLOW_TRACKING_URI`` environment variable, else its local default). Credentials
    come from MLflow's environment variables (``MLFLOW_TRACKING_TOKEN``...), never from here."""
    experiment: str = "bapo-megatron"
    """MLflow experiment the run belongs to (created when missing)."""
    run_name: str | None = None
    """Display name of the run; None: one MLflow makes up."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags of the run (name: value)."""

    def __post_init__(self) -> None:
        if not self.experiment.strip():
            raise ValueError("logging.mlflow.experiment must name an experiment, got ''")


def check_tracker_packages(wandb: WandbConfig, mlflow: MlflowConfig) -> None:
    """``ValueError`` naming the setting and the extra to install when an enabled tracker's
    package is missing (checked at startup, before anything is built)."""
    wanted = [
        (wandb.enabled, "wandb", f"logging.wandb.mode={wandb.mode}", "wandb"),
        (mlflow.enabled, "mlflow", "logging.mlflow.enabled=true", "mlflow"),
    ]
    for enabled, module, setting, extra in wanted:
        if enabled and importlib.util.find_spec(module) is None:
            raise ValueError(
                f"{setting} needs the {module} package, which is not installed: "
                f"pip install 'bapo-megatron[{extra}]'"
            )
