"""MLflow's flags (--mlflow_experiment, --mlflow_log_model, ...): their defaults and checks, and whether
--report_to (or a configured tracking server) asks for tracking."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field

from textsql.errors import TextsqlError
from textsql.extras import require_mlflow_extra

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"  # CML sets it in every session: its Experiments page is this server


@dataclass
class TrackingArguments:
    """MLflow tracking (textsql.tracking): a run is tracked when --report_to names mlflow or MLFLOW_TRACKING_URI is set
    (and --report_to is not none)."""

    mlflow_experiment: str | None = field(
        default=None,
        metadata={
            "help": "MLflow experiment of a tracked run; default: $MLFLOW_EXPERIMENT_NAME, else textsql-<model folder "
            "or hub name> (docs/training.md#track-runs-in-mlflow-cml-experiments)."
        },
    )
    mlflow_log_model: bool = field(
        default=False,
        metadata={
            "help": "Also log the trained model (or the LoRA adapter) with its tokenizer to the MLflow run, as the "
            "artifact 'model', from where it can be registered."
        },
    )
    mlflow_parent_run_id: str | None = field(
        default=None,
        metadata={"help": "The MLflow run this run nests under; textsql tune sets it for each candidate."},
    )

    def check_tracking(self, report_to) -> None:
        if self.mlflow_parent_run_id is not None and not re.fullmatch(r"[0-9a-f]{32}", self.mlflow_parent_run_id):
            raise TextsqlError(
                f"--mlflow_parent_run_id must be an MLflow run id (32 hex digits), not '{self.mlflow_parent_run_id}'."
            )
        if self.mlflow_experiment is not None and not self.mlflow_experiment.strip():
            raise TextsqlError("--mlflow_experiment must name an experiment (or be left out for the default).")
        if asked(report_to):
            require_mlflow_extra("--report_to mlflow")
        if self.mlflow_log_model and not wanted(report_to):
            raise TextsqlError(
                "--mlflow_log_model True logs the model to MLflow, but this run is not tracked: pass --report_to "
                f"mlflow (with no {TRACKING_URI_ENV} set, into a local store under the runs root), or set "
                f"{TRACKING_URI_ENV} to your tracking server."
            )


def report_names(report_to) -> list[str]:
    if report_to is None:
        return ["none"]
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    return [str(name).strip() for part in names for name in str(part).split(",")]


def asked(report_to) -> bool:
    """--report_to names mlflow (or all, where mlflow is installed)."""
    names = report_names(report_to)
    return "mlflow" in names or ("all" in names and importlib.util.find_spec("mlflow") is not None)


def wanted(report_to, environ=os.environ) -> bool:
    """Whether a run is tracked: --report_to asks for mlflow, or a tracking URI is configured (CML sets one in its
    sessions) and --report_to is not `none`."""
    return asked(report_to) or (bool(environ.get(TRACKING_URI_ENV)) and report_names(report_to) != ["none"])
