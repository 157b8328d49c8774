"""Worker nodes for multi-node training: one interface, two backends, and the Cluster that ties them to SSH.

- `CmlBackend`: worker pods through `cml.workers_v1` (launch_workers / await_workers / list_workers / stop_workers);
  the session is node 0.
- `LocalBackend`: workers are processes on this machine, each a real sshd on its own loopback address (127.0.0.2,
  127.0.0.3, ...); node 0 is 127.0.0.1. For tests, and for one multi-GPU box.

Every node (node 0 included) runs `python -m textsql.cluster.worker`, which starts sshd on port 2222 and publishes its
host key to the cluster folder in the shared project folder. `Cluster.start()` waits for those keys and writes
known_hosts, the ssh config and the hostfile from them; `Cluster.stop()` stops every worker, and runs on failure
and at exit too.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from textsql.cluster.hostfile import Host, write_hostfile
from textsql.cluster.ssh import (
    authorized_keys_line,
    ensure_project_key,
    host_key_line,
    write_ssh_config,
)
from textsql.cluster.worker import DEFAULT_PORT, default_sshd_config, published_path, stop_path
from textsql.errors import TextsqlError


@dataclass
class Worker:
    id: str
    address: str | None = None


@dataclass
class WorkerSpec:
    """What each worker pod gets (CML) and how many ranks it runs."""

    cpu: float = 4
    memory: float = 16
    nvidia_gpu: int = 1

    @property
    def slots(self) -> int:
        return max(1, self.nvidia_gpu)


def worker_argv(cluster_dir: Path, token: str, port: int, sshd_config: Path, address: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "textsql.cluster.worker", "--cluster-dir", str(cluster_dir), "--token", token,
            "--port", str(port), "--sshd-config", str(sshd_config)]
    return argv + (["--address", address] if address else [])


class LocalBackend:
    """Workers as local processes, each a real sshd on its own loopback address; node 0 is 127.0.0.1."""

    name = "local"

    def __init__(self, session_address: str = "127.0.0.1", first_worker_address: str = "127.0.0.2"):
        self.session = session_address
        self.first = first_worker_address
        self.processes: dict[str, subprocess.Popen] = {}

    def session_address(self) -> str:
        return self.session

    def launch(self, n: int, spec: WorkerSpec, argv: list[str], log_dir: Path) -> list[Worker]:
        prefix, last = self.first.rsplit(".", 1)
        workers = []
        for i in range(n):
            address = f"{prefix}.{int(last) + i}"
            self.processes[address] = start_process(argv + ["--address", address], log_dir / f"worker-{address}.log")
            workers.append(Worker(id=f"local-{address}", address=address))
        return workers

    def await_running(self, workers: list[Worker], timeout: float) -> list[Worker]:
        return workers  # a local process runs as soon as it is started; its published host key says when sshd is up

    def failed(self, worker: Worker) -> str | None:
        process = self.processes.get(worker.address)
        if process is not None and process.poll() is not None:
            return f"exited with status {process.returncode}"
        return None

    def stop(self, workers: list[Worker]) -> None:
        stop_processes([self.processes.pop(w.address) for w in workers if w.address in self.processes])


class CmlBackend:
    """Worker pods through CML's `cml.workers_v1`; the session itself is node 0 ($CDSW_IP_ADDRESS)."""

    name = "cml"

    def __init__(self, module=None):
        if module is None:
            try:
                import cml.workers_v1 as module
            except ImportError:
                raise TextsqlError("The CML backend needs `cml.workers_v1`, which exists only inside a CML session. "
                                   "Use backend='local' on any other machine.") from None
        self.cml = module

    def session_address(self) -> str:
        address = os.environ.get("CDSW_IP_ADDRESS")
        if not address:
            raise TextsqlError("CDSW_IP_ADDRESS is not set: the CML backend runs inside a CML session (its address is node 0).")
        return address

    def launch(self, n: int, spec: WorkerSpec, argv: list[str], log_dir: Path) -> list[Worker]:
        # The worker engine runs this code; the worker's own address comes from its $CDSW_IP_ADDRESS.
        code = f"import subprocess, sys\nsys.exit(subprocess.call({argv!r}))\n"
        launched = self.cml.launch_workers(n=n, cpu=spec.cpu, memory=spec.memory, nvidia_gpu=spec.nvidia_gpu, code=code, env={})
        return [Worker(id=w["id"]) for w in launched]

    def await_running(self, workers: list[Worker], timeout: float) -> list[Worker]:
        ids = [w.id for w in workers]
        result = self.cml.await_workers(ids, wait_for_completion=False, timeout_seconds=int(timeout))
        failures = result.get("failures") or []
        if failures:
            details = "; ".join(f"{f.get('id')}: {f.get('status', '?')} {f.get('message', '')}".strip() for f in failures)
            raise TextsqlError(f"{len(failures)} of {len(ids)} CML workers did not start: {details}")
        addresses = {w["id"]: w.get("ip_address") for w in self.cml.list_workers() if w.get("id") in ids}
        for worker in workers:
            worker.address = addresses.get(worker.id)
            if not worker.address:
                raise TextsqlError(f"CML lists no IP address for worker {worker.id}; is it still running?")
        return workers

    def failed(self, worker: Worker) -> str | None:
        for listed in self.cml.list_workers():
            if listed.get("id") == worker.id and listed.get("status") in ("failed", "stopped", "succeeded", "timedout"):
                return f"status {listed.get('status')}"
        return None

    def stop(self, workers: list[Worker]) -> None:
        if workers:
            self.cml.stop_workers(*[w.id for w in workers])


def start_process(argv: list[str], log: Path) -> subprocess.Popen:
    """A background process with its output in `log`, in its own session (a notebook interrupt does not reach it)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_processes(processes: list[subprocess.Popen], timeout: float = 15) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def make_backend(backend) -> LocalBackend | CmlBackend:
    if backend == "local":
        return LocalBackend()
    if backend == "cml":
        return CmlBackend()
    if isinstance(backend, str):
        raise TextsqlError(f"backend must be 'cml' or 'local', not '{backend}'.")
    return backend


@dataclass
class Cluster:
    """Node 0 (this session) plus `workers` worker nodes, reachable over SSH with host keys checked.

        with Cluster("cml", workers=2, nvidia_gpu=1) as cluster:   # or Cluster("local", workers=1)
            print(cluster.hostfile.read_text())
            cluster.preflight(train_argv)
            result = cluster.train(train_argv)
    """

    backend: object = "local"
    workers: int = 1
    cpu: float = 4
    memory: float = 16
    nvidia_gpu: int = 1
    session_slots: int | None = None
    project_dir: Path = Path(".")
    name: str = "default"
    ssh_port: int = DEFAULT_PORT
    sshd_config: Path | None = None
    start_timeout: float = 600
    echo: object = print
    nodes: list[Worker] = field(default_factory=list, init=False)

    def __post_init__(self):
        if self.workers < 0:
            raise TextsqlError(f"workers must be 0 or more, not {self.workers}.")
        self.backend = make_backend(self.backend)
        self.project_dir = Path(self.project_dir).absolute()
        self.dir = self.project_dir / ".textsql" / "cluster" / self.name
        self.key_dir = self.project_dir / ".textsql" / "ssh"
        self.sshd_config = Path(self.sshd_config or default_sshd_config()).absolute()
        self.spec = WorkerSpec(self.cpu, self.memory, self.nvidia_gpu)
        self.token = secrets.token_hex(8)
        self.session_process: subprocess.Popen | None = None
        self.started = False
        self.report = None

    # -- files the launch reads -------------------------------------------------------------------------------------
    @property
    def hostfile(self) -> Path:
        return self.dir / "hostfile"

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def hosts(self) -> list[Host]:
        return [Host(self.session, self.session_slots)] + [Host(w.address, self.spec.slots) for w in self.nodes]

    # -- life cycle ---------------------------------------------------------------------------------------------------
    def start(self) -> "Cluster":
        if self.started:
            return self
        if not self.sshd_config.is_file():
            raise TextsqlError(f"The sshd configuration {self.sshd_config} does not exist (docker/sshd_config in the repository, "
                               "or set TEXTSQL_SSHD_CONFIG / sshd_config=).")
        self.session = self.backend.session_address()
        if not self.session_slots:
            import torch

            self.session_slots = torch.cuda.device_count() or 1  # this session's GPUs (one rank on a CPU-only machine)
        self.dir.mkdir(parents=True, exist_ok=True)
        key = ensure_project_key(self.key_dir)
        authorized = self.dir / "authorized_keys"
        authorized.write_text(authorized_keys_line(key, allowed_from=self.session))
        os.chmod(authorized, 0o600)
        for old in list((self.dir / "hostkeys").glob("*.json")) + list(self.dir.glob("stop-*")):
            old.unlink()  # keys of earlier workers are never trusted again
        self.started = True
        atexit.register(self.stop)
        try:
            argv = worker_argv(self.dir, self.token, self.ssh_port, self.sshd_config)
            self.echo(f"starting sshd on node 0 ({self.session}:{self.ssh_port}) and {self.workers} {self.backend.name} worker(s)")
            self.session_process = start_process(argv + ["--address", self.session], self.dir / "logs" / f"worker-{self.session}.log")
            if self.workers:
                self.nodes = self.backend.launch(self.workers, self.spec, argv, self.dir / "logs")
                self.backend.await_running(self.nodes, self.start_timeout)
            published = self._await_published()
            self.known_hosts.write_text("".join(host_key_line(r["address"], r["port"], r["host_key"]) for r in published))
            addresses = [h.address for h in self.hosts]
            write_ssh_config(self.ssh_config, hosts=addresses, port=self.ssh_port, key=key, known_hosts=self.known_hosts)
            write_hostfile(self.hostfile, self.hosts)
        except BaseException:
            self.stop()
            raise
        self.echo(f"cluster ready: {len(self.hosts)} nodes, hostfile {self.hostfile}")
        return self

    def _await_published(self) -> list[dict]:
        """Wait until every node published its host key with this cluster's token; fail fast on a dead worker."""
        wanted = [self.session] + [w.address for w in self.nodes]
        deadline = time.monotonic() + self.start_timeout
        while True:
            records, missing = [], []
            for address in wanted:
                try:
                    record = json.loads(published_path(self.dir, address).read_text())
                except (OSError, ValueError):
                    record = None
                if record and record.get("token") == self.token and record.get("address") == address:
                    records.append(record)
                else:
                    missing.append(address)
            if not missing:
                return records
            dead = [f"{w.address} ({why})" for w in self.nodes if (why := self.backend.failed(w))]
            if self.session_process.poll() is not None:
                dead.append(f"{self.session} (node 0, exited with status {self.session_process.returncode})")
            if dead or time.monotonic() > deadline:
                what = f"ended before its sshd was up: {', '.join(dead)}" if dead else f"published no host key within {self.start_timeout:.0f} s: {', '.join(missing)}"
                logs = self._log_tails([d.split()[0] for d in dead] if dead else missing)
                raise TextsqlError(f"Cluster start failed: node(s) {what}. Their logs: {self.dir / 'logs'} (local) or the CML worker logs.\n{logs}")
            time.sleep(1)

    def _log_tails(self, addresses: list[str]) -> str:
        tails = []
        for address in addresses:
            log = self.dir / "logs" / f"worker-{address}.log"
            if log.exists():
                lines = log.read_text(errors="replace").splitlines()[-8:]
                tails.append(f"--- {log}:\n" + "\n".join(lines))
        return "\n".join(tails)

    def stop(self) -> None:
        """Stop every worker and node 0's sshd. Safe to call twice, and called at exit and on any failure."""
        if not self.started:
            return
        self.started = False
        atexit.unregister(self.stop)
        try:
            stop_path(self.dir, self.token).touch()  # workers see it within seconds, wherever they run
        except OSError:
            pass
        try:
            self.backend.stop(self.nodes)
        finally:
            if self.session_process is not None:
                stop_processes([self.session_process])
            self.echo(f"stopped {len(self.nodes)} worker(s) and node 0's sshd")

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- training -------------------------------------------------------------------------------------------------------
    def preflight(self, train_argv: list[str], **kwargs):
        """Check every node for this training (see textsql.cluster.launch.preflight); train() reuses the report."""
        from textsql.cluster.launch import preflight

        try:
            self.report = (list(train_argv), preflight(self.hosts, self.ssh_config, train_argv, echo=self.echo, **kwargs))
        except BaseException:
            self.stop()
            raise
        return self.report[1]

    def train(self, train_argv: list[str], stop_on_failure: bool = True, **kwargs):
        """The multi-node launch (after a preflight, unless preflight() just ran for the same arguments); on any
        failure every worker is stopped, since idle workers still hold their GPUs."""
        from textsql.cluster.launch import launch_training

        report = self.report[1] if self.report and self.report[0] == list(train_argv) else None
        try:
            return launch_training(self.hosts, self.ssh_config, train_argv, hostfile=self.hostfile, ssh_port=self.ssh_port,
                                   launch_root=self.dir / "launches", echo=self.echo, report=report, **kwargs)
        except BaseException:
            if stop_on_failure:
                self.stop()
            raise

    def describe(self) -> str:
        lines = [f"{'node':<6}{'address':<18}{'slots':<7}worker"]
        lines.append(f"{0:<6}{self.session:<18}{self.session_slots:<7}this session")
        for i, worker in enumerate(self.nodes, 1):
            lines.append(f"{i:<6}{worker.address:<18}{self.spec.slots:<7}{self.backend.name} {worker.id}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Cluster({self.backend.name}, nodes={[h.line() for h in self.hosts] if self.started else 'not started'})"
