"""Start training in child processes (python, or the deepspeed launcher for DeepSpeed or several GPUs), stream their
output, and return the run summary. The arguments reach the children as one JSON file, parsed once."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path

from textsql.arguments.training import DataArguments, ModelArguments, TextsqlTrainingArguments, arguments_dict
from textsql.errors import TextsqlError
from textsql.paths import ARGUMENTS_FILE, SUMMARY_FILE
from textsql.prepared import check_prepared
from textsql.run_summary import format_summary, read_summary
from textsql.strategy.devices import (
    NodeDevices,
    launcher_device_args,
    local_devices,
    ranks_per_node,
    threads_per_rank,
    use_accelerator,
)
from textsql.train.distributed import free_port
from textsql.train.run import TrainingInterrupted, interrupted_message, load_strategy, train

# DeepSpeed's own INFO lines ("[2026-11-24 19:31:16,466] [INFO] [runner.py:...] ..."), from its launcher and the ranks'
# start-up: kept for a failure's message, not echoed (the ranks' full log is each run's train.log).
LAUNCHER_CHATTER = re.compile(r"^(\[rank\d+\]:)?\[\d{4}-\d\d-\d\d [\d:,]+\] \[INFO\] ")
SUMMARY_MARKER = "textsql-run-summary: "
STARTED_BY_TEXTSQL = (
    "TEXTSQL_STARTED_RANKS"  # set for the processes run_training starts: they never start ranks themselves
)


def node_devices(accelerator: str = "auto"):
    """This pod's devices as a training with `--accelerator device` uses them: none with --accelerator cpu. Asked
    without initialising CUDA in this process, which lives as long as the training (textsql.strategy.devices.local_devices)."""

    return NodeDevices.local_cpu() if accelerator == "cpu" else local_devices()


def deepspeed_launcher() -> str:
    """The `deepspeed` launcher beside this Python (the virtual environment's), else on PATH."""
    launcher = shutil.which(
        "deepspeed", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    )
    if launcher is None:
        raise TextsqlError(
            "The `deepspeed` launcher is not on PATH. Install the project's requirements (bash scripts/bootstrap.sh setup)."
        )
    return launcher


def training_command(arguments_file: Path, ranks: int, devices, uses_deepspeed: bool) -> list[str]:
    """`deepspeed <devices> --module textsql.train FILE` for DeepSpeed or several ranks, else `python -m textsql.train FILE`.

    A user's CUDA_VISIBLE_DEVICES is kept (textsql.strategy.devices.launcher_device_args).
    """

    if not uses_deepspeed and ranks == 1:
        return [sys.executable, "-m", "textsql.train", str(arguments_file)]
    devices_args = launcher_device_args(ranks, devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    # A free port, not the launcher's fixed 29500: two trainings on one pod would otherwise collide.
    return [
        deepspeed_launcher(),
        "--master_port",
        str(free_port()),
        *devices_args,
        "--module",
        "textsql.train",
        str(arguments_file),
    ]


def child_environment(ranks: int, devices) -> dict[str, str]:
    """The training processes' environment: DeepSpeed's CPU accelerator without GPUs, and with several ranks each
    rank's share of the cores for OpenMP (ZeRO offload's CPU Adam uses them), unless OMP_NUM_THREADS is set. The
    libraries' FutureWarnings are left out unless PYTHONWARNINGS says otherwise: they tell the user nothing to do."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{STARTED_BY_TEXTSQL: str(ranks)})
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    if not devices.gpus:
        use_accelerator("cpu", env)
    if ranks > 1:
        env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(devices, ranks)))
    return env


class TrainingTimedOut(TextsqlError):
    """A training that did not finish within its time limit; every process it started has been stopped."""

    def __init__(self, limit_s: float, tail: list[str]):
        self.limit_s = limit_s
        last = "\n".join(tail[-6:])
        super().__init__(
            f"The training did not finish within its time limit of {limit_s:g} s and was stopped with every process "
            "it started (a hang, or a setting far slower than the others). Allow more time if it was only slow. "
            f"Last lines of its output:\n{last}"
        )


def run_training(
    model_args,
    data_args,
    training_args,
    num_gpus: int | None = None,
    *,
    echo=print,
    tail_lines: int = 40,
    timeout_s: float | None = None,
) -> dict:
    """Train in child processes (one rank per visible GPU unless `num_gpus` says otherwise), echo their output line by
    line, and return the run's summary (textsql.run_summary). The arguments are textsql.train's dataclasses (notebooks build them).
    `timeout_s`: a limit on the whole training; past it the children run in their own process group, which is killed
    (TERM, then KILL), and TrainingTimedOut is raised. Without a limit they stay in this terminal's group (Ctrl-C)."""
    check_prepared(data_args.dataset_dir)  # the user's input first, before any process starts
    # a strategy that cannot run here (a mistyped name, NVMe without a path or libaio) is refused before any rank starts
    load_strategy(training_args.deepspeed, training_args.fsdp_config, training_args.nvme_path)
    devices = node_devices(training_args.accelerator)
    ranks = ranks_per_node(num_gpus, devices)
    with tempfile.TemporaryDirectory(prefix="textsql-launch-") as folder:
        arguments_file = Path(folder) / ARGUMENTS_FILE
        arguments_file.write_text(json.dumps(arguments_dict(model_args, data_args, training_args), indent=2) + "\n")
        command = training_command(arguments_file, ranks, devices, uses_deepspeed=bool(training_args.deepspeed))
        echo("$ " + " ".join(command))
        tail: deque[str] = deque(maxlen=tail_lines)
        summary_path = None
        with subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_environment(ranks, devices),
            start_new_session=timeout_s is not None,
        ) as child:
            timer = threading.Timer(timeout_s, stop_group, (child,)) if timeout_s is not None else None
            if timer is not None:
                timer.daemon = True
                timer.start()
            try:
                for line in child.stdout:
                    line = line.rstrip("\n")
                    tail.append(line)
                    if not LAUNCHER_CHATTER.match(line):
                        echo(line)
                    if SUMMARY_MARKER in line:
                        summary_path = line.split(SUMMARY_MARKER, 1)[1].strip()
            except KeyboardInterrupt:
                stop_child(child)
                if timer is not None:
                    stop_group(child)
                raise TrainingInterrupted(interrupted_message(model_args, training_args, ranks)) from None
            finally:
                if timer is not None:
                    timer.cancel()
                    timer.join()  # a limit reached now: its group is stopped before this returns
    if getattr(child, "stopped_group", False) and not (child.returncode == 0 and summary_path):
        raise TrainingTimedOut(timeout_s, list(tail))
    if child.returncode != 0 or summary_path is None:
        raise TextsqlError(failure_message(child.returncode, list(tail)))
    return read_summary(summary_path)


def stop_child(child: subprocess.Popen, grace: float = 30) -> None:
    """Stop the training child after an interrupt: SIGINT (the deepspeed launcher passes it to its ranks; in a notebook
    only the kernel got it), then SIGKILL after `grace` seconds. A checkpoint being written may be cut short: resume
    skips an incomplete one."""
    if child.poll() is None:
        child.send_signal(signal.SIGINT)
        try:
            child.wait(grace)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def stop_group(child: subprocess.Popen, grace: float = 10) -> None:
    """End a child started in its own session and everything in its process group (the deepspeed launcher and its
    ranks): TERM, then KILL after `grace` seconds. Marks the child `stopped_group`."""
    child.stopped_group = True
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGTERM:
            try:
                child.wait(grace)
            except subprocess.TimeoutExpired:
                pass


def failure_message(status: int, tail: list[str]) -> str:
    """Why training failed, in as few lines as say it: the ranks' own one-paragraph error when there is one (the full
    output was shown as it came), else the last lines of the output."""
    own = [line.split("textsql train: ", 1)[1] for line in tail if "textsql train: " in line]
    if own:
        return own[-1]
    last = "\n".join(tail[-12:])
    return f"Training exited with status {status}. Last lines of its output:\n{last}"


def launches_ranks(training: TextsqlTrainingArguments, devices=None) -> int:
    """How many ranks `textsql train` itself must start on this pod: 0 under a launcher or for one rank (it trains in
    this process), else one per visible GPU (or --num_gpus)."""

    if "LOCAL_RANK" in os.environ or STARTED_BY_TEXTSQL in os.environ:
        return 0
    ranks = ranks_per_node(training.num_gpus, devices if devices is not None else node_devices(training.accelerator))
    return ranks if ranks > 1 else 0


def train_and_report(
    model_args: ModelArguments, data_args: DataArguments, training_args: TextsqlTrainingArguments
) -> int:
    """Train, then (rank 0) print the summary and the line that tells a launcher where run_summary.json is; 2 with one
    paragraph for a problem the user can fix."""
    try:
        summary = train(model_args, data_args, training_args)
    except TextsqlError as error:
        print(f"textsql train: {error}", file=sys.stderr)
        return 2
    if summary is not None:
        print(format_summary(summary))
        print(f"{SUMMARY_MARKER}{Path(summary.output_dir).resolve() / SUMMARY_FILE}", flush=True)
    return 0
