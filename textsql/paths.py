"""Every file and folder textsql reads or writes, by name: the dataset folder, the run folder and the launch folder.

docs/architecture.md has the same table for people. A file's format has one module that writes and reads it (named
beside each name here); everything else asks that module, or takes the name from here.
"""

import hashlib
import os
from importlib import resources
from pathlib import Path

# A prepared dataset folder (`textsql prep --output_dir`; textsql.prepared writes and reads it; textsql.prep builds it).
METADATA_FILE = "textsql_data.json"  # what was prepared: source, tokenizer, lengths, source format (textsql.prepared)
TABLES_FILE = "tables.jsonl"  # the tables the splits use, for execution accuracy (textsql.prepared)
TOKENIZER_DIR = "tokenizer"  # the tokenizer with the characters it lacked added (textsql.vocabulary)
# The splits themselves: datasets' own save_to_disk layout (train/, validation/, test/, dataset_dict.json).

# A run folder (`<runs_root>/<run name>` or --output_dir; textsql.train writes it).
SUMMARY_FILE = "run_summary.json"  # the record of a finished run (textsql.run_summary)
LOG_FILE = "train.log"  # rank 0's full log at INFO (textsql.train.logs)
RESOLVED_DSCONFIG_FILE = "ds_config.json"  # the DeepSpeed config as given to this run, "auto" left for the Trainer
TENSORBOARD_DIR = "tensorboard"  # rank 0's TensorBoard event files
CHECKPOINT_PREFIX = "checkpoint-"  # the Trainer's checkpoint-<step>/ folders; runs resume from the newest whole one
PREDICTIONS_FILE = "predictions.jsonl"  # `textsql infer`: one scored record per question (textsql.infer)
METRICS_FILE = "eval_metrics.json"  # `textsql infer`: the split's metrics (textsql.infer)
ADAPTER_CONFIG_FILE = (
    "adapter_config.json"  # a LoRA run: peft's adapter config, beside adapter_model.safetensors (peft's format)
)
ADAPTER_RECORD_FILE = "textsql_adapter.json"  # a LoRA run: its base, tokenizer and token rows (textsql.adapter_record)
MERGE_RECORD_FILE = (
    "textsql_merge.json"  # a merged QLoRA adapter: what it was merged onto and its score (textsql.merge)
)
QUANTIZATION_FILE = "textsql_quantization.json"  # a quantized model folder: the method and its score against the unquantized model (textsql.loading)
# DeepSpeed's tools in a run folder (textsql.train.dstools; --flops_profiler, --ds_monitor, --comms_logger).
FLOPS_PROFILE_FILE = "flops_profile.txt"  # the flops profiler's per-module table of the profiled step (rank 0)
DS_MONITOR_DIR = "ds_monitor"  # DeepSpeed's monitors: csv/ (one CSV per figure) and tensorboard/ (events), rank 0
COMMS_SUMMARY_FILE = "comms_summary.txt"  # DeepSpeed's comms logger: deepspeed.comm.log_summary()'s table, at the end
LAUNCH_RECORD_FILE = (
    "textsql-launch.json"  # multi-pod: the world size and nodes of the launch that trains it (textsql.cluster.runs)
)
# Multi-pod launches in the project (docs/multi-pod.md): a cluster's folder .textsql/cluster/<name>/ with its launches
# in launches/<id>/ (textsql.cluster.pods); pdsh's launches in .textsql/launches/<id>/ (textsql.cluster.pdsh).
CLUSTER_DIR = ".textsql/cluster"
LAUNCHES_DIR = "launches"
PDSH_LAUNCHES_DIR = ".textsql/launches"

# Folder names textsql makes (a run, a merged adapter, a quantized model) stay short: every setting is in the folder's
# own record (run_summary.json, textsql_adapter.json, textsql_quantization.json), the name only has to be readable and
# unique. A model's own name in a run's name is cut at MODEL_NAME_LIMIT (a run folder used as a base is not repeated
# whole), a whole name at NAME_LIMIT; a cut name ends in a hash of the whole one, so two names never meet.
NAME_LIMIT = 80
MODEL_NAME_LIMIT = 28
NAME_HASH_LENGTH = 6


def short_name(name: str, suffix: str = "", limit: int = NAME_LIMIT) -> str:
    """`name-suffix` when it fits in `limit` characters; else the leading dash-separated parts of `name` that fit,
    a hash of the whole `name-suffix`, and `suffix` (what the step adds, such as 'merged', is kept): e.g.
    'tiny-t5-zero2-ws1-bs16-lr0.002-ep8-seed0-warmup50-3f9a1c'."""
    whole = f"{name}-{suffix}" if suffix else name
    if len(whole) <= limit:
        return whole
    digest = hashlib.sha256(whole.encode()).hexdigest()[:NAME_HASH_LENGTH]
    room = limit - len(digest) - 1 - (len(suffix) + 1 if suffix else 0)
    head = name[: max(room, 1)]
    if len(name) > len(head) and name[len(head)] != "-" and "-" in head:
        head = head[: head.rindex("-")]  # whole parts only (never 'constant_with_' of a cut part)
    return "-".join(part for part in (head.rstrip("-_."), digest, suffix) if part)


IMPORT_RECORD_FILE = "textsql_import.json"  # a model folder made from a GGUF file: its source, sha256, quantization (textsql.model_import)

# A local launch (textsql.train.local_launch): a private temporary folder, removed afterwards.
ARGUMENTS_FILE = "train-arguments.json"  # the three argument dataclasses as one JSON object, parsed once by each rank

# The report (`textsql report`), under the runs root.
REPORT_DIR = "report"

# JupyterLab (`textsql lab`): the notebooks folder of the project.
NOTEBOOKS_DIR = "notebooks"

# The shipped DeepSpeed configs (package data: textsql/shipped_dsconfig, a link to the repository's dsconfig/ in a
# checkout), resolved, so messages name the folder users edit in an editable install and the installed copy in a wheel.
DSCONFIG_DIR = Path(str(resources.files("textsql") / "shipped_dsconfig")).resolve()

# The shipped FSDP2 configs, the same way (textsql/shipped_fsdpconfig, a link to the repository's fsdpconfig/).
FSDPCONFIG_DIR = Path(str(resources.files("textsql") / "shipped_fsdpconfig")).resolve()

# The recipes (package data: textsql/shipped_recipes, a link to the repository's recipes/), the same way: the demo
# trains from one of them (textsql.demo.real).
RECIPES_DIR = Path(str(resources.files("textsql") / "shipped_recipes")).resolve()

# Real WikiSQL release lines shipped with textsql (package data: textsql/wikisql/sample, with WikiSQL's LICENSE and a
# README on what and whence), read by name (textsql.wikisql.release: SAMPLE_SOURCE), checked against their sha256 in
# the folder's SHA256SUMS (sha256sum's `sha256  file` lines: the one record of them) before they are read.
WIKISQL_SAMPLE_DIR = Path(str(resources.files("textsql") / "wikisql" / "sample"))
WIKISQL_SAMPLE_CHECKSUMS_FILE = "SHA256SUMS"

# `textsql tune` (textsql.tune writes and reads them), in its folder (--tune_dir).
TUNE_RESULTS_FILE = "tune_results.jsonl"  # one measured candidate a line; a candidate already there is not run again
TUNE_TABLE_FILE = "tune_table.md"  # the candidates, measured against predicted, fastest first
TUNE_PLOT_FILE = "tune_plot.png"  # samples/s and peak memory per candidate
TUNE_RECIPE_FILE = "tune_recipe.yaml"  # the winner as a `textsql train` recipe
TUNE_LOGS_DIR = "logs"  # each candidate's training output
TUNE_RUNS_DIR = "runs"  # each candidate's run folder

# What `textsql demo` leaves in the project (textsql.demo): per family its tiny model and, under runs/, the run that
# fine-tuned it, in a folder named after the model (the README's and the notebooks' default models).
DEMO_DIR = "textsql-demo"
DEMO_MODEL_DIRS = {"t5": "tiny-t5", "causal": "tiny-qwen2"}
DEMO_RUNS_DIR = "runs"
DEMO_REAL_DATA_DIR = "data-smollm2"  # the real demo's prepared lines, in the model's prompt format
DEMO_REAL_RUN = "smollm2-135m-demo"  # the real demo's run, under DEMO_RUNS_DIR (notebooks and the compare app find it)

# The project: the folder the notebooks and the command share (a textsql checkout, or a CML project holding one).
PROJECT_DIR_VARIABLE = "TEXTSQL_PROJECT_DIR"
PROJECT_MARKERS = ("notebooks", "dsconfig")  # folders a textsql project holds at its root


def project_root() -> Path:
    """$TEXTSQL_PROJECT_DIR, else the nearest folder at or above the working directory that holds notebooks/ and
    dsconfig/ (a notebook's kernel runs in notebooks/, the command at the root: both find the same root), else the
    working directory itself."""
    if os.environ.get(PROJECT_DIR_VARIABLE):
        return Path(os.environ[PROJECT_DIR_VARIABLE]).expanduser().absolute()
    here = Path.cwd()
    for folder in (here, *here.parents):
        if all((folder / marker).is_dir() for marker in PROJECT_MARKERS):
            return folder
    return here


def in_project(path: str | None, *, only_if_exists: bool = False) -> str | None:
    """A relative path as the project root sees it: unchanged at the root (the command's usual place) and for
    absolute paths, else made absolute under the root, so a notebook in notebooks/ and the command at the root read
    and write the same data/, runs/ and textsql-demo/. With only_if_exists (a model: a folder or a hub name), only a
    path that exists under the root."""
    if not path or Path(path).expanduser().is_absolute():
        return path
    root = project_root()
    if root == Path.cwd() or (only_if_exists and not (root / path).exists()):
        return path
    return str(root / path)


# MLflow's local store (textsql.tracking), under the runs root, when no tracking server is configured.
MLFLOW_STORE_FILE = "mlflow.db"  # runs, parameters and metrics (SQLite)
MLFLOW_ARTIFACTS_DIR = "mlartifacts"  # their artifacts: run summaries, configs, models


OP_CACHE_DIR = "torch-extensions"  # DeepSpeed's compiled ops, in the user's cache (textsql.strategy.opbuilds)


def user_cache_dir(environ=os.environ) -> Path:
    """textsql's folder in the user's cache ($XDG_CACHE_HOME, else ~/.cache): fetched model packages, imported models,
    the GPTQ environment, the planner's model shapes, DeepSpeed's compiled ops. Outside the project folder, which every
    collaborator can write (docs/lifecycle.md)."""
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "textsql"


PLANNER_SHAPES_DIR = (
    "planner-shapes"  # in the user's cache: model shapes the planner built (textsql.planner.shape_cache)
)
