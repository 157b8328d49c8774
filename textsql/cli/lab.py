"""`textsql lab`: JupyterLab on the project's notebooks, bound to 127.0.0.1, a token printed once."""

from __future__ import annotations

import argparse
import os
import sys

from textsql.paths import project_root
from textsql.serve.lab import DEFAULT_PORT, running_as_root, serve_lab
from textsql.serve.tensorboard import APP_PORT_VARIABLE, resolve_port


def lab_cli(argv: list[str]) -> int:
    """Body of `textsql lab`."""
    parser = argparse.ArgumentParser(
        prog="textsql lab",
        description="Open JupyterLab on the project's notebooks: bound to 127.0.0.1 on $CDSW_APP_PORT (CML) or --port, "
        "no browser, a new access token printed once to this terminal and written nowhere in the project folder.",
    )
    parser.add_argument(
        "--root_dir",
        default=None,
        help="Folder JupyterLab serves; its notebooks/ opens first (default: the project "
        "root: the folder holding notebooks/ and dsconfig/ at or above this one).",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"Port when ${APP_PORT_VARIABLE} is not set (default {DEFAULT_PORT}; 0 picks a free one).",
    )
    args = parser.parse_args(argv)
    try:
        port, note = resolve_port(args.port, default=DEFAULT_PORT)
    except ValueError as error:
        print(f"textsql lab: {error}", file=sys.stderr)
        return 2
    if note:
        print(f"textsql lab: {note}", file=sys.stderr)
    if running_as_root():
        print(
            "textsql lab: running as root (as in many containers): the kernels and terminals run as root too.",
            file=sys.stderr,
        )
    return serve_lab(
        args.root_dir or project_root(), port, behind_cml_proxy=bool(os.environ.get(APP_PORT_VARIABLE, "").strip())
    )
