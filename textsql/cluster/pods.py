"""Several pods on torchrun's elastic agent (docs/multi-pod.md): every pod runs `torchrun` with c10d rendezvous at
the session's store and `textsql.cluster.rank`, its command and environment fixed when the pod is created, so no pod
listens for orders. The session hosts the store, starts the pods, watches their logs, records, heartbeats and
processes (or CML status), and stops every pod in a `finally` once the launch ends or the first failure is named."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from textsql.cluster.launch import decode, encode, read_records, write_record
from textsql.cluster.rank import LAUNCH_ENV, POD_ENV
from textsql.errors import TextsqlError

RANKS_ENV = "TEXTSQL_POD_RANKS"
POD_CODE = "import sys\nfrom textsql.cluster.pods import pod_main\nsys.exit(pod_main())\n"
SILENCE_SECONDS = 20.0  # a pod whose heartbeat is older than this is lost (frozen or cut off)
STOP_GRACE_SECONDS = 10  # SIGTERM, then SIGKILL
GRACE_SECONDS = 3.0  # after the first failure, for the other records to arrive before the error is written


def narrow_store(address: str, port: int = 0):
    """A torch TCPStore server bound to `address` only, through a socket made here (torch's own binds every address,
    '::'). The store owns the socket from then on: it closes it when it is dropped."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((address, port))
    sock.listen(128)
    port = sock.getsockname()[1]
    return dist.TCPStore(address, port, is_master=True, master_listen_fd=sock.detach())


def _narrow_store_server() -> None:
    """torchrun's node-rank-0 agent hosts the trainers' store (MASTER_ADDR/PORT): bind it to the pod's own address."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def create(self, master_addr, master_port):
        return narrow_store(master_addr, master_port)

    dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server = create


def _heartbeat(endpoint: str, address: str, every: float) -> None:
    """Tell the session this pod is alive (a counter in its store), so that a frozen or cut-off pod is named once the
    counter stops. A store that is gone ends only this thread: torchrun's agent stops its ranks itself when it loses
    the rendezvous store (the session that hosts it died)."""
    import datetime

    import torch.distributed as dist

    host, port = endpoint.rsplit(":", 1)
    with contextlib.suppress(Exception):  # the store gone or unreachable: the session names the silence
        store = dist.TCPStore(host, int(port), timeout=datetime.timedelta(seconds=every * 4))
        while True:
            store.add(f"textsql/alive/{address}", 1)
            time.sleep(every)


def pod_environment(spec: dict, address: str, environ=os.environ) -> dict[str, str]:
    """The pod's environment for torchrun and its ranks: its own less secrets, the session's allowlisted variables,
    and textsql's choices unless set (CPU DeepSpeed, threads per rank, the interface, a private build folder)."""
    from textsql.cluster.environment import interface_of, is_secret, node_local_extensions_dir
    from textsql.strategy.devices import local_devices, threads_per_rank, use_accelerator

    env = {k: v for k, v in environ.items() if not is_secret(k, v) and k != LAUNCH_ENV}
    env.update(spec["env"])
    env[POD_ENV] = address
    use_accelerator(spec["accelerator"], env)
    ranks = int(environ.get(RANKS_ENV) or 1)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(local_devices(), ranks)))
    interface = interface_of(address)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if interface:
            env.setdefault(name, interface)
    if "TORCH_EXTENSIONS_DIR" not in env:
        env["TORCH_EXTENSIONS_DIR"] = node_local_extensions_dir()
    env[LAUNCH_ENV] = environ[LAUNCH_ENV]
    return env


def torchrun_args(spec: dict, address: str, ranks) -> list[str]:
    return [
        *("--nnodes", spec["nnodes"], "--nproc-per-node", str(ranks)),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", spec["store"], "--rdzv-id", spec["launch_id"]),
        *("--rdzv-conf", f"is_host=0,join_timeout={int(spec['start_timeout']) + 60},last_call_timeout=5"),
        *("--local-addr", address, "--max-restarts", str(spec["max_restarts"]), "--monitor-interval", "0.5"),
        *("--log-dir", str(Path(spec["launch_dir"]) / f"torchrun-{address}"), "--tee", "3"),
        *("-m", "textsql.cluster.rank"),
    ]


def pod_main() -> int:
    """A pod: torchrun's elastic agent in this process, its output appended to the launch folder's pod log."""
    spec = decode(os.environ[LAUNCH_ENV])
    address = os.environ.get(POD_ENV) or os.environ.get("CDSW_IP_ADDRESS") or socket.gethostname()
    log = Path(spec["launch_dir"]) / f"pod-{address}.log"
    print(f"textsql pod {address}: log in {log}", flush=True)
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    try:
        env = pod_environment(spec, address)
    except TextsqlError as error:
        write_record(spec["launch_dir"], f"pod-{address}.failure.json", pod_failure(address, str(error)))
        print(f"textsql pod {address}: {error}", flush=True)
        return 3
    os.environ.clear()
    os.environ.update(env)
    _narrow_store_server()
    threading.Thread(target=_heartbeat, args=(spec["store"], address, spec["silence"] / 4), daemon=True).start()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(torchrun_args(spec, address, int(os.environ.get(RANKS_ENV) or 1)))
    except ChildFailedError as error:  # ranks killed without a record of their own (a signal): the agent saw them
        have = {r["rank"] for r in read_records(Path(spec["launch_dir"]), "failure")}
        for rank, failure in error.failures.items():
            if rank not in have:
                how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
                record = dict(pod_failure(address, how), rank=rank, pid=failure.pid, ended_at=failure.timestamp)
                write_record(spec["launch_dir"], f"rank-{rank}.failure.json", record)
        return 1
    return 0


def pod_failure(address: str, how: str) -> dict:
    return {"rank": -1, "node_address": address, "how": how, "tail": [], "ended_at": time.time()}


@dataclass
class Pod:
    """One pod of a launch: its address ("?" until a CML worker runs), its local process or CML worker id."""

    address: str
    process: subprocess.Popen | None = None
    worker_id: str | None = None
    ended: str | None = None  # how it ended, once it has
    joined: bool = False  # a local process, or a heartbeat seen: an elastic launch may go on without the others
    beat: tuple[int, float] = (0, 0.0)  # its heartbeat counter as last seen, and when that changed
    tail: deque = field(default_factory=lambda: deque(maxlen=6))  # its last lines of output


def start_local_pod(address: str, env: dict[str, str], launch_dir: Path, cpus: list[int] | None = None) -> Pod:
    """A pod as a local process in its own session (a notebook interrupt reaches the session only), with this
    process's environment less secrets, plus `env`."""
    from textsql.cluster.environment import is_secret
    from textsql.sharedfiles import open_unlinked

    env = {**{k: v for k, v in os.environ.items() if not is_secret(k, v)}, **env, POD_ENV: address}
    with open_unlinked(launch_dir / f"pod-{address}.log", "a", binary=True) as out:
        process = subprocess.Popen(
            [sys.executable, "-c", POD_CODE],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
    return Pod(address, process=process)


def stop_local_pods(processes: list[subprocess.Popen]) -> None:
    """SIGTERM each pod (its torchrun stops its ranks; a frozen one is woken first), SIGKILL what is left after
    STOP_GRACE_SECONDS, its ranks included: nothing of the launch runs on this machine when this returns."""
    import psutil

    tree = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            tree += [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    for member in tree:
        with contextlib.suppress(psutil.Error):
            member.send_signal(signal.SIGCONT)
    for process in processes:
        if process.poll() is None:
            process.terminate()
    _, alive = psutil.wait_procs(tree, timeout=STOP_GRACE_SECONDS)
    for member in alive:
        with contextlib.suppress(psutil.Error):
            member.kill()
    psutil.wait_procs(alive, timeout=5)
    for process in processes:
        process.wait()


@contextlib.contextmanager
def interrupts_deferred(echo=print, doing: str = "stopping the pods"):
    """A second Ctrl-C waits until the block is done, then is raised: clean-up is never cut short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []

    def later(signum, frame):
        received.append(signum)
        echo(f"textsql: still {doing}; the interrupt takes effect once that is done")

    previous = signal.signal(signal.SIGINT, later)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            raise KeyboardInterrupt


@dataclass
class Cluster:
    """The session plus `workers` worker pods, created for each launch (their command is the launch's).

    with Cluster("cml", workers=2, nvidia_gpu=1) as cluster:   # or Cluster("local", workers=1)
        cluster.preflight(model_args, data_args, training_args)   # or one command line: cluster.train(argv)
        result = cluster.train(model_args, data_args, training_args)

    `backend`: "cml" (worker pods through CML's `cml.workers_v1`: `launch_workers(code=..., env=...)`; the session is
    $CDSW_IP_ADDRESS, a worker's address is known from `list_workers` once it runs) or "local" (worker pods as local
    processes on 127.0.0.2, 127.0.0.3, ...; the session is 127.0.0.1; each pod gets its own GPUs and its share of the
    cores). `min_workers`: elastic (`torchrun --nnodes MIN:MAX`): the launch starts once 1 + min_workers pods joined,
    and a worker that never joins is no failure. `max_restarts`: torchrun restarts every pod's ranks this many times
    after a failure (0: the launch ends).
    """

    backend: str = "local"
    workers: int = 1
    cpu: float = 4
    memory: float = 16
    nvidia_gpu: int = 1
    session_slots: int | None = None
    project_dir: Path = Path(".")
    name: str = "default"
    start_timeout: float = 600
    echo: object = print
    silence_seconds: float = SILENCE_SECONDS
    min_workers: int | None = None
    max_restarts: int = 0
    pods: list[Pod] = field(default_factory=list, init=False)

    def __post_init__(self):
        if self.workers < 0:
            raise TextsqlError(f"workers must be 0 or more, not {self.workers}.")
        if self.min_workers is not None and not 0 <= self.min_workers <= self.workers:
            raise TextsqlError(f"min_workers must be between 0 and workers ({self.workers}), not {self.min_workers}.")
        if self.backend not in ("local", "cml"):
            raise TextsqlError(f"backend must be 'cml' or 'local', not '{self.backend}'.")
        self.cml = None
        self.project_dir = Path(self.project_dir).absolute()
        self.dir = self.project_dir / ".textsql" / "cluster" / self.name
        self.started, self.lock = False, None

    def start(self) -> Cluster:
        """Take this cluster's name (one cluster of a name runs at a time in a project); pods start with each launch."""
        from textsql.cluster.runs import FileLock

        if not self.started:
            self.session = "127.0.0.1"
            if self.backend == "cml":
                try:
                    import cml.workers_v1 as cml
                except ImportError:
                    raise TextsqlError(
                        "The CML backend needs `cml.workers_v1`, which exists only inside a CML session. "
                        "Use backend='local' on any other machine."
                    ) from None
                self.cml, self.session = cml, os.environ.get("CDSW_IP_ADDRESS")
                if not self.session:
                    raise TextsqlError("CDSW_IP_ADDRESS is not set: the CML backend runs inside a CML session.")
            self.lock = FileLock(
                self.dir / "cluster.lock",
                f"Cluster '{self.name}' of {self.project_dir}",
                "Stop it there (cluster.stop(), or end that session), or give this one another name (Cluster(name=...)).",
                {},
            )
            self.started = True
        return self

    def stop(self) -> None:
        """Stop any pod still running and free the name. Safe to call twice."""
        with interrupts_deferred(self.echo):
            self._stop_pods()
            if self.lock is not None:
                self.lock.release()
            self.started = False

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def plan(self, *arguments):
        """Decide and prepare this training (textsql.cluster.launch.plan_launch) without starting it. `arguments`:
        textsql.train's three dataclasses, or one command line (a list)."""
        from textsql.cluster.launch import plan_launch
        from textsql.strategy.devices import local_devices

        if not self.started:
            raise TextsqlError("The cluster is not started (cluster.start()).")
        if len(arguments) == 1 and isinstance(arguments[0], (list, tuple)):
            arguments = arguments[0]
        return plan_launch(
            arguments,
            ranks=[self.session_slots] + [max(1, self.nvidia_gpu)] * self.workers,  # a worker's GPUs (1 on a CPU)
            devices=local_devices(),
            workdir=Path.cwd(),
            log_root=self.dir / "launches",
            environ=os.environ,
        )

    def preflight(self, *arguments):
        """Show what the launch would do (every rank checks its pod against it when it starts)."""
        plan = self.plan(*arguments)
        self.echo(plan.describe())
        self.echo(f"preflight OK: {1 + self.workers} pods, world size {plan.world_size}")
        return plan

    def train(self, *arguments, grace_seconds: float = GRACE_SECONDS, timeout_s=None):
        """One launch on new pods: raises LaunchFailed naming the rank or pod that failed first, the interrupt, or
        textsql.train.local_launch.TrainingTimedOut past `timeout_s`; every pod is stopped before it returns."""
        from textsql.cluster.launch import finish, prepare
        from textsql.cluster.runs import run_lock

        plan = self.plan(*arguments)
        self.echo(plan.describe())
        with run_lock(plan.run_dir, plan.launch_id):
            prepare(plan)
            store = narrow_store(self.session)  # the rendezvous store, on the session's address only
            nnodes = f"{1 + self.min_workers}:{1 + self.workers}" if self.min_workers is not None else 1 + self.workers
            spec = plan.spec(
                store=f"{self.session}:{store.port}",
                nnodes=str(nnodes),
                max_restarts=self.max_restarts,
                silence=self.silence_seconds,
                start_timeout=self.start_timeout,
            )
            command = ["torchrun", *torchrun_args(spec, "<pod address>", "<ranks>")]
            self.echo("every pod: " + " ".join(command))
            try:
                self._start_pods(plan, spec)
                lost = self._watch(plan, store, grace_seconds, timeout_s)
            finally:
                with interrupts_deferred(self.echo):
                    self._stop_pods()
                del store  # stops listening
            return finish(plan, lost, command)

    def _start_pods(self, plan, spec: dict) -> None:
        from textsql.strategy.devices import local_devices, split_local_cores, split_local_gpus

        if self.cml is None:  # pods on this machine: each its own GPUs and its share of the cores
            gpus = split_local_gpus(plan.ranks, local_devices(), os.environ.get("CUDA_VISIBLE_DEVICES"))
            cores = split_local_cores(sorted(os.sched_getaffinity(0)), len(plan.ranks))
        else:  # the session's pod keeps what it has; each worker pod has its own devices
            gpus, cores = [None], [None]
        env = {LAUNCH_ENV: encode(spec)}
        self.echo(f"starting the session's pod ({self.session}) and {self.workers} {self.backend} worker pod(s)")
        with interrupts_deferred(self.echo, "starting the pods"):  # what is started is recorded, so it can be stopped
            local = [self.session] + ([f"127.0.0.{2 + n}" for n in range(self.workers)] if self.cml is None else [])
            self.pods = []
            for i, address in enumerate(local):
                pod_env = {**env, RANKS_ENV: str(plan.ranks[i])}
                if gpus[i] is not None:
                    pod_env["CUDA_VISIBLE_DEVICES"] = gpus[i]
                self.pods.append(start_local_pod(address, pod_env, plan.launch_dir, cores[i]))
            if self.workers and self.cml is not None:
                launched = self.cml.launch_workers(
                    n=self.workers,
                    cpu=self.cpu,
                    memory=self.memory,
                    nvidia_gpu=self.nvidia_gpu,
                    code=POD_CODE,
                    env={**env, RANKS_ENV: str(plan.ranks[1])},
                )
                self.pods += [Pod("?", worker_id=w["id"]) for w in launched]

    def _stop_pods(self) -> None:
        if not self.pods:
            return
        self.echo(f"textsql: stopping {len(self.pods)} pod(s)")
        pods, self.pods = self.pods, []
        if workers := [p.worker_id for p in pods if p.process is None]:
            with contextlib.suppress(Exception):
                self.cml.stop_workers(*workers)
        stop_local_pods([p.process for p in pods if p.process is not None])

    def _watch(self, plan, store, grace_seconds: float, timeout_s) -> dict[str, str]:
        """Echo every pod's log until every pod that joined ended well, or the first failure and a grace for the other
        records: returns the pods lost (address -> how). TrainingTimedOut past `timeout_s`."""
        from textsql.cluster.launch import new_lines
        from textsql.sharedfiles import open_unlinked

        began, offsets, lost, failing_since = time.monotonic(), {}, {}, None
        recent: deque[str] = deque(maxlen=6)
        elastic = self.min_workers is not None
        with open_unlinked(plan.launch_dir / "launch.log", "a", buffering=1) as launch_log:
            while True:
                now = time.monotonic()
                for pod in self.pods:
                    status = self._cml_status(pod) if pod.process is None else None
                    if pod.ended is None and pod.process is not None and pod.process.poll() is not None:
                        pod.ended = "ok" if pod.process.returncode == 0 else _how(pod.process.returncode)
                    elif pod.ended is None and status in ("failed", "stopped", "succeeded", "timedout", "missing"):
                        pod.ended = "ok" if status == "succeeded" else f"its worker {pod.worker_id} is {status}"
                    for line in new_lines(plan.launch_dir / f"pod-{pod.address}.log", offsets):
                        shown = f"{pod.address}: {line}"
                        launch_log.write(shown + "\n")
                        pod.tail.append(line)
                        recent.append(shown)
                        self.echo(shown)
                    beat = int(store.add(f"textsql/alive/{pod.address}", 0)) if pod.address != "?" else 0
                    pod.joined = pod.joined or bool(beat) or pod.process is not None
                    if beat != pod.beat[0]:
                        pod.beat = (beat, now)
                    elif pod.ended is None and beat and now - pod.beat[1] > self.silence_seconds:
                        silent = f"{now - pod.beat[1]:.0f} s (no heartbeat: frozen, or cut off from the network)"
                        lost.setdefault(pod.address, f"it went silent for {silent}")
                    if pod.ended is None and not pod.joined and now - began > self.start_timeout and not elastic:
                        lost.setdefault(
                            pod.address if pod.address != "?" else pod.worker_id,
                            f"it did not start within {self.start_timeout:.0f} s"
                            + (f" (its worker {pod.worker_id} is {status})" if status else ""),
                        )
                    if pod.ended not in (None, "ok"):
                        if not any(
                            r.get("node_address") == pod.address for r in read_records(plan.launch_dir, "failure")
                        ):
                            lost.setdefault(pod.address, f"it {pod.ended}" + "".join(f"\n  | {t}" for t in pod.tail))
                if all(p.ended == "ok" for p in self.pods if p.joined or not elastic):
                    return lost
                if failing_since is None and (lost or read_records(plan.launch_dir, "failure")):
                    failing_since = now
                if failing_since is not None and (
                    now - failing_since >= grace_seconds or all(p.ended for p in self.pods)
                ):
                    self.echo(f"textsql: launch {plan.launch_id} failed")
                    return lost
                if timeout_s is not None and now - began > timeout_s:
                    from textsql.train.local_launch import TrainingTimedOut

                    raise TrainingTimedOut(timeout_s, list(recent))
                time.sleep(0.5)

    def _cml_status(self, pod: Pod) -> str:
        """A CML worker's status ("scheduling", "running", "failed", ...); its address is learned on the way."""
        for listed in self.cml.list_workers():
            if listed.get("id") == pod.worker_id:
                if listed.get("ip_address") and pod.address == "?":
                    pod.address = listed["ip_address"]
                return listed.get("status")
        return "missing"

    def __repr__(self) -> str:
        return f"Cluster({self.backend}, workers={self.workers}, {'started' if self.started else 'not started'})"


def _how(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"ended with exit status {code}"


if __name__ == "__main__":
    sys.exit(pod_main())
