"""`textsql tensorboard`: TensorBoard on the runs root, bound to 127.0.0.1 ($CDSW_APP_PORT as a CML Application)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from textsql.paths import in_project
from textsql.serve.tensorboard import (
    APP_PORT_VARIABLE,
    DEFAULT_HOST,
    DEFAULT_PORT,
    RUNS_ROOT_VARIABLE,
    resolve_port,
    serve,
)


def tensorboard_cli(argv: list[str]) -> int:
    """Body of `textsql tensorboard`. Unknown flags (e.g. --reload_interval 30) are passed on to TensorBoard."""
    parser = argparse.ArgumentParser(
        prog="textsql tensorboard",
        description="Serve TensorBoard over the runs root (every run's <run>/tensorboard events), bound to 127.0.0.1 on "
        f"${APP_PORT_VARIABLE} when set (CML's application port), else on --port. Other flags go to TensorBoard.",
    )
    parser.add_argument(
        "--runs_root",
        "--logdir",
        default=os.environ.get(RUNS_ROOT_VARIABLE) or "runs",
        help=f"Root of the runs (default: ${RUNS_ROOT_VARIABLE}, else runs).",
    )
    parser.add_argument(
        "--port", type=int, default=None, help=f"Port when ${APP_PORT_VARIABLE} is not set (default {DEFAULT_PORT})."
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help="Address to bind (default 127.0.0.1, as CML requires).")
    args, extra = parser.parse_known_args(argv)
    try:
        port, note = resolve_port(args.port)
    except ValueError as error:
        print(f"textsql tensorboard: {error}", file=sys.stderr)
        return 2
    if note:
        print(f"textsql tensorboard: {note}", file=sys.stderr)
    root = Path(in_project(args.runs_root))  # the project's runs/, wherever the command starts
    if not root.exists():
        root.mkdir(parents=True)
        print(
            f"textsql tensorboard: created the empty runs root {root.resolve()}; runs appear as they write events.",
            file=sys.stderr,
        )
    print(f"textsql tensorboard: serving {root.resolve()} on http://{args.host}:{port}/", flush=True)
    return serve(root, port, args.host, extra)
