"""What the notebooks call first: textsql's errors shown as their one paragraph (as the command prints them), library
FutureWarnings left out, and the model a notebook uses when none is named."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.extras import quiet_lifecycle_logs
from textsql.paths import SUMMARY_FILE, in_project

DEMO_MODEL = "textsql-demo/tiny-t5"  # what `textsql demo` leaves in the project: a model that works offline
DEMO_RUNS = "textsql-demo/runs"  # and the run that fine-tuned it
HUB_MODEL = "t5-small"


def default_model_id() -> str:
    """The demo's tiny T5 when the project has one (it trains on a CPU, offline), else t5-small from the hub. Pass a
    model_id to use another: a hub name, or a folder copied into the project (`hf download t5-small --local-dir
    models/t5-small` on a machine with internet access)."""
    demo = Path(in_project(DEMO_MODEL))
    return str(demo) if (demo / "config.json").is_file() else HUB_MODEL


def trained_demo_model() -> str | None:
    """The demo's fine-tuned model (its newest finished run) when the project has one, else None: a base that already
    writes SQL's shape, so that an adapter trained for minutes on top of it changes answers one can see (on the demo's
    untrained tiny T5 every model writes the same few tokens)."""
    finished = sorted(Path(in_project(DEMO_RUNS)).glob(f"*/{SUMMARY_FILE}"), key=lambda path: path.stat().st_mtime)
    return str(finished[-1].parent) if finished else None


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
