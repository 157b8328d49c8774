"""`textsql lab` (what `bash scripts/bootstrap.sh lab` runs): a real JupyterLab serving the notebooks on 127.0.0.1 behind
a token printed once and written nowhere in the project folder; stopped with SIGTERM, it leaves nothing running."""

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat

from textsql.train.distributed import free_port

REPO = Path(__file__).resolve().parents[2]
ANNOUNCED = re.compile(r"textsql lab: JupyterLab on (http://127\.0\.0\.1:(\d+)/lab/tree/notebooks)\?token=([\w-]+)")


def get(url: str, headers: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def read_lines(stream, lines: queue.Queue):
    for line in stream:
        lines.put(line)
    lines.put(None)


def test_lab_serves_a_notebook_with_a_token_on_loopback_and_stops_cleanly(tmp_path):
    # A CML-like project folder (home = project folder) holding the notebooks; a private TMPDIR to see what is left there.
    project, tmp = tmp_path / "project", tmp_path / "tmp"
    shutil.copytree(REPO / "notebooks", project / "notebooks")
    tmp.mkdir()
    port = free_port("127.0.0.1")
    env = dict(os.environ, HOME=str(project), TMPDIR=str(tmp), CDSW_APP_PORT=str(port), PYTHONUNBUFFERED="1")
    textsql = Path(sys.executable).parent / "textsql"  # the console script bootstrap.sh runs
    process = subprocess.Popen(
        [str(textsql), "lab"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue = queue.Queue()
    output: list[str] = []
    threading.Thread(target=read_lines, args=(process.stdout, lines), daemon=True).start()
    try:
        deadline, match = time.monotonic() + 90, None
        while match is None:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"textsql lab exited ({process.wait()}) before serving:\n{''.join(output)}"
            output.append(line)
            match = ANNOUNCED.search(line)
        url, served_port, token = match.groups()
        assert int(served_port) == port  # $CDSW_APP_PORT wins, as CML requires

        name = "prep_dataset.ipynb"
        status, body = get(
            f"http://127.0.0.1:{port}/api/contents/notebooks/{name}", {"Authorization": f"token {token}"}
        )
        assert status == 200, body
        served, on_disk = json.loads(body), nbformat.read(project / "notebooks" / name, as_version=4)
        assert served["type"] == "notebook"
        assert [(c["cell_type"], c["source"]) for c in served["content"]["cells"]] == [
            (c.cell_type, c.source) for c in on_disk.cells
        ]
        # CML's proxy presents the engine's host name; without the token nothing is served, with a wrong one neither.
        status, _ = get(
            f"http://127.0.0.1:{port}/api/contents/notebooks/{name}",
            {"Authorization": f"token {token}", "Host": "abc123.ml.example.com"},
        )
        assert status == 200
        assert get(f"http://127.0.0.1:{port}/api/contents/notebooks/{name}", {})[0] == 403
        assert get(f"http://127.0.0.1:{port}/api/contents/notebooks/{name}", {"Authorization": "token wrong"})[0] == 403
        # Bound to 127.0.0.1 only: another loopback address of this machine is refused.
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.2", port)) != 0

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    while (line := lines.get(timeout=10)) is not None:
        output.append(line)
    text = "".join(output)
    try:
        os.killpg(process.pid, 0)
        raise AssertionError(f"processes of textsql lab's group are still running:\n{text}")
    except ProcessLookupError:
        pass  # nothing left: the server and any child it started are gone
    assert text.count(token) == 1, text  # printed once; Jupyter's own log shows "token=..."
    leaked = [str(p) for p in project.rglob("*") if p.is_file() and token in p.read_text(errors="replace")]
    assert not leaked, f"the token was written into the project folder: {leaked}"
    secrets_at_home = [
        str(p)
        for name in ("jpserver-*", "jupyter_cookie_secret", "notebook_secret", "nbsignatures.db")
        for p in project.rglob(name)
    ]
    assert not secrets_at_home, (
        secrets_at_home
    )  # the runtime files and the notebook-signing key stay out of the home folder
    assert list(tmp.iterdir()) == []  # the private runtime folder is removed at exit


def test_lab_puts_the_environments_commands_on_path(monkeypatch):
    """A new user's shell may not have activated .venv: the lab's terminals and kernels still find `textsql`."""
    import os
    import shutil
    import sys
    from pathlib import Path

    from textsql.serve.lab import commands_on_path

    bin_dir = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with commands_on_path():
        assert os.environ["PATH"].split(os.pathsep)[0] == bin_dir
        assert shutil.which("textsql") == str(Path(bin_dir) / "textsql")
    assert os.environ["PATH"] == "/usr/bin:/bin"
