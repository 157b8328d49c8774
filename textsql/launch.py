"""Start training in a child process (python, or the deepspeed launcher), stream its output, and return its run summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import deque
from pathlib import Path

from textsql.errors import TextsqlError

SUMMARY_MARKER = "textsql-run-summary: "
STARTED_BY_TEXTSQL = "TEXTSQL_STARTED_RANKS"  # set for the processes run_training starts: they never start ranks themselves


def node_devices_for(argv: list[str]):
    """This pod's devices as a training with `argv` uses them: none with --device cpu."""
    from textsql.devices import NodeDevices, usable_cores
    from textsql.train import flag_value

    return NodeDevices((), usable_cores()) if flag_value(argv, "device") == "cpu" else NodeDevices.local()


def training_command(argv: list[str], num_gpus: int | None = None, use_deepspeed_launcher: bool | None = None, devices=None) -> list[str]:
    """`deepspeed <devices> --module textsql.train ...` for DeepSpeed or several ranks, else `python -m textsql.train ...`.

    `num_gpus` ranks (default: one per visible GPU, one on a CPU); a user's CUDA_VISIBLE_DEVICES is kept
    (textsql.devices.launcher_device_args). `devices` are this pod's (read from torch when not given).
    """
    from textsql.devices import launcher_device_args, ranks_per_node

    devices = devices if devices is not None else node_devices_for(argv)
    ranks = ranks_per_node(num_gpus, devices)
    uses_deepspeed = any(a == "--deepspeed" or a.startswith("--deepspeed=") for a in argv)
    if use_deepspeed_launcher is None:
        use_deepspeed_launcher = uses_deepspeed or ranks > 1
    if not use_deepspeed_launcher:
        return [sys.executable, "-m", "textsql.train", *argv]
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    if launcher is None:
        raise TextsqlError("The `deepspeed` launcher is not on PATH. Install the project's requirements (bash scripts/bootstrap.sh setup).")
    return [launcher, *launcher_device_args(ranks, devices, os.environ.get("CUDA_VISIBLE_DEVICES")), "--module", "textsql.train", *argv]


def child_environment(ranks: int, devices) -> dict[str, str]:
    """The training processes' environment: DeepSpeed's CPU accelerator without GPUs, and with several ranks each
    rank's share of the cores for OpenMP (ZeRO offload's CPU Adam uses them), unless OMP_NUM_THREADS is set."""
    from textsql.devices import threads_per_rank, use_accelerator

    env = dict(os.environ, PYTHONUNBUFFERED="1", **{STARTED_BY_TEXTSQL: str(ranks)})
    if not devices.gpus:
        use_accelerator("cpu", env)
    if ranks > 1:
        env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(devices, ranks)))
    return env


def run_training(argv: list[str], num_gpus: int | None = None, *, echo=print, tail_lines: int = 40) -> dict:
    """Run training in child processes (one rank per visible GPU unless `num_gpus` says otherwise), echo their output
    line by line, and return run_summary.json as a dict."""
    from textsql.devices import ranks_per_node

    devices = node_devices_for(argv)
    command = training_command(argv, num_gpus, devices=devices)
    echo("$ " + " ".join(command))
    tail: deque[str] = deque(maxlen=tail_lines)
    summary_path = None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=child_environment(ranks_per_node(num_gpus, devices), devices)) as child:
        for line in child.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            echo(line)
            if SUMMARY_MARKER in line:
                summary_path = line.split(SUMMARY_MARKER, 1)[1].strip()
    if child.returncode != 0 or summary_path is None:
        last = "\n".join(tail)
        raise TextsqlError(f"Training exited with status {child.returncode}. Last lines of its output:\n{last}")
    return json.loads(Path(summary_path).read_text())
