"""Stand-in for CML's `cml.workers_v1`, for tests only: the same functions and signatures, but each "worker pod" is a
local process with its own loopback address.

As in CML, a worker runs `code` (Python source; here read from its standard input, never its command line, which any
user of the machine reads) or `script` (a .py file) with `env` added to its environment and
$CDSW_IP_ADDRESS set to its own address (here 127.0.0.2, 127.0.0.3, ...: $CML_STANDIN_FIRST_ADDRESS), plus
$CDSW_ENGINE_ID (its id) and $CDSW_MASTER_IP / $CDSW_MASTER_ID naming the session. `launch_workers` returns dicts
without an IP address; `list_workers` has each worker's `ip_address`. As in CML, the workers belong to the session,
not to one kernel: the registry lives in $CML_STANDIN_DIR, so a restarted kernel (another process) lists and stops
the workers of the one before. `calls` records this process's calls, for the tests to check.

Pod scheduling, for fault tests: $CML_STANDIN_SCHEDULE_DELAY seconds before a worker's code starts (status
"scheduling" until then), and $CML_STANDIN_UNSCHEDULABLE=1 for workers that never start.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

calls: list[tuple] = []
# The pod: wait to be "scheduled", run the worker's code, record how it ended; a stop reaches the code too.
_POD = r"""
import os, signal, subprocess, sys, time
delay, status, argv = float(sys.argv[1]), sys.argv[2], sys.argv[3:]
stopping = []
signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))
end = time.monotonic() + delay
while time.monotonic() < end and not stopping:
    time.sleep(0.1)
if stopping:
    sys.exit(143)
open(status + ".started", "w").close()
child = subprocess.Popen(argv, stdin=subprocess.PIPE)
child.stdin.write(sys.stdin.buffer.read())
child.stdin.close()
signal.signal(signal.SIGTERM, lambda *a: child.terminate())
code = child.wait()
open(status, "w").write(str(code))
sys.exit(code)
"""


def _dir() -> Path:
    folder = Path(os.environ.get("CML_STANDIN_DIR") or Path(tempfile.gettempdir()) / f"cml-standin-{os.getuid()}")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def _registry():
    with open(_dir() / "registry.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = _dir() / "registry.json"
        workers = json.loads(path.read_text()) if path.exists() else {}
        yield workers
        path.write_text(json.dumps(workers, indent=1))


def _alive(worker: dict) -> bool:
    try:
        os.kill(worker["pid"], 0)
    except (ProcessLookupError, TypeError, KeyError):
        return False
    try:
        with open(f"/proc/{worker['pid']}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0] != "Z" and int(fields[19]) == worker["starttime"]
    except (OSError, IndexError, ValueError):
        return False


def _starttime(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def _status(worker: dict) -> str:
    if worker.get("stopped"):
        return "stopped"
    if worker.get("pid") is None:
        return "scheduling"  # unschedulable: never starts
    status = Path(worker["status_file"])
    if _alive(worker):
        return "running" if Path(str(status) + ".started").exists() else "scheduling"
    if status.exists():
        return "succeeded" if status.read_text().strip() == "0" else "failed"
    return "failed"


def _public(worker: dict) -> dict:
    return {k: v for k, v in worker.items() if k in ("id", "name", "cpu", "memory", "nvidia_gpu", "ip_address")} | {
        "status": _status(worker)
    }


def _next_address(workers: dict) -> str:
    first = os.environ.get("CML_STANDIN_FIRST_ADDRESS", "127.0.0.2")
    prefix, last = first.rsplit(".", 1)
    used = {w["ip_address"] for w in workers.values() if _status(w) in ("scheduling", "running")}
    return next(f"{prefix}.{n}" for n in itertools.count(int(last)) if f"{prefix}.{n}" not in used)


def launch_workers(n, cpu, memory, nvidia_gpu=0, script="", code="", env=None, name=None):
    calls.append(("launch_workers", n, cpu, memory, nvidia_gpu, bool(code), bool(script), dict(env or {})))
    if bool(script) == bool(code):
        raise ValueError("exactly one of script and code must be given")
    if not (isinstance(n, int) and n >= 1) or cpu <= 0 or memory <= 0 or nvidia_gpu < 0:
        raise ValueError(f"bad worker resources: n={n} cpu={cpu} memory={memory} nvidia_gpu={nvidia_gpu}")
    launched = []
    with _registry() as workers:
        for _ in range(n):
            worker_id = f"standin-{len(workers) + 1:04d}-{os.getpid()}"
            address = _next_address(workers)
            worker = {
                "id": worker_id,
                "name": name,
                "cpu": cpu,
                "memory": memory,
                "nvidia_gpu": nvidia_gpu,
                "ip_address": address,
                "pid": None,
                "status_file": str(_dir() / f"{worker_id}.status"),
            }
            if os.environ.get("CML_STANDIN_UNSCHEDULABLE") != "1":
                environment = dict(
                    os.environ,
                    **(env or {}),
                    CDSW_IP_ADDRESS=address,
                    CDSW_ENGINE_ID=worker_id,
                    CDSW_MASTER_IP=os.environ.get("CDSW_IP_ADDRESS", "127.0.0.1"),
                    CDSW_MASTER_ID=os.environ.get("CDSW_ENGINE_ID", "session"),
                )
                argv = [sys.executable, "-"] if code else [sys.executable, script]
                delay = os.environ.get("CML_STANDIN_SCHEDULE_DELAY", "0")
                with open(_dir() / f"{worker_id}.log", "ab") as log:
                    process = subprocess.Popen(
                        [sys.executable, "-c", _POD, delay, worker["status_file"], *argv],
                        env=environment,
                        stdin=subprocess.PIPE,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                process.stdin.write((code or "").encode())  # far below a pipe's buffer: the pod reads it once started
                process.stdin.close()
                worker.update(pid=process.pid, starttime=_starttime(process.pid))
            workers[worker_id] = worker
            launched.append(
                {
                    "id": worker_id,
                    "name": name,
                    "status": "scheduling",
                    "cpu": cpu,
                    "memory": memory,
                    "nvidia_gpu": nvidia_gpu,
                }
            )
    return launched


def await_workers(ids, wait_for_completion=True, timeout_seconds=60):
    ids = [i["id"] if isinstance(i, dict) else i for i in ids]
    calls.append(("await_workers", list(ids), wait_for_completion, timeout_seconds))
    deadline = time.monotonic() + timeout_seconds
    waiting_for = ("scheduling", "running") if wait_for_completion else ("scheduling",)
    while True:
        with _registry() as workers:
            chosen = [workers[i] for i in ids]
        if not any(_status(w) in waiting_for for w in chosen) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    done = ("succeeded",) if wait_for_completion else ("running", "succeeded")
    public = [_public(w) for w in chosen]
    return {
        "workers": [w for w in public if w["status"] in done],
        "failures": [w for w in public if w["status"] not in done],
    }


def list_workers():
    calls.append(("list_workers",))
    with _registry() as workers:
        return [_public(w) for w in workers.values()]


def stop_workers(*worker_id):
    calls.append(("stop_workers", *worker_id))
    with _registry() as workers:
        chosen = [workers[i] for i in worker_id] if worker_id else list(workers.values())
        for worker in chosen:
            worker["stopped"] = True
    for worker in chosen:
        if _alive(worker):
            os.kill(worker["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 15
    for worker in chosen:
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(worker):
            os.killpg(worker["pid"], signal.SIGKILL)
    with _registry() as workers:
        return [_public(workers[w["id"]]) for w in chosen]
