"""MLflow tracking (the runs of CML's Experiments page): whether a run is tracked and where, its experiment, name and
tags, and what reaches MLflow: parameters through the secret filter, the training curves, the run summary's figures,
the configs and, on request, the model. mlflow is imported only for a run that is tracked."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from textsql.arguments.tracking import TRACKING_URI_ENV, wanted
from textsql.errors import TextsqlError
from textsql.extras import require_mlflow_extra
from textsql.paths import (
    LOG_FILE,
    MLFLOW_ARTIFACTS_DIR,
    MLFLOW_STORE_FILE,
    RESOLVED_DSCONFIG_FILE,
    SUMMARY_FILE,
    in_project,
)
from textsql.redaction import is_secret
from textsql.run_summary import GIB, RunSummary

logger = logging.getLogger("textsql.tracking")

EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"
TAG = "textsql."  # textsql's tags: textsql.model, textsql.family, textsql.strategy, textsql.lora, textsql.pods, ...
KIND_TAG = TAG + "kind"  # train, tune, tune-candidate
MODEL_ARTIFACT = "model"  # --mlflow_log_model: the model or adapter with its tokenizer, registrable from here
FSDP_CONFIG_ARTIFACT = "fsdp_config.json"
MAX_PARAMS_PER_CALL = 100  # MLflow's limit on one log_params call
# Files of a run folder that are not the model: logged on their own (the summary, the config) or not at all.
NOT_THE_MODEL = {SUMMARY_FILE, LOG_FILE, RESOLVED_DSCONFIG_FILE, "trainer_state.json", "training_args.bin"}


# ---------------------------------------------------------------------------------------------------------------------
# The decisions: tracked or not, where, which experiment, which tags and parameters
# ---------------------------------------------------------------------------------------------------------------------


def tracked(report_to, environ=os.environ) -> bool:
    """wanted(), and mlflow there to track with: a run tracked only because CML configured a server, in an
    environment without the mlflow extra, trains untracked with a warning (asked for, it is refused at parsing)."""
    if not wanted(report_to, environ):
        return False
    if importlib.util.find_spec("mlflow") is None:
        logger.warning(
            "%s is set, but mlflow is not installed: this run is not tracked. Install the mlflow extra "
            "(pip install 'textsql[mlflow]'), or pass --report_to none to say so.",
            TRACKING_URI_ENV,
        )
        return False
    return True


def tracking_uri(runs_root: str | Path = "runs", environ=os.environ) -> str:
    """The configured server ($MLFLOW_TRACKING_URI), else the local store under the runs root: a SQLite file, no
    network (air-gapped machines; `mlflow ui --backend-store-uri` on it shows the runs)."""
    configured = environ.get(TRACKING_URI_ENV)
    if configured:
        return configured
    return "sqlite:///" + str((Path(in_project(str(runs_root))) / MLFLOW_STORE_FILE).absolute())


def local_artifacts(uri: str, runs_root: str | Path) -> str | None:
    """Where a new experiment of the local store keeps its artifacts (beside the store); a server decides its own."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(in_project(str(runs_root))) / MLFLOW_ARTIFACTS_DIR).absolute().as_uri()


def experiment_name(model_id: str, explicit: str | None = None, environ=os.environ) -> str:
    """--mlflow_experiment, else $MLFLOW_EXPERIMENT_NAME, else textsql-<the model's folder or hub name>: the runs of
    one base model side by side, whatever the strategy, adapter or pods (those are tags)."""
    return explicit or environ.get(EXPERIMENT_ENV) or f"textsql-{Path(str(model_id).rstrip('/')).name}"


def run_tags(model_id: str, family: str, strategy: dict, world_size: int, pods: int, kind: str) -> dict[str, str]:
    """textsql's tags of a run: what to filter and group by in the Experiments page."""
    lora = strategy.get("lora")
    tags = {
        TAG + "model": str(model_id),
        TAG + "family": family,
        TAG + "strategy": strategy.get("label", "none"),
        TAG + "lora": f"r{lora['rank']}" if lora else "none",
        TAG + "pods": str(pods),
        TAG + "world_size": str(world_size),
        KIND_TAG: kind,
    }
    return {name: value for name, value in tags.items() if not is_secret(name, value)}


def _flat(prefix: str, value) -> dict:
    if isinstance(value, dict) and value:
        return {k: v for key, item in value.items() for k, v in _flat(f"{prefix}.{key}", item).items()}
    return {prefix: value}


def parameters(arguments: dict, strategy: dict, max_length: int = 6000) -> dict[str, str]:
    """The run's resolved arguments and its strategy (strategy.*) as MLflow parameters: those with a value, each as
    text (JSON for structures, cut at MLflow's limit), none whose name or value the secret filter
    (textsql.redaction.is_secret) catches."""
    values = {**arguments, **_flat("strategy", strategy)}
    params = {}
    for name, value in values.items():
        if value is None or value == [] or value == {}:
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if not is_secret(name, text):
            params[name] = text[:max_length]
    return params


def summary_metrics(summary: RunSummary) -> dict[str, float]:
    """The run summary's figures as MLflow metrics: speed, losses, execution accuracy, the memory measured on the
    busiest rank and, where comparable (GPUs), the planner's prediction and the ratio; the flops profile's TFLOPS
    and MFU."""
    ranks = summary.peak_memory_per_rank or []
    gpu = [m["cuda_max_reserved_bytes"] for m in ranks if m.get("cuda_max_reserved_bytes") is not None]
    cpu = [m.get("cpu_peak_rss_bytes", 0) for m in ranks]
    check = summary.memory_check or {}
    profile = summary.flops_profile or {}
    grpo = summary.grpo or {}
    metrics = {
        "train_runtime": summary.train_runtime,
        "train_samples_per_second": summary.train_samples_per_second,
        "real_tokens_per_second": summary.real_tokens_per_second,
        "train_loss": summary.train_loss,
        "final_eval_loss": summary.eval_loss,
        "final_execution_accuracy": summary.execution_accuracy,
        "parameters": summary.parameters,
        "trainable_parameters": summary.trainable_parameters,
        "memory_peak_gpu_reserved_gib": max(gpu) / GIB if gpu else None,
        "memory_peak_cpu_rss_gib": max(cpu) / GIB if cpu else None,
        "memory_predicted_gib": check["predicted_reserved_bytes"] / GIB if check.get("comparable") else None,
        "memory_measured_over_predicted": check.get("ratio") if check.get("comparable") else None,
        "tflops_per_gpu": profile.get("tflops_per_gpu"),
        "mfu": profile.get("mfu"),
        # --stage grpo: the last logged mean reward, KL and share of groups without signal (the curves come as logged)
        "final_grpo_reward": grpo.get("reward"),
        "final_grpo_kl": grpo.get("kl"),
        "final_grpo_frac_reward_zero_std": grpo.get("frac_reward_zero_std"),
        "final_grpo_execution": grpo.get("rewards/execution/mean"),
        "final_grpo_frac_execution_zero_std": grpo.get("frac_execution_zero_std"),
    }
    return {name: float(value) for name, value in metrics.items() if isinstance(value, (int, float))}


# ---------------------------------------------------------------------------------------------------------------------
# A training run: started by the Trainer's callback on rank 0, ended after the run summary
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Tracking:
    """One tracked training run: where and as what it is logged; `run_id` once started (rank 0)."""

    uri: str
    experiment: str
    run_name: str
    tags: dict
    params: dict
    artifact_location: str | None = None
    parent_run_id: str | None = None
    run_id: str | None = None

    def start(self) -> str:
        import mlflow

        mlflow.set_tracking_uri(self.uri)
        experiment_id = ensure_experiment(mlflow.MlflowClient(self.uri), self.experiment, self.artifact_location)
        # A notebook's own active run: this run nests under it, rather than failing on "run already active".
        run = mlflow.start_run(
            experiment_id=experiment_id,
            run_name=self.run_name,
            tags=self.tags,
            parent_run_id=self.parent_run_id,
            nested=mlflow.active_run() is not None,
        )
        self.run_id = run.info.run_id
        items = list(self.params.items())
        for i in range(0, len(items), MAX_PARAMS_PER_CALL):
            mlflow.log_params(dict(items[i : i + MAX_PARAMS_PER_CALL]))
        logger.info("MLflow run %s (experiment %s) at %s", self.run_id, self.experiment, _safe(self.uri))
        return self.run_id

    def finish(self, summary: RunSummary, run_dir: Path, fsdp_config: dict | None, log_model: bool) -> None:
        """Rank 0, after run_summary.json: its figures, the file itself, the configs as the run used them, and with
        `log_model` the model (or adapter) with its tokenizer; then the run ends."""
        import mlflow

        run_dir = Path(run_dir)
        mlflow.log_metrics(summary_metrics(summary), step=summary.global_step)
        mlflow.set_tag(TAG + "pods", str(summary.nodes))  # the hosts the ranks ran on, now known
        mlflow.log_artifact(str(run_dir / SUMMARY_FILE))
        if summary.deepspeed_config:
            mlflow.log_dict(summary.deepspeed_config, RESOLVED_DSCONFIG_FILE)  # as DeepSpeed ran it, "auto" filled
        if fsdp_config:
            mlflow.log_dict(fsdp_config, FSDP_CONFIG_ARTIFACT)
        if log_model:  # the model's files only, not the run's logs and checkpoints
            for path in model_files(run_dir):
                mlflow.log_artifact(str(path), MODEL_ARTIFACT)
            mlflow.set_tag(TAG + "model_artifact", MODEL_ARTIFACT)
        mlflow.flush_async_logging()
        mlflow.end_run()


def model_files(run_dir: Path) -> list[Path]:
    """The files of a run folder that make the model (or the LoRA adapter with its record) and its tokenizer."""
    return sorted(
        p for p in Path(run_dir).iterdir() if p.is_file() and not p.name.startswith(".") and p.name not in NOT_THE_MODEL
    )


def _safe(uri: str) -> str:
    """A URI for the log: without credentials it might carry (scheme://user:password@host)."""
    return re.sub(r"://[^/\s@]+@", "://", uri)


def ensure_experiment(client, name: str, artifact_location: str | None) -> str:
    """The experiment's id, created when new (in the local store with its artifacts beside the store)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except Exception:  # another rank or process created it at the same moment
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def for_training(
    training, arguments: dict, model_id: str, family: str, strategy: dict, pods: int, run_dir: Path
) -> Tracking | None:
    """The Tracking of a training run, or None when it is not tracked (mlflow not imported then)."""
    if not tracked(training.report_to):
        return None
    uri = tracking_uri(training.runs_root)
    kind = "tune-candidate" if training.mlflow_parent_run_id else "train"
    return Tracking(
        uri=uri,
        experiment=experiment_name(model_id, training.mlflow_experiment),
        run_name=Path(run_dir).name,
        tags=run_tags(model_id, family, strategy, training.world_size, pods, kind),
        params=parameters(arguments, strategy),
        artifact_location=local_artifacts(uri, training.runs_root),
        parent_run_id=training.mlflow_parent_run_id,
    )


def end_failed_run() -> None:
    """A training that stopped with an error ends its MLflow run as FAILED (nothing to do when mlflow was never
    imported, or the active run is not textsql's)."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or not hasattr(mlflow, "active_run"):
        return
    run = mlflow.active_run()
    if run is not None and KIND_TAG in (run.data.tags or {}):
        mlflow.end_run(status="FAILED")


# ---------------------------------------------------------------------------------------------------------------------
# textsql tune: one parent run, each candidate's training nested under it
# ---------------------------------------------------------------------------------------------------------------------


def start_tune_run(base: dict, tune_settings: dict, tune_dir: Path) -> dict | None:
    """The tune's parent run (when the candidates' arguments make a tracked run; `base` is their arguments as a dict):
    {"uri", "run_id"}, or None. Each candidate then trains with candidate_values()."""
    if not tracked(base.get("report_to")):
        return None
    from mlflow import MlflowClient

    uri = tracking_uri(base.get("runs_root") or "runs")
    client = MlflowClient(uri)
    experiment = experiment_name(base["model_id"], base.get("mlflow_experiment"))
    experiment_id = ensure_experiment(client, experiment, local_artifacts(uri, base.get("runs_root") or "runs"))
    tags = {TAG + "model": str(base["model_id"]), KIND_TAG: "tune"}
    run = client.create_run(experiment_id, run_name=f"tune-{Path(tune_dir).name}", tags=tags)
    params = parameters(tune_settings, {})
    items = list(params.items())
    for i in range(0, len(items), MAX_PARAMS_PER_CALL):
        client.log_batch(run.info.run_id, params=[_param(k, v) for k, v in items[i : i + MAX_PARAMS_PER_CALL]])
    return {"uri": uri, "run_id": run.info.run_id}


def _param(name: str, value: str):
    from mlflow.entities import Param

    return Param(name, value)


def candidate_values(parent_run_id: str | None) -> dict:
    """A tune candidate's training arguments under a tracked tune: tracked (report_to mlflow), nested under the tune's
    run, without logging its model; nothing when the tune is not tracked."""
    if not parent_run_id:
        return {}
    return {"report_to": "mlflow", "mlflow_parent_run_id": parent_run_id, "mlflow_log_model": False}


def end_tune_run(parent: dict | None, files: list[Path] = (), winner: str | None = None, failed: bool = False) -> None:
    """The tune's table, plot and recipe on its run, the winner as a tag, and the run ended."""
    if not parent:
        return
    from mlflow import MlflowClient

    client = MlflowClient(parent["uri"])
    for path in files:
        if path is not None and Path(path).is_file():
            client.log_artifact(parent["run_id"], str(path))
    if winner:
        client.set_tag(parent["run_id"], TAG + "winner", winner)
    client.set_terminated(parent["run_id"], "FAILED" if failed else "FINISHED")


# ---------------------------------------------------------------------------------------------------------------------
# textsql report: the runs of an experiment, read back
# ---------------------------------------------------------------------------------------------------------------------


def download_summaries(experiment: str, into: Path, runs_root: str | Path = "runs") -> int:
    """Fetch run_summary.json of every finished run of `experiment` (from $MLFLOW_TRACKING_URI, else the local store
    under `runs_root`) into one folder per run under `into`: what textsql.report reads. The number fetched."""
    require_mlflow_extra("Reading runs from MLflow")
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    uri = tracking_uri(runs_root)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise TextsqlError(
            f"No MLflow store at {uri} and no {TRACKING_URI_ENV} set: track runs with --report_to mlflow first, or "
            f"set {TRACKING_URI_ENV} to the tracking server."
        )
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise TextsqlError(
            f"MLflow at {_safe(uri)} has no experiment '{experiment}'. Its experiments: "
            + ", ".join(e.name for e in client.search_experiments())
            + "."
        )
    count = 0
    for run in client.search_runs([found.experiment_id], "attributes.status = 'FINISHED'", max_results=5000):
        if not any(a.path == SUMMARY_FILE for a in client.list_artifacts(run.info.run_id)):
            continue  # a tune's parent run: its candidates have summaries
        folder = Path(into) / f"{run.info.run_name}-{run.info.run_id[:8]}"
        folder.mkdir(parents=True, exist_ok=True)
        download_artifacts(run_id=run.info.run_id, artifact_path=SUMMARY_FILE, dst_path=str(folder), tracking_uri=uri)
        count += 1
    return count
