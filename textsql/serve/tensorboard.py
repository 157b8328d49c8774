"""`textsql tensorboard`: TensorBoard over the runs root, bound to 127.0.0.1 on CML's application port.

In a CML Application (or a session) CML proxies, with authentication, whatever binds 127.0.0.1 on
$CDSW_APP_PORT; that port wins when it is set. Elsewhere the port is --port (default 6006).

A CML Application runs scripts/tensorboard_app.py (Applications run a script with no arguments):
    Script: scripts/tensorboard_app.py     Environment variable (optional): TEXTSQL_RUNS_ROOT=runs
"""

from __future__ import annotations

import os
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


def tensorboard_flags(
    runs_root: str | Path, port: int, host: str = DEFAULT_HOST, extra: list[str] | None = None
) -> list[str]:
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
