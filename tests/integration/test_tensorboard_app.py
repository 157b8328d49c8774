"""`textsql tensorboard`: the real TensorBoard over two tiny runs, read through its HTTP API and rendered in headless Chromium."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import headless_chromium

from textsql.train.distributed import free_port

REPO = Path(__file__).resolve().parents[2]


def get_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def server(two_tiny_runs, tmp_path_factory):
    """(base URL, process, summaries): `python -m textsql tensorboard` on a free loopback port; stopped afterwards."""
    runs_root, summaries = two_tiny_runs
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "CDSW_APP_PORT"}
    log = tmp_path_factory.mktemp("tensorboard") / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "textsql", "tensorboard", "--runs_root", str(runs_root), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    expected = {f"{s['run']}/tensorboard" for s in summaries.values()}
    deadline = time.monotonic() + 90
    try:
        while True:
            assert process.poll() is None, f"TensorBoard exited with {process.returncode}:\n{log.read_text()}"
            try:
                if expected <= set(get_json(f"{base}/data/runs", timeout=2)):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"TensorBoard did not list both runs within 90 s:\n{log.read_text()}"
            time.sleep(0.5)
        yield base, process, summaries
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_both_runs_loss_scalars_through_the_http_api(server):
    base, _, summaries = server
    tags = get_json(f"{base}/data/plugin/scalars/tags")
    for summary in summaries.values():
        run = f"{summary['run']}/tensorboard"
        assert {"train/loss", "eval/loss"} <= set(tags[run]), tags.get(run)
        query = urllib.parse.urlencode({"run": run, "tag": "train/loss"})
        points = get_json(f"{base}/data/plugin/scalars/scalars?{query}")  # [[wall_time, step, value], ...]
        steps = [step for _, step, _ in points]
        assert steps == sorted(steps) and steps[-1] == summary["global_step"] == 12
        assert points[0][2] == pytest.approx(summary["first_logged_loss"], abs=1e-3)
        assert points[-1][2] == pytest.approx(summary["last_logged_loss"], abs=1e-3)
        evaluations = get_json(
            f"{base}/data/plugin/scalars/scalars?" + urllib.parse.urlencode({"run": run, "tag": "eval/loss"})
        )
        assert evaluations[-1][2] == pytest.approx(summary["eval_loss"], abs=1e-3)


def test_bound_to_loopback_127_0_0_1_only(server):
    base, _, _ = server
    port = urllib.parse.urlparse(base).port
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", port), timeout=2).close()


def test_page_renders_both_runs_in_headless_chromium(server, tmp_path):
    from matplotlib.image import imread

    base, _, summaries = server
    runs = [f"{s['run']}/tensorboard" for s in summaries.values()]
    # The Time Series dashboard is plain DOM: its runs table lists the runs.
    dom = headless_chromium(
        "--virtual-time-budget=10000", "--dump-dom", f"{base}/#timeseries", user_data_dir=tmp_path / "profile-dom"
    )
    assert dom.returncode == 0, dom.stderr[-3000:]
    assert all(run in dom.stdout for run in runs), "the rendered page does not list both runs"
    # The Scalars dashboard draws the loss curves as SVG, which headless Chromium renders without a GPU.
    screenshot = tmp_path / "tensorboard.png"
    shot = headless_chromium(
        "--virtual-time-budget=20000",
        f"--screenshot={screenshot}",
        f"{base}/#scalars&tagFilter=loss&_smoothingWeight=0",
        user_data_dir=tmp_path / "profile-shot",
    )
    assert shot.returncode == 0 and screenshot.is_file(), shot.stderr[-3000:]
    pixels = imread(screenshot)
    assert pixels.shape[:2] == (900, 1400) and pixels[..., :3].var() > 0.01, "the screenshot is blank"
    orange = ((pixels[..., 0] > 0.9) & (abs(pixels[..., 1] - 0.49) < 0.08) & (pixels[..., 2] < 0.1)).mean()
    assert orange > 0.03, "TensorBoard's header is not in the screenshot"


def test_stopping_the_app_ends_tensorboard_and_its_data_server(two_tiny_runs, tmp_path):
    """SIGTERM (what CML sends when an Application stops) ends TensorBoard, its Rust data server, and frees the port."""
    import psutil

    runs_root, _ = two_tiny_runs
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "CDSW_APP_PORT"}
    env["CDSW_APP_PORT"] = str(port)  # the CML way: no --port, the application port from the environment
    process = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "tensorboard_app.py"), "--runs_root", str(runs_root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if get_json(f"http://127.0.0.1:{port}/data/runs", timeout=2):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "TensorBoard did not come up on $CDSW_APP_PORT"
            time.sleep(0.5)
        children = psutil.Process(process.pid).children(recursive=True)
    finally:
        stop(process)
    assert process.returncode is not None
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"still running after the app stopped: {alive}"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_port_resolution_prefers_cml_application_port():
    from textsql.serve.tensorboard import DEFAULT_PORT, resolve_port, tensorboard_flags

    assert resolve_port(None, {}) == (DEFAULT_PORT, None)
    assert resolve_port(7007, {}) == (7007, None)
    assert resolve_port(None, {"CDSW_APP_PORT": "8100"}) == (8100, None)
    port, note = resolve_port(7007, {"CDSW_APP_PORT": "8100"})
    assert port == 8100 and "--port 7007 ignored" in note
    with pytest.raises(ValueError, match="not a port number"):
        resolve_port(None, {"CDSW_APP_PORT": "eighty"})
    flags = tensorboard_flags("runs", 8100, extra=["--reload_interval", "30"])
    assert flags[:2] == ["--logdir", str(Path("runs").resolve())] and flags[2:6] == [
        "--host",
        "127.0.0.1",
        "--port",
        "8100",
    ]
    assert flags[-2:] == ["--reload_interval", "30"]
