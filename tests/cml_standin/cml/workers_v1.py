"""Stand-in for CML's `cml.workers_v1`, for tests only: the same functions and signatures, but each "worker pod" is a
local process with its own loopback address.

As in CML, a worker runs `code` (Python source) or `script` (a .py file) with `env` added to its environment and
$CDSW_IP_ADDRESS set to its own address (here 127.0.0.2, 127.0.0.3, ...: $CML_STANDIN_FIRST_ADDRESS), plus
$CDSW_MASTER_IP / $CDSW_MASTER_ID naming the session. `launch_workers` returns dicts without an IP address;
`list_workers` has each worker's `ip_address`. `calls` records every call, for the tests to check.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

_workers: dict[str, dict] = {}
_ids = itertools.count(1)
calls: list[tuple] = []


def _next_address() -> str:
    first = os.environ.get("CML_STANDIN_FIRST_ADDRESS", "127.0.0.2")
    prefix, last = first.rsplit(".", 1)
    used = {w["ip_address"] for w in _workers.values() if w["process"].poll() is None}
    return next(f"{prefix}.{n}" for n in itertools.count(int(last)) if f"{prefix}.{n}" not in used)


def _status(worker: dict) -> str:
    code = worker["process"].poll()
    if worker.get("stopped"):
        return "stopped"
    if code is None:
        return "running"
    return "succeeded" if code == 0 else "failed"


def _public(worker: dict) -> dict:
    return {k: v for k, v in worker.items() if k not in ("process", "stopped")} | {"status": _status(worker)}


def launch_workers(n, cpu, memory, nvidia_gpu=0, script="", code="", env=None, name=None):
    calls.append(("launch_workers", n, cpu, memory, nvidia_gpu, bool(code), bool(script), dict(env or {})))
    if bool(script) == bool(code):
        raise ValueError("exactly one of script and code must be given")
    if not (isinstance(n, int) and n >= 1) or cpu <= 0 or memory <= 0 or nvidia_gpu < 0:
        raise ValueError(f"bad worker resources: n={n} cpu={cpu} memory={memory} nvidia_gpu={nvidia_gpu}")
    launched = []
    for _ in range(n):
        worker_id = f"standin-{next(_ids):04d}"
        address = _next_address()
        environment = dict(os.environ, **(env or {}), CDSW_IP_ADDRESS=address, CDSW_ENGINE_ID=worker_id,
                           CDSW_MASTER_IP=os.environ.get("CDSW_IP_ADDRESS", "127.0.0.1"), CDSW_MASTER_ID=os.environ.get("CDSW_ENGINE_ID", "session"))
        argv = [sys.executable, "-c", code] if code else [sys.executable, script]
        log = open(os.path.join(os.environ.get("CML_STANDIN_LOG_DIR", "."), f"{worker_id}.log"), "ab")
        process = subprocess.Popen(argv, env=environment, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        _workers[worker_id] = {"id": worker_id, "name": name, "cpu": cpu, "memory": memory, "nvidia_gpu": nvidia_gpu, "ip_address": address,
                               "process": process}
        launched.append({"id": worker_id, "name": name, "status": "scheduling", "cpu": cpu, "memory": memory, "nvidia_gpu": nvidia_gpu})
    return launched


def await_workers(ids, wait_for_completion=True, timeout_seconds=60):
    ids = [i["id"] if isinstance(i, dict) else i for i in ids]
    calls.append(("await_workers", list(ids), wait_for_completion, timeout_seconds))
    workers = [_workers[i] for i in ids]
    deadline = time.monotonic() + timeout_seconds
    while wait_for_completion and any(_status(w) == "running" for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    failures = [_public(w) for w in workers if _status(w) in ("failed", "stopped") or (wait_for_completion and _status(w) == "running")]
    return {"workers": [_public(w) for w in workers if _public(w) not in failures], "failures": failures}


def list_workers():
    calls.append(("list_workers",))
    return [_public(w) for w in _workers.values()]


def stop_workers(*worker_id):
    calls.append(("stop_workers", *worker_id))
    chosen = [_workers[i] for i in worker_id] if worker_id else list(_workers.values())
    for worker in chosen:
        worker["stopped"] = True
        if worker["process"].poll() is None:
            worker["process"].terminate()
    for worker in chosen:
        try:
            worker["process"].wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker["process"].kill()
            worker["process"].wait()
    return [_public(w) for w in chosen]
