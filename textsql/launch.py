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


def training_command(argv: list[str], num_gpus: int = 1, use_deepspeed_launcher: bool | None = None) -> list[str]:
    """`deepspeed --num_gpus N --module textsql.train ...` for DeepSpeed or several processes, else `python -m textsql.train ...`."""
    if num_gpus < 1:
        raise TextsqlError(f"num_gpus must be at least 1, not {num_gpus}.")
    uses_deepspeed = any(a == "--deepspeed" or a.startswith("--deepspeed=") for a in argv)
    if use_deepspeed_launcher is None:
        use_deepspeed_launcher = uses_deepspeed or num_gpus > 1
    if not use_deepspeed_launcher:
        return [sys.executable, "-m", "textsql.train", *argv]
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    if launcher is None:
        raise TextsqlError("The `deepspeed` launcher is not on PATH. Install the project's requirements (bash scripts/bootstrap.sh setup).")
    return [launcher, "--num_gpus", str(num_gpus), "--module", "textsql.train", *argv]


def child_environment(num_processes: int) -> dict[str, str]:
    """On a CPU-only machine: DeepSpeed's CPU accelerator, and one thread per rank when there are several."""
    import torch

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
        if num_processes > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_training(argv: list[str], num_gpus: int = 1, *, echo=print, tail_lines: int = 40) -> dict:
    """Run training in a child process, echo its output line by line, and return run_summary.json as a dict."""
    command = training_command(argv, num_gpus)
    echo("$ " + " ".join(command))
    tail: deque[str] = deque(maxlen=tail_lines)
    summary_path = None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_environment(num_gpus)) as child:
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
