"""`textsql tensorboard`: TensorBoard over the runs root, bound to 127.0.0.1 on CML's application port.

In a CML Application (or a session) CML proxies, with authentication, whatever binds 127.0.0.1 on
$CDSW_APP_PORT; that port wins when it is set. Elsewhere the port is --port (default 6006).

This file is also the script a CML Application runs (Applications run a script with no arguments):
    Script: textsql/tensorboard_app.py     Environment variable (optional): TEXTSQL_RUNS_ROOT=runs
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_PORT = 6006
DEFAULT_HOST = "127.0.0.1"
APP_PORT_VARIABLE = "CDSW_APP_PORT"
RUNS_ROOT_VARIABLE = "TEXTSQL_RUNS_ROOT"


def resolve_port(port: int | None, environ=os.environ, default: int = DEFAULT_PORT) -> tuple[int, str | None]:
    """(port, note): $CDSW_APP_PORT when set (CML proxies only that one), else `port`, else `default` (6006)."""
    app_port = environ.get(APP_PORT_VARIABLE, "").strip()
    if app_port:
        if not app_port.isdigit():
            raise ValueError(f"${APP_PORT_VARIABLE} is '{app_port}', not a port number.")
        note = None
        if port is not None and port != int(app_port):
            note = f"--port {port} ignored: ${APP_PORT_VARIABLE} is set to {app_port}, the only port CML proxies to this engine."
        return int(app_port), note
    return (port if port is not None else default), None


def tensorboard_flags(runs_root: str | Path, port: int, host: str = DEFAULT_HOST, extra: list[str] | None = None) -> list[str]:
    """TensorBoard's own command-line flags for serving runs_root (its argv without the program name)."""
    return ["--logdir", str(Path(runs_root).resolve()), "--host", host, "--port", str(port), *(extra or [])]


def serve(runs_root: str | Path, port: int, host: str = DEFAULT_HOST, extra: list[str] | None = None) -> int:
    """Run TensorBoard in this process until it is stopped (Ctrl-C or SIGTERM). Returns its exit status."""
    from tensorboard import default, main_lib, program

    main_lib.global_init()
    board = program.TensorBoard(plugins=default.get_plugins())
    board.configure(argv=["tensorboard", *tensorboard_flags(runs_root, port, host, extra)])
    try:
        return board.main() or 0
    except KeyboardInterrupt:
        return 0


def tensorboard_cli(argv: list[str]) -> int:
    """Body of `textsql tensorboard`. Unknown flags (e.g. --reload_interval 30) are passed on to TensorBoard."""
    parser = argparse.ArgumentParser(
        prog="textsql tensorboard",
        description="Serve TensorBoard over the runs root (every run's <run>/tensorboard events), bound to 127.0.0.1 on "
        f"${APP_PORT_VARIABLE} when set (CML's application port), else on --port. Other flags go to TensorBoard.",
    )
    parser.add_argument("--runs_root", "--logdir", default=os.environ.get(RUNS_ROOT_VARIABLE) or "runs",
                        help=f"Root of the runs (default: ${RUNS_ROOT_VARIABLE}, else runs).")
    parser.add_argument("--port", type=int, default=None, help=f"Port when ${APP_PORT_VARIABLE} is not set (default {DEFAULT_PORT}).")
    parser.add_argument("--host", default=DEFAULT_HOST, help="Address to bind (default 127.0.0.1, as CML requires).")
    args, extra = parser.parse_known_args(argv)
    try:
        port, note = resolve_port(args.port)
    except ValueError as error:
        print(f"textsql tensorboard: {error}", file=sys.stderr)
        return 2
    if note:
        print(f"textsql tensorboard: {note}", file=sys.stderr)
    root = Path(args.runs_root)
    if not root.exists():
        root.mkdir(parents=True)
        print(f"textsql tensorboard: created the empty runs root {root.resolve()}; runs appear as they write events.", file=sys.stderr)
    print(f"textsql tensorboard: serving {root.resolve()} on http://{args.host}:{port}/", flush=True)
    return serve(root, port, args.host, extra)


if __name__ == "__main__":
    if __package__ in (None, ""):
        # Run as a file (a CML Application's script): import the package from the repository, not this file's siblings.
        sys.path[0] = str(Path(__file__).resolve().parent.parent)
    from textsql.tensorboard_app import tensorboard_cli as _cli

    sys.exit(_cli(sys.argv[1:]))
