"""`textsql lab`: JupyterLab on the project's notebooks, bound to 127.0.0.1, with a new token printed once and never saved.

In a CML session JupyterLab is already the editor; this is for any other machine (`bash scripts/bootstrap.sh lab`),
or a CML Application, which must serve $CDSW_APP_PORT. Where the secrets go, and why:
- the token reaches the server as configuration inside this process: not on the command line (`ps` shows it to every
  user of the machine), not in an environment variable (every kernel, terminal and training process would inherit it);
- Jupyter's runtime files (the server file holds the token; also the cookie secret and the kernels' connection keys)
  and the notebook-signing key go to a private temporary folder, removed at exit, instead of ~/.local/share/jupyter:
  on CML the home folder is the project folder, which every collaborator can read. (So notebook trust lasts one run.)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import tempfile
from pathlib import Path

from textsql.extras import require_notebooks_extra
from textsql.paths import NOTEBOOKS_DIR
from textsql.serve.tensorboard import DEFAULT_HOST

DEFAULT_PORT = 8888
RUNTIME_DIR_VARIABLE = "JUPYTER_RUNTIME_DIR"


def lab_config(
    root_dir: Path, port: int, token: str, private_dir: str, *, behind_cml_proxy: bool, host: str = DEFAULT_HOST
):
    """The Jupyter server's settings, as a traitlets Config; private_dir takes the secrets Jupyter writes to files."""
    from traitlets.config import Config

    config = Config()
    server = config.ServerApp
    server.ip, server.port = host, port
    server.port_retries = 0  # another port than the announced one would make the printed URL wrong
    server.open_browser = False
    server.root_dir = str(root_dir)
    # Jupyter refuses root unless told; containers and CI machines often are root (CML runs as cdsw). Said on start.
    server.allow_root = running_as_root()
    # CML's proxy forwards $CDSW_APP_PORT under the engine's own host name, which Jupyter refuses by default when bound
    # to loopback (a guard against DNS rebinding); the token still guards every request.
    server.allow_remote_access = behind_cml_proxy
    config.IdentityProvider.token = token
    config.NotebookNotary.data_dir = private_dir  # the signing key and trust database, else in the home folder
    return config


def running_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def lab_url(root_dir: Path, port: int, token: str, host: str = DEFAULT_HOST) -> str:
    """Where to open JupyterLab: the notebooks folder's file browser when the root has one."""
    path = f"/lab/tree/{NOTEBOOKS_DIR}" if (root_dir / NOTEBOOKS_DIR).is_dir() else "/lab"
    return f"http://{host}:{port}{path}?token={token}"


@contextlib.contextmanager
def private_runtime_dir():
    """A new private folder (mode 0700) as Jupyter's runtime folder for the duration; removed afterwards."""
    previous = os.environ.get(RUNTIME_DIR_VARIABLE)
    with tempfile.TemporaryDirectory(prefix="textsql-jupyter-") as folder:
        os.environ[RUNTIME_DIR_VARIABLE] = folder  # read by Jupyter itself: not one of its settings
        try:
            yield folder
        finally:
            if previous is None:
                os.environ.pop(RUNTIME_DIR_VARIABLE, None)
            else:
                os.environ[RUNTIME_DIR_VARIABLE] = previous


@contextlib.contextmanager
def commands_on_path():
    """This interpreter's folder of commands (the virtual environment's bin/, where `textsql` is) first on PATH for the
    duration: JupyterLab's terminals and the kernels it starts inherit it, so `textsql ...` and `!textsql ...` work in
    the lab without activating the environment."""
    previous = os.environ.get("PATH", "")
    bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = os.pathsep.join([bin_dir, *(p for p in previous.split(os.pathsep) if p and p != bin_dir)])
    try:
        yield bin_dir
    finally:
        os.environ["PATH"] = previous


def serve_lab(root_dir: str | Path, port: int, *, behind_cml_proxy: bool = False) -> int:
    """Run JupyterLab in this process until it is stopped (Ctrl-C, or SIGTERM), printing its URL once it listens."""
    require_notebooks_extra("jupyterlab", "textsql lab")
    from jupyterlab.labapp import LabApp

    root = Path(root_dir).resolve()
    token = secrets.token_urlsafe(32)
    with private_runtime_dir() as runtime_dir, commands_on_path():
        server = LabApp.initialize_server(
            argv=[], config=lab_config(root, port, token, runtime_dir, behind_cml_proxy=behind_cml_proxy)
        )
        # Queued after the server's own bind: printed once the port is really served (with --port 0, the one picked).
        server.io_loop.add_callback(
            lambda: print(
                f"textsql lab: JupyterLab on {lab_url(root, server.port, token)}\n"
                "textsql lab: the token is printed only here (a new one each start); Ctrl-C stops the server",
                flush=True,
            )
        )
        server.start()
    return 0
