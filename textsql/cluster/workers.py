"""Worker nodes — CML worker pods or local processes — and the Cluster: node 0 (this session) plus its workers, each
running a node agent that connects back to this session. No ssh, no keys: see textsql.cluster."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from textsql.cluster.channel import SILENCE_ENV, SILENCE_SECONDS
from textsql.cluster.interrupts import interrupts_deferred
from textsql.errors import TextsqlError
from textsql.sharedfiles import open_unlinked, read_unlinked, replace_file

AGENT_CODE = "import sys\nfrom textsql.cluster.node import main\nsys.exit(main(['agent']))\n"
AGENT_MODULE = "textsql.cluster.node"
_STARTED: dict[str, Cluster] = {}  # this process's started clusters, by folder


@dataclass
class Worker:
    """A worker node: its id (CML worker id, or local-<address>), address once known, and a local process's pid."""

    id: str
    address: str | None = None
    pid: int | None = None
    created: float | None = None


@dataclass
class WorkerSpec:
    """What each worker pod gets (CML) and how many ranks it runs (one per GPU; one on a CPU-only worker)."""

    cpu: float = 4
    memory: float = 16
    nvidia_gpu: int = 1

    @property
    def ranks(self) -> int:
        return max(1, self.nvidia_gpu)


def start_agent(
    env: dict[str, str], log: Path, *, cpus: list[int] | None = None, prefix: list[str] | None = None
) -> subprocess.Popen:
    """A node agent as a local process in its own session (a notebook interrupt does not reach it), output in `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = [*(prefix or []), sys.executable, "-m", AGENT_MODULE, "agent"]
    with open_unlinked(log, "a", binary=True) as out:
        return subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )


def stop_processes(processes: list[subprocess.Popen], timeout: float = 20) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)  # a frozen (stopped) agent handles its SIGTERM only once it runs
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def stop_launch_groups(groups: list[tuple[int, str]], timeout: float = 15) -> list[int]:
    """Wait until the process groups of these launchers on this machine ((guard pid = group id, launch id), see
    textsql.cluster.node.guard) are gone, and end what is left after `timeout` seconds: SIGKILL, only for a group that
    still holds a process of that launch (never a recycled id). Their agents stop them, or their guards when an agent
    was killed; this makes sure of it before the session says that everything stopped. Returns the groups killed."""
    from textsql.cluster.node import group_members

    deadline = time.monotonic() + timeout
    waiting = [(pgid, launch) for pgid, launch in groups if group_members(pgid)]
    while waiting and time.monotonic() < deadline:
        time.sleep(0.1)
        waiting = [(pgid, launch) for pgid, launch in waiting if group_members(pgid)]
    killed = []
    for pgid, launch in waiting:
        if any(f"--textsql_launch={launch}".encode() in _cmdline(pid) for pid in group_members(pgid)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
                killed.append(pgid)
    deadline = time.monotonic() + 5
    while any(group_members(pgid) for pgid in killed) and time.monotonic() < deadline:
        time.sleep(0.1)
    return killed


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def stop_stale_processes(records: list[dict]) -> list[str]:
    """Stop the agent processes an earlier start left. The records come from the shared folder, so a process is
    signalled only when it is surely that agent: this user's, the leader of its own process group, the same start
    time and command, and the record's worker id in its environment (never a recycled pid, never another's process)."""
    import psutil

    from textsql.cluster.node import WORKER_ENV

    stopped = []
    for record in records:
        try:
            process = psutil.Process(record["pid"])
            if (
                process.uids().real != os.getuid()
                or os.getpgid(process.pid) != process.pid
                or abs(process.create_time() - record["created"]) > 1
                or AGENT_MODULE not in " ".join(process.cmdline())
                or process.environ().get(WORKER_ENV) != record["id"]
            ):
                continue
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except psutil.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
            stopped.append(record["id"])
        except (psutil.Error, OSError, KeyError, TypeError):
            continue
    return stopped


def read_state(path: Path) -> dict:
    """A cluster's workers.json as textsql wrote it ({"backend", "start", "workers": [{"id", "pid", "created"}]}); none
    yet: no workers. Anything else is refused, naming the file: it is in the shared folder, anyone's to write."""
    try:
        state = json.loads(read_unlinked(path))
    except FileNotFoundError:
        return {"backend": None, "start": None, "workers": []}
    except (OSError, ValueError) as error:
        problem = str(error)
    else:
        problem = _state_problem(state)
    if problem:
        raise TextsqlError(
            f"{path} is not a cluster state textsql wrote: {problem}. It lists the node agents of the last start, so that the "
            "next start stops any left running. Remove it (check first that no agent of an earlier start still runs: "
            f"`pgrep -af {AGENT_MODULE}`) and start again; if you did not change it, someone with access to the project did."
        )
    return state


def _state_problem(state) -> str | None:
    if not isinstance(state, dict) or not isinstance(state.get("workers"), list):
        return "not an object with a list of workers"
    if not all(isinstance(state.get(key), (str, type(None))) for key in ("backend", "start")):
        return "backend and start must be names"
    for record in state["workers"]:
        if not isinstance(record, dict) or not isinstance(record.get("id"), str) or not record["id"]:
            return f"a worker without an id ({json.dumps(record)[:80]})"
        pid, created = record.get("pid"), record.get("created")
        if not (pid is None or (isinstance(pid, int) and not isinstance(pid, bool) and pid > 0)):
            return f"worker {record['id'][:60]}: pid {json.dumps(pid)[:40]} is not a process id"
        if not (created is None or (isinstance(created, (int, float)) and not isinstance(created, bool))):
            return f"worker {record['id'][:60]}: created {json.dumps(created)[:40]} is not a time"
    return None


def _created(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


class LocalBackend:
    """Workers as local processes on loopback addresses 127.0.0.2, 127.0.0.3, ...; node 0 is 127.0.0.1. On a machine
    with GPUs each node gets its own (CUDA_VISIBLE_DEVICES), and each node its share of the cores."""

    name = "local"

    def __init__(self, session_address: str = "127.0.0.1", first_worker_address: str = "127.0.0.2"):
        self.session = session_address
        self.first = first_worker_address
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.command_prefix: list[str] = []

    def session_address(self) -> str:
        return self.session

    def placements(self, ranks_per_node: list[int]) -> list[dict]:
        """Per node (node 0 first): the environment and cores that give it its own GPUs and its share of the CPU."""
        from textsql.strategy.devices import local_devices, split_local_cores, split_local_gpus

        devices = local_devices()
        gpus = split_local_gpus(ranks_per_node, devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
        cores = split_local_cores(sorted(os.sched_getaffinity(0)), len(ranks_per_node))
        return [{"env": {"CUDA_VISIBLE_DEVICES": g} if g is not None else {}, "cpus": c} for g, c in zip(gpus, cores)]

    def launch(
        self, n: int, spec: WorkerSpec, env: dict[str, str], log_dir: Path, placements: list[dict]
    ) -> list[Worker]:
        from textsql.cluster.node import NODE_ENV, WORKER_ENV

        prefix, last = self.first.rsplit(".", 1)
        workers = []
        for i in range(n):
            address = f"{prefix}.{int(last) + i}"
            worker = Worker(id=f"local-{address}", address=address)
            self.logs[worker.id] = log_dir / f"worker-{address}.log"
            node_env = _without_secrets(os.environ)  # what a pod would inherit from the project, less secrets
            node_env.update(env)
            node_env.update(placements[i]["env"])
            node_env.update({NODE_ENV: address, WORKER_ENV: worker.id})
            process = start_agent(
                node_env, self.logs[worker.id], cpus=placements[i]["cpus"], prefix=self.command_prefix
            )
            self.processes[worker.id] = process
            worker.pid, worker.created = process.pid, _created(process.pid)
            workers.append(worker)
        return workers

    def await_running(self, workers: list[Worker], timeout: float) -> None:
        """A local process runs as soon as it is started."""

    def failed(self, worker: Worker) -> str | None:
        process = self.processes.get(worker.id)
        if process is not None and process.poll() is not None:
            return f"exited with status {process.returncode}"
        return None

    def log_tail(self, worker: Worker, lines: int = 8) -> str:
        log = self.logs.get(worker.id)
        if log is None or not log.exists():
            return ""
        return f"--- {log}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, workers: list[Worker]) -> None:
        stop_processes([self.processes.pop(w.id) for w in workers if w.id in self.processes])

    def stop_stale(self, records: list[dict]) -> list[str]:
        return stop_stale_processes(records)


class CmlBackend:
    """Worker pods through CML's `cml.workers_v1`; the session itself is node 0 ($CDSW_IP_ADDRESS). Each pod runs the
    node agent (`launch_workers(code=...)`); what it must know, the token included, is in `env`, never in a file."""

    name = "cml"

    def __init__(self, module=None):
        if module is None:
            try:
                import cml.workers_v1 as module
            except ImportError:
                raise TextsqlError(
                    "The CML backend needs `cml.workers_v1`, which exists only inside a CML session. "
                    "Use backend='local' on any other machine."
                ) from None
        self.cml = module

    def session_address(self) -> str:
        address = os.environ.get("CDSW_IP_ADDRESS")
        if not address:
            raise TextsqlError(
                "CDSW_IP_ADDRESS is not set: the CML backend runs inside a CML session (its address is node 0)."
            )
        return address

    def placements(self, ranks_per_node: list[int]) -> list[dict]:
        return [{"env": {}, "cpus": None} for _ in ranks_per_node]  # each pod has its own devices

    def launch(
        self, n: int, spec: WorkerSpec, env: dict[str, str], log_dir: Path, placements: list[dict]
    ) -> list[Worker]:
        launched = self.cml.launch_workers(
            n=n, cpu=spec.cpu, memory=spec.memory, nvidia_gpu=spec.nvidia_gpu, code=AGENT_CODE, env=env
        )
        return [Worker(id=w["id"]) for w in launched]

    def await_running(self, workers: list[Worker], timeout: float) -> None:
        result = self.cml.await_workers(
            [w.id for w in workers], wait_for_completion=False, timeout_seconds=int(timeout)
        )
        failures = result.get("failures") or []
        if failures:
            details = "; ".join(
                f"{f.get('id')}: {f.get('status', '?')} {f.get('message', '') or ''}".strip() for f in failures
            )
            raise TextsqlError(
                f"{len(failures)} of {len(workers)} CML worker(s) did not start within {timeout:.0f} s: {details}. "
                "Check the workers' resources (cpu, memory, nvidia_gpu) against what the cluster has free."
            )

    def addresses(self) -> dict[str, str]:
        return {w.get("id"): w.get("ip_address") for w in self.cml.list_workers()}

    def failed(self, worker: Worker) -> str | None:
        for listed in self.cml.list_workers():
            if listed.get("id") == worker.id and listed.get("status") in ("failed", "stopped", "succeeded", "timedout"):
                return f"status {listed.get('status')}"
        return None

    def log_tail(self, worker: Worker, lines: int = 8) -> str:
        return f"--- {worker.id}: see its log in CML (the session's Workers tab)"

    def stop(self, workers: list[Worker]) -> None:
        if workers:
            self.cml.stop_workers(*[w.id for w in workers])

    def stop_stale(self, records: list[dict]) -> list[str]:
        ids = {r["id"] for r in records}
        running = [
            w["id"]
            for w in self.cml.list_workers()
            if w.get("id") in ids and w.get("status") in ("scheduling", "running")
        ]
        if running:
            self.cml.stop_workers(*running)
        return running


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
    """Node 0 (this session) plus `workers` worker nodes, each running a node agent connected to this session.

    with Cluster("cml", workers=2, nvidia_gpu=1) as cluster:   # or Cluster("local", workers=1)
        print(cluster.describe())
        cluster.preflight(model_args, data_args, training_args)   # or one command line: cluster.train(argv)
        result = cluster.train(model_args, data_args, training_args)
    """

    backend: object = "local"
    workers: int = 1
    cpu: float = 4
    memory: float = 16
    nvidia_gpu: int = 1
    session_slots: int | None = None
    project_dir: Path = Path(".")
    name: str = "default"
    start_timeout: float = 600
    echo: object = print
    silence_seconds: float = SILENCE_SECONDS  # a node not heard from for this long is lost (frozen or cut off)
    nodes: list[Worker] = field(default_factory=list, init=False)

    def __post_init__(self):
        if self.workers < 0:
            raise TextsqlError(f"workers must be 0 or more, not {self.workers}.")
        self.backend = make_backend(self.backend)
        self.project_dir = Path(self.project_dir).absolute()
        self.dir = self.project_dir / ".textsql" / "cluster" / self.name
        self.spec = WorkerSpec(self.cpu, self.memory, self.nvidia_gpu)
        self.started = False
        self.links: list = []
        self.coordinator = None
        self.node0 = None
        self.lock = None

    @property
    def state_file(self) -> Path:
        return self.dir / "workers.json"

    # -- life cycle ---------------------------------------------------------------------------------------------------
    def start(self) -> Cluster:
        from textsql.cluster.coordinator import Coordinator
        from textsql.cluster.environment import forwarded
        from textsql.cluster.node import ADDRESS_ENV, NODE_ENV, TOKEN_ENV, WORKER_ENV
        from textsql.cluster.runs import FileLock

        if self.started:
            return self
        earlier = _STARTED.get(str(self.dir))
        if earlier is not None and earlier is not self:
            self.echo(f"stopping the earlier cluster '{self.name}' of this kernel (its cell ran again)")
            earlier.stop()
        self.session = self.backend.session_address()
        self.lock = FileLock(
            self.dir / "cluster.lock",
            f"Cluster '{self.name}' of {self.project_dir}",
            "Stop it there (cluster.stop(), or end that session), or give this one another name (Cluster(name=...)).",
            {},
        )
        self.started = True
        _STARTED[str(self.dir)] = self
        atexit.register(self.stop)
        try:
            self._stop_stale()
            self.start_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
            token = secrets.token_hex(32)
            self.coordinator = Coordinator(self.session, token, self.echo, silence_seconds=self.silence_seconds)
            env = dict(
                forwarded(os.environ),
                **{
                    ADDRESS_ENV: f"{self.session}:{self.coordinator.port}",
                    TOKEN_ENV: token,
                    SILENCE_ENV: str(self.silence_seconds),
                },
            )
            ranks = [self.session_slots or 1] + [self.spec.ranks] * self.workers
            placements = self.backend.placements(ranks)
            logs = self.dir / "logs"
            self.echo(f"starting node 0's agent ({self.session}) and {self.workers} {self.backend.name} worker(s)")
            node0_id = f"node0-{self.start_id}"
            node0_env = _without_secrets(os.environ)  # a local child: the session's environment, less its secrets
            node0_env.update(env)
            node0_env.update(placements[0]["env"])
            node0_env.update({NODE_ENV: self.session, WORKER_ENV: node0_id})
            with interrupts_deferred(
                self.echo, "starting the agents"
            ):  # what is started is recorded, so that it can be stopped
                self.node0 = Worker(id=node0_id, address=self.session)
                self._node0_process = start_agent(
                    node0_env, logs / f"node0-{self.session}.log", cpus=placements[0]["cpus"]
                )
                self.node0.pid, self.node0.created = self._node0_process.pid, _created(self._node0_process.pid)
                self._save_state()
                if self.workers:
                    self.nodes = self.backend.launch(self.workers, self.spec, env, logs, placements[1:])
                    self._save_state()
            if self.workers:
                self.echo(f"waiting for {self.workers} worker(s) to start (up to {self.start_timeout:.0f} s)")
                self.backend.await_running(self.nodes, self.start_timeout)
            self.links = self._await_agents()
        except BaseException:
            self.stop()
            raise
        self.echo(f"cluster ready: {len(self.links)} nodes\n{self.describe()}")
        return self

    def _await_agents(self) -> list:
        """Every node's agent connected and proved the token; node 0 first, then the workers in launch order."""
        expected = [self.node0] + self.nodes

        def check():
            dead = []
            if self._node0_process.poll() is not None:
                dead.append(f"node 0's agent ({self.session}): exited with status {self._node0_process.returncode}")
            dead += [
                f"{w.id}" + (f" ({w.address})" if w.address else "") + f": {why}"
                for w in self.nodes
                if (why := self.backend.failed(w))
            ]
            if dead:
                tails = "\n".join(filter(None, [self._node0_tail()] + [self.backend.log_tail(w) for w in self.nodes]))
                raise TextsqlError(
                    f"Cluster start failed: node(s) ended before their agent connected: {'; '.join(dead)}.\n{tails}"
                )

        try:
            self.coordinator.wait_for(len(expected), self.start_timeout, check)
        except TimeoutError:
            joined = {link.worker_id for link in self.coordinator.links} | {
                link.address for link in self.coordinator.links
            }
            missing = [w for w in expected if w.id not in joined and w.address not in joined]
            tails = "\n".join(filter(None, [self.backend.log_tail(w) for w in missing if w is not self.node0]))
            raise TextsqlError(
                f"Cluster start failed: {', '.join(w.id for w in missing)} did not connect to the session at {self.session}:{self.coordinator.port} "
                f"within {self.start_timeout:.0f} s (started but published nothing: it cannot reach the session, or it started too late).\n{tails}"
            ) from None
        by_id = {link.worker_id: link for link in self.coordinator.links}
        addresses = self.backend.addresses() if hasattr(self.backend, "addresses") else {}
        by_address = {link.address: link for link in self.coordinator.links}
        ordered = []
        for worker in expected:
            link = by_id.get(worker.id) or by_address.get(worker.address or addresses.get(worker.id))
            if link is None:
                raise TextsqlError(
                    f"Cluster start failed: no agent answered for {worker.id}; the connected agents are "
                    f"{', '.join(f'{link.worker_id} ({link.address})' for link in self.coordinator.links)}."
                )
            worker.address = link.address
            ordered.append(link)
        return ordered

    def _node0_tail(self) -> str:
        log = self.dir / "logs" / f"node0-{self.session}.log"
        return f"--- {log}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-8:]) if log.exists() else ""

    def _save_state(self) -> None:
        """Which agents this start runs, so that a later start (after a kernel restart) can stop any left over."""
        records = [{"id": w.id, "pid": w.pid, "created": w.created} for w in [self.node0] + self.nodes if w is not None]
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        replace_file(
            self.state_file,
            json.dumps(
                {"backend": self.backend.name, "start": getattr(self, "start_id", None), "workers": records}, indent=2
            ),
        )

    def _stop_stale(self) -> None:
        state = read_state(self.state_file)
        records = state["workers"]
        if not records:
            return
        stopped = stop_stale_processes([r for r in records if r.get("pid")])
        if state.get("backend") == self.backend.name and hasattr(self.backend, "stop_stale"):
            stopped += [
                i for i in self.backend.stop_stale([r for r in records if not r.get("pid")]) if i not in stopped
            ]
        if stopped:
            self.echo(
                f"stopped {len(stopped)} stale worker(s) of an earlier start ({state.get('start')}): {', '.join(stopped)}"
            )
        self._clear_state()

    def stop(self) -> None:
        """Stop every worker and node 0's agent (each stops its launch first). Safe to call twice, called at exit and
        on any failure; a second Ctrl-C waits until it is done."""
        if not self.started:
            return
        with interrupts_deferred(self.echo):
            self.started = False
            if _STARTED.get(str(self.dir)) is self:
                del _STARTED[str(self.dir)]
            atexit.unregister(self.stop)
            self.echo(f"stopping {len(self.nodes)} worker(s) and node 0's agent")
            try:
                if self.coordinator is not None:
                    self.coordinator.close()
                self.backend.stop(self.nodes)
                if self.node0 is not None:
                    stop_processes([self._node0_process])
                # Launchers on this machine (node 0's; every node's in the local backend) are gone before we say so,
                # also those of an agent that was killed or frozen.
                local = self.links if isinstance(self.backend, LocalBackend) else self.links[:1]
                stop_launch_groups(
                    [link.launcher for link in local if getattr(link, "launcher", None) and link.launcher[0]]
                )
                self._clear_state()
            finally:
                if self.lock is not None:
                    self.lock.release()
            self.echo(f"stopped {len(self.nodes)} worker(s) and node 0's agent")

    def _clear_state(self) -> None:
        replace_file(self.state_file, json.dumps({"backend": self.backend.name, "start": None, "workers": []}))

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- training -------------------------------------------------------------------------------------------------------
    def _node_facts(self) -> list:
        from textsql.cluster.launch import NodeFacts

        ranks = [self.session_slots] + [self.spec.ranks if self.spec.nvidia_gpu else 1] * len(self.nodes)
        return [NodeFacts(link.address, link.facts, r) for link, r in zip(self.links, ranks)]

    def _ask(self, op: str, payloads: dict[str, dict]) -> dict:
        from textsql.cluster.coordinator import ask_all

        by_address = {link.address: link for link in self.links}
        return ask_all([by_address[a] for a in payloads], op, payloads)

    def plan(self, *arguments):
        """Decide and check everything for this training (textsql.cluster.launch.plan_launch) without starting it.
        `arguments`: textsql.train's (ModelArguments, DataArguments, TextsqlTrainingArguments), or one command line."""
        from textsql.cluster.launch import plan_launch

        if not self.started:
            raise TextsqlError("The cluster is not started (cluster.start()).")
        return plan_launch(
            self._node_facts(), _arguments(arguments), self._ask, workdir=Path.cwd(), log_root=self.dir / "launches"
        )

    def preflight(self, *arguments):
        """Check every node for this training and show what the launch would do; raises PreflightError."""
        try:
            plan = self.plan(*arguments)
        except BaseException:
            self.stop()
            raise
        self.echo(plan.describe())
        self.echo(f"preflight OK: {len(plan.hosts)} nodes, world size {plan.decision.world_size}")
        return plan

    def train(self, *arguments, stop_on_failure: bool = True, grace_seconds: float = 5, timeout_s: float | None = None):
        """One multi-node launch (textsql.cluster.launch): on any failure or interrupt, or past `timeout_s` seconds
        (textsql.train.local_launch.TrainingTimedOut), every node's processes are stopped, and (stop_on_failure) the
        workers too, since idle workers still hold their GPUs."""
        from textsql.cluster.launch import run_on_agents
        from textsql.cluster.runs import run_lock

        try:
            plan = self.plan(*arguments)
            self.echo(plan.describe())
            with run_lock(plan.run_dir, plan.launch_id):
                return run_on_agents(
                    self.links,
                    plan,
                    events=self.coordinator.events,
                    echo=self.echo,
                    grace_seconds=grace_seconds,
                    timeout_s=timeout_s,
                )
        except BaseException:
            if stop_on_failure:
                self.stop()
            raise

    def describe(self) -> str:
        from textsql.strategy.devices import NodeDevices

        lines = [f"{'node':<6}{'address':<18}{'worker':<30}devices"]
        for i, link in enumerate(self.links):
            worker = "this session" if i == 0 else f"{self.backend.name} {link.worker_id}"
            devices = (
                NodeDevices.from_dict(link.facts["devices"]).describe()
                if "devices" in link.facts
                else link.facts.get("devices_error")
            )
            lines.append(f"{i:<6}{link.address:<18}{worker:<30}{devices}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Cluster({self.backend.name}, nodes={[link.address for link in self.links] if self.started else 'not started'})"


def _arguments(arguments: tuple):
    """The training arguments of plan/preflight/train: the three dataclasses, or one command line (a list)."""
    from textsql.train.arguments import as_arguments

    return as_arguments(arguments[0] if len(arguments) == 1 and isinstance(arguments[0], (list, tuple)) else arguments)


def _without_secrets(environ) -> dict[str, str]:
    from textsql.cluster.environment import is_secret

    return {k: v for k, v in environ.items() if not is_secret(k, v)}
