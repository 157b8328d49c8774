"""Two local pods (127.0.0.1 and 127.0.0.2, textsql.cluster's local backend): the start-up time of a two-pod launch
and how long each fault takes to end the launch (and to leave nothing running), for whichever textsql is first on
PYTHONPATH. Run it once per design on the same machine and compare the JSON side by side:

    PYTHONPATH=/path/to/old/checkout python bench/cluster_faults.py --output before.json
    PYTHONPATH=/path/to/new/checkout python bench/cluster_faults.py --output after.json

Faults (each on a fresh launch of plain DDP ranks of the tiny T5, struck once rank output says "Training starts"):
raise (rank 1 raises an exception), pod_killed (every process of pod 127.0.0.2 SIGKILLed), store_host_killed (the
process that hosts the trainers' store on pod 127.0.0.1 SIGKILLed: rank 0 in the old design, the pod's torchrun agent
in the new one), frozen (every process of pod 127.0.0.2 SIGSTOPped), rank_killed (rank 1's process alone SIGKILLed),
hung_rank (rank 1's process alone SIGSTOPped, its pod's torchrun left running), blocked (rank 1's main thread waits
forever, its other threads run on: issue 48; since issue 53 struck 10 s after "Training starts", past the first steps), frozen_at_start (pod 127.0.0.2 SIGSTOPped as soon as its process exists,
before its first heartbeat: issue 48), restart (`max_restarts=1`, rank 1's
process SIGKILLed once checkpoint-4 is saved: "trained" when torchrun's restart finishes the run). A fault not named
within CAP_S of the strike is stopped (Ctrl-C) and reported as such. Both designs use their default silence limits.
cli: `textsql cluster train --backend local` in a process of its own, no fault: seconds from its start to the first
pod started, and from rank 0's summary record to the command's exit. Each run records the 1-minute load.
pg_timeout, file_timer: what torch itself offers against a stopped rank, without textsql: two gloo ranks under
`torchrun --standalone` all-reducing in a loop, rank 1 SIGSTOPped; a process-group timeout of 30 s, or torch's
watchdog (TORCHELASTIC_ENABLE_FILE_TIMER, a 20 s timer around each step). Which rank raised or was killed, and when.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: the textsql measured is the one there

from bench.common import emit, machine  # noqa: E402

CAP_S = 150  # a fault not named by then is stopped and reported as not named

# Loaded by every Python process of a launch (on PYTHONPATH): SIGUSR1 makes a rank raise where it is, SIGUSR2 blocks
# its main thread for ever (its other threads run on).
SITECUSTOMIZE = """
import os, signal, threading
def _raise(signum, frame):
    raise RuntimeError("bench fault: this rank raised")
if os.environ.get("RANK") is not None:
    signal.signal(signal.SIGUSR1, _raise)
    signal.signal(signal.SIGUSR2, lambda signum, frame: threading.Event().wait())
"""


def descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def rank_process(rank: int):
    """The training process of `rank` among this process's descendants: the deepest one with RANK=<rank>."""
    import psutil

    found = []
    for process in descendants(os.getpid()):
        try:
            if process.environ().get("RANK") == str(rank):
                found.append(process)
        except psutil.Error:
            continue
    pids = {p.pid for p in found}
    leaves = [p for p in found if not any(c.pid in pids for c in descendants(p.pid))]
    return leaves[0] if leaves else None


def pod_root(cluster, address: str) -> int:
    return next(p.process.pid for p in cluster.pods if p.address == address)


def store_host(cluster) -> int:
    """Old design: rank 0's training process hosts MASTER_PORT's store. New: pod 0's torchrun agent (the pod's root)."""
    import textsql.cluster as package

    if hasattr(package, "Coordinator") or Path(package.__file__).with_name("coordinator.py").exists():
        return rank_process(0).pid
    return pod_root(cluster, "127.0.0.1")


def strike(kind: str, cluster) -> None:
    if kind in ("raise", "blocked"):
        os.kill(rank_process(1).pid, signal.SIGUSR1 if kind == "raise" else signal.SIGUSR2)
    elif kind in ("rank_killed", "hung_rank"):
        os.kill(rank_process(1).pid, signal.SIGKILL if kind == "rank_killed" else signal.SIGSTOP)
    elif kind == "store_host_killed":
        os.kill(store_host(cluster), signal.SIGKILL)
    else:
        root = pod_root(cluster, "127.0.0.2")
        sig = signal.SIGKILL if kind == "pod_killed" else signal.SIGSTOP
        for process in [*descendants(root)]:
            try:
                process.send_signal(sig)
            except Exception:
                pass
        os.kill(root, sig)


def leftovers(root: Path) -> list[int]:
    import psutil

    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and process.cwd().startswith(str(root)):
                if process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process.pid)
        except psutil.Error:
            continue
    return found


def train_argv(assets, runs: Path, kind: str | None) -> list[str]:
    data_dir, model_dir = assets
    argv = ["--model_id", str(model_dir), "--dataset_dir", str(data_dir), "--runs_root", str(runs)]
    steps = "4" if kind in (None, "cli") else "400" if kind == "restart" else "100000"
    argv += ["--max_steps", steps, "--per_device_train_batch_size", "8", "--logging_steps", "50"]
    argv += ["--eval_strategy", "no", "--dataloader_num_workers", "0", "--report_to", "none"]
    return argv + (
        ["--save_strategy", "steps", "--save_steps", "4"] if kind == "restart" else ["--save_strategy", "no"]
    )


def cli(assets, project: Path) -> dict:
    """The command's own start-up and exit: to the first pod started, and from rank 0's summary to its exit."""
    import subprocess

    command = [sys.executable, "-m", "textsql", "cluster", "train", "--backend", "local", "--workers", "1"]
    command += ["--cpu", "1", "--memory", "2", "--name", "cli", "--", *train_argv(assets, project / "runs-cli", "cli")]
    began, seen = time.monotonic(), {}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=project)
    for line in process.stdout:
        if "starting the session's pod" in line:
            seen.setdefault("first_pod", time.monotonic())
        if "Training starts" in line:
            seen.setdefault("training_starts", time.monotonic())
    process.wait()
    ended, exit_wall = time.monotonic(), time.time()
    summaries = list(project.glob(".textsql/cluster/cli/launches/*/ranks/*rank-0.summary.json"))
    result = {"fault": "cli", "outcome": "trained" if process.returncode == 0 else f"exit {process.returncode}"}
    if "first_pod" in seen:
        result["start_to_first_pod_s"] = round(seen["first_pod"] - began, 1)
    if summaries:  # the record's time on this machine's clock, against the command's end
        result["summary_to_exit_s"] = round(exit_wall - summaries[0].stat().st_mtime, 1)
    result["total_s"] = round(ended - began, 1)
    return result


HANG_WORKER = """
import datetime, os, sys, time
import torch, torch.distributed as dist
variant = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30 if variant == "pg_timeout" else 1800))
if variant == "file_timer":
    from torch.distributed.elastic import timer
    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    time.sleep(3)  # torch's watchdog opens its pipe in a thread of its own: a request before that fails (ENXIO)
print(f"ready {dist.get_rank()} {os.getpid()}", flush=True)
t = torch.ones(1000)
while True:
    try:
        if variant == "file_timer":
            with timer.expires(after=20, scope="step"):
                dist.all_reduce(t); time.sleep(0.05)
        else:
            dist.all_reduce(t); time.sleep(0.05)
    except Exception as e:
        print(f"raised {dist.get_rank()} {time.time()} {type(e).__name__}: {str(e)[:200]}", flush=True)
        sys.exit(1)
"""


def torch_hang_detector(variant: str, work: Path) -> dict:
    """Rank 1 of two plain torchrun ranks SIGSTOPped; what torch alone does about it within CAP_S."""
    import re
    import subprocess

    (work / "hang_worker.py").write_text(HANG_WORKER)
    env = dict(os.environ, LOGLEVEL="INFO", TORCHELASTIC_TIMER_FILE=str(work / f"timer-{variant}"))
    env.update(TORCHELASTIC_ENABLE_FILE_TIMER="1" if variant == "file_timer" else "0")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--monitor-interval", "0.5", str(work / "hang_worker.py"), variant]
    run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work)
    lines, pids = [], {}
    threading.Thread(target=lambda: [lines.append((time.time(), line)) for line in run.stdout], daemon=True).start()
    deadline = time.monotonic() + CAP_S
    while len(pids) < 2 and run.poll() is None and time.monotonic() < deadline:
        pids = {int(m[1]): int(m[2]) for _, line in lines if (m := re.match(r"ready (\d) (\d+)", line))}
        time.sleep(0.1)
    if len(pids) < 2:
        run.kill()
        return {"fault": variant, "outcome": "the ranks did not start", "tail": [line for _, line in lines[-5:]]}
    time.sleep(5)
    os.kill(pids[1], signal.SIGSTOP)
    struck = time.time()
    try:
        run.wait(timeout=CAP_S)
    except subprocess.TimeoutExpired:
        pass
    ended = time.time()
    for pid in (*pids.values(), run.pid):  # this run's own processes, by id
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    events = [
        f"{t - struck:.1f} s: {line.strip()[:160]}"
        for t, line in lines
        if t >= struck and re.search(r"raised|Reaping|Terminating|exitcode|SIGKILL|SIGTERM", line)
    ]
    return {"fault": variant, "load": os.getloadavg()[0], "ended_s": round(ended - struck, 1), "events": events[:8]}


def one(kind: str | None, assets, project: Path) -> dict:
    from textsql.cluster import Cluster

    if kind in ("pg_timeout", "file_timer"):
        return torch_hang_detector(kind, project)
    if kind == "cli":
        return dict(cli(assets, project), load=os.getloadavg()[0])
    argv = train_argv(assets, project / f"runs-{kind}", kind)
    seen: dict = {}
    holder: list = []

    def echo(line: str) -> None:
        if kind == "frozen_at_start" and "starting the session's pod" in line:
            threading.Thread(target=struck, args=(kind,)).start()
        if "Training starts" in line and "training_starts" not in seen:
            seen["training_starts"] = time.monotonic()
            if kind and kind != "frozen_at_start":
                # blocked: after some steps, the learned step limit's case (a first step has its own allowance)
                delay = 0.0 if kind == "restart" else 10.0 if kind == "blocked" else 1.0
                threading.Timer(delay, lambda: struck(kind)).start()
        elif "Training starts" in line and "struck" in seen:
            seen.setdefault("restarted", time.monotonic())

    def struck(kind: str) -> None:
        if kind == "restart":  # once checkpoint-4 is whole: the restart has a checkpoint to resume from
            deadline = time.monotonic() + 300
            while not list(project.glob(f"runs-{kind}/*/checkpoint-4/trainer_state.json")):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.1)
        while kind == "frozen_at_start" and not [p for p in holder[0].pods if p.address == "127.0.0.2"]:
            time.sleep(0.005)
        strike("rank_killed" if kind == "restart" else kind, holder[0])
        seen.setdefault("struck", time.monotonic())
        threading.Timer(CAP_S, lambda: "named" in seen or os.kill(os.getpid(), signal.SIGINT)).start()

    began = time.monotonic()
    restarts = 1 if kind == "restart" else 0
    cluster = Cluster("local", workers=1, cpu=1, memory=2, project_dir=project, echo=echo, max_restarts=restarts)
    holder.append(cluster)
    result = {"fault": kind or "none", "load": os.getloadavg()[0]}
    try:
        cluster.start()
        cluster.train(argv)
        result["outcome"] = "trained"
    except KeyboardInterrupt:
        result["outcome"] = f"not named within {CAP_S} s (stopped)"
    except BaseException as error:  # noqa: BLE001 - the fault's error is the measurement
        result["outcome"] = type(error).__name__
        result["message"] = str(error).splitlines()[0][:300] if str(error) else ""
    seen["named"] = True
    ended = time.monotonic()
    if "restarted" in seen:
        result["restart_to_training_s"] = round(seen["restarted"] - seen["struck"], 1)
    cluster.stop()
    while leftovers(project) and time.monotonic() - ended < 120:
        time.sleep(0.2)
    clean = time.monotonic()
    result["left_running"] = len(leftovers(project))
    for pid in leftovers(project):
        os.kill(pid, signal.SIGKILL)
    if "training_starts" in seen:
        result["start_to_training_s"] = round(seen["training_starts"] - began, 1)
    if "struck" in seen:
        result["detect_s"] = round(ended - seen["struck"], 1)
        result["all_stopped_s"] = round(clean - seen["struck"], 1)
    else:
        result["total_s"] = round(ended - began, 1)
    print(result, file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--faults",
        default="none,raise,pod_killed,store_host_killed,frozen,frozen_at_start,rank_killed,hung_rank,blocked,restart,cli",
    )
    parser.add_argument("--output")
    parser.add_argument("--work", help=argparse.SUPPRESS)  # set by the re-run inside the project folder
    args = parser.parse_args()
    if not args.work:  # the launch's working folder is the project: run again inside a fresh one
        import subprocess

        work = tempfile.mkdtemp(prefix="cluster-faults-")
        command = [sys.executable, str(Path(__file__).resolve()), "--faults", args.faults, "--work", work]
        sys.exit(
            subprocess.run(
                command + (["--output", str(Path(args.output).absolute())] if args.output else []), cwd=work
            ).returncode
        )
    import textsql
    from textsql.demo.tiny import build_assets

    work = Path(args.work)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # started in the background, SIGINT would be ignored
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work / "site"), os.environ.get("PYTHONPATH")]))
    os.environ.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    assets = build_assets(work / "assets", train_tables=60, questions_per_table=8, d_model=64, num_layers=2, seed=1)
    load_before = os.getloadavg()
    runs = [one(kind if kind != "none" else None, assets, work) for kind in args.faults.split(",")]
    emit(
        {
            "bench": "cluster_faults",
            "textsql": str(Path(textsql.__file__).parent),
            "machine": machine(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "runs": runs,
        },
        args.output,
    )


if __name__ == "__main__":
    main()
