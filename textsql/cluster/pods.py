"""Several pods on torchrun's elastic agent (docs/multi-pod.md): every pod runs `torchrun` with c10d rendezvous at
the session's store and `textsql.cluster.rank`, its command and environment fixed when the pod is created, so no pod
listens for orders; each pod names its own ranks that hang. The session hosts the store, starts the pods, watches
their logs, records, heartbeats and processes (or CML status), and stops every pod in a `finally` once the launch
ends or the first failure is named."""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from textsql.cluster.launch import decode, encode, last_round, read_records, write_record
from textsql.cluster.rank import LAUNCH_ENV, POD_ENV, ROUND_ENV
from textsql.errors import TextsqlError
from textsql.paths import CLUSTER_DIR, LAUNCHES_DIR
from textsql.strategy.devices import DEFAULT_POD_MEMORY_GB
from textsql.train.watch import KEY_FD_ENV, SIGNAL_FD_ENV, WatchLimits, key_pipe, mac, read_key, read_signal

RANKS_ENV = "TEXTSQL_POD_RANKS"
STOP_GRACE_SECONDS = 10  # SIGTERM, then SIGKILL
GRACE_SECONDS = 3.0  # after the first failure, for the other records to arrive before the error is written
LEFT_OUT = "left out"  # an elastic launch's pod that had not joined when the training started: stopped, no failure
_SIGNALS: dict[int, int] = {}  # a pod's ranks (pid) -> the read end of the pipe of their signals


def pod_code(key: str | None = None) -> str:
    """What a pod runs: its key, for a CML worker, in the code CML runs (not in `env=`, which CML puts in the
    worker's environment); a local pod reads it from an inherited pipe."""
    call = f"pod_main(key={key!r})" if key else "pod_main()"
    return f"from textsql.cluster.pods import pod_main\nfrom textsql.cluster.rank import exit_now\nexit_now({call})\n"


def rank_key(key: str, address: str) -> bytes:
    """The key a pod's ranks sign their signals with: made from the pod's, which they never hold."""
    return mac(key.encode(), f"ranks:{address}").encode()


def _patch_torchrun(launch_dir: str, address: str, elastic: bool, key: bytes) -> None:
    """textsql's changes to torchrun's agent in this pod (torch's private methods; the cluster tests run each): the
    trainers' store bound to the pod's address, a new one each rendezvous round (torch keeps the first: a restart met
    its keys, pytorch#135712) and the round told to the ranks; each rank started with its signing `key` in a pipe of
    its own (never its environment); no restart for a pod joining an elastic launch late; a record for every rank
    that failed without its own (a signal), so that it is the one named."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler as Handler

    def popen(self, args, env):  # torch's own, plus the pipes: the key in, the signals out
        key_end, (signals, signal_pipe) = key_pipe(key), os.pipe()
        try:
            process = subprocess.Popen(
                args, env={**env, KEY_FD_ENV: str(key_end), SIGNAL_FD_ENV: str(signal_pipe)}, stdout=self._stdout,
                stderr=self._stderr, start_new_session=True, pass_fds=(key_end, signal_pipe),
            )  # fmt: skip
        finally:
            os.close(key_end)
            os.close(signal_pipe)
        os.set_blocking(signals, False)
        _SIGNALS[process.pid] = signals
        return process

    from textsql.train.distributed import bound_store

    join, monitor = Handler.next_rendezvous, LocalElasticAgent._monitor_workers

    def next_rendezvous(self):
        self._bootstrap_store_info = self._shared_tcp_store_server = None
        info = join(self)
        os.environ[ROUND_ENV] = str(self._state_holder.state.round)  # the ranks started next inherit it
        return info

    def monitor_workers(self, group):
        result = monitor(self, group)
        if result.state == WorkerState.FAILED:
            round_ = int(os.environ.get(ROUND_ENV, "0"))
            have = {r["rank"] for r in read_records(launch_dir, "failure", round_)}
            for rank, failure in result.failures.items():
                how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
                if rank not in have:
                    record = dict(pod_failure(address, how), rank=rank, pid=failure.pid, ended_at=failure.timestamp)
                    write_record(launch_dir, "failure", dict(record, round=round_))
        return result

    Handler.next_rendezvous, LocalElasticAgent._monitor_workers = next_rendezvous, monitor_workers
    SubprocessHandler._popen = popen
    Handler._create_tcp_store_server = lambda self, address, port: bound_store(address, port)
    if elastic:
        Handler.num_nodes_waiting = lambda self: 0


def signed(key: str, address: str, count: int) -> str:
    """A pod's heartbeat `count` as only a holder of the launch's key can write it (its pods and the session)."""
    return f"{count}:" + mac(key.encode(), f"{address}:{count}")


def _beats_of(store, key: str, address: str) -> int:
    """A pod's newest heartbeat count in the store, 0 unless signed with the launch's key (none yet, or forged)."""
    with contextlib.suppress(Exception):
        if store.check([f"textsql/alive/{address}"]):
            value = store.get(f"textsql/alive/{address}").decode()
            count = int(value.split(":")[0])
            return count if hmac.compare_digest(value, signed(key, address, count)) else 0
    return 0


def _heartbeat(spec: dict, address: str, key: str) -> None:
    """Every silence/4 s: a new count, signed with the launch's key, in the session's store (a frozen or cut-off pod
    is named when it stops, a forger cannot sign the next; a gone store stops only the counting), and name a rank of
    this pod whose signed signals (textsql.train.watch.beat, in a pipe into this process) stopped for `silence` s
    while its process used no CPU (a long call that holds the GIL still does), or whose training made no progress
    for longer than its phase's limit (textsql.train.watch.WatchLimits.of): its failure record, dated when it
    stopped, then SIGKILL (torchrun ends or restarts)."""
    import datetime

    import psutil
    import torch.distributed as dist

    limits, ranks = WatchLimits(**spec["limits"]), rank_key(key, address)
    every, store, last, cpu, count, heard = limits.silence_seconds / 4, None, time.monotonic(), {}, 0, {}
    host, port = spec["store"].rsplit(":", 1)
    with contextlib.suppress(Exception):  # unreachable: the session names the silence
        store = dist.TCPStore(host, int(port), timeout=datetime.timedelta(seconds=every * 4))
    while True:
        try:
            if store is not None:
                count += 1
                store.set(f"textsql/alive/{address}", signed(key, address, count))
        except Exception:  # the session, and its store, are gone
            store = None
        awake, last = time.monotonic() - last < limits.silence_seconds, time.monotonic()  # not woken from a stop
        children = psutil.Process().children()
        for pid in set(_SIGNALS) - {c.pid for c in children}:  # gone: its pipe closed
            os.close(_SIGNALS.pop(pid))
        for child in children if awake else ():
            with contextlib.suppress(psutil.Error, OSError, KeyError, ValueError):
                env, now, lines = child.environ(), time.time(), []
                newest, since = heard.setdefault(child.pid, ({"count": 0}, child.create_time()))
                with contextlib.suppress(BlockingIOError, TypeError):  # all of it: more than a pipe holds
                    lines = os.read(_SIGNALS.get(child.pid), 1 << 20).splitlines()
                for line in lines:
                    signal_ = read_signal(line, ranks, child.pid)
                    if signal_ and signal_["count"] > newest["count"]:
                        newest, since = heard[child.pid] = (signal_, now)
                used, cpu[child.pid], how = cpu.get(child.pid), sum(child.cpu_times()[:2]), None
                if now - since > limits.silence_seconds and used == cpu[child.pid]:
                    how = f"it hung: no sign of life for {now - since:.0f} s (its process is {child.status()})"
                elif newest.get("limit") is not None and now - (since := newest["since"]) > newest["limit"]:
                    where = "waiting for its peers in a collective" if newest["collective"] else "blocked"
                    how = (
                        f"it made no progress in its {newest['phase']} for {now - since:.0f} s while alive, {where} "
                        f"(a deadlock, a lock; its limit: {newest['assumed']}, see textsql cluster train --help)"
                    )
                if "RANK" in env and how:
                    record = dict(pod_failure(address, how), rank=int(env["RANK"]), pid=child.pid, ended_at=since)
                    record.update(phase=newest.get("phase"), round=int(env.get(ROUND_ENV, "0")))
                    write_record(spec["launch_dir"], "failure", record)
                    child.kill()
        time.sleep(every)


def pod_environment(spec: dict, address: str, environ=os.environ) -> dict[str, str]:
    """The environment of the pod's torchrun and ranks: what it keeps of its own (a CML worker's holds the project's
    secrets), the session's allowlisted variables, textsql's choices unless set (CPU DeepSpeed, threads per rank, the
    interface, a private build folder)."""
    from textsql.redaction import for_pod
    from textsql.strategy.devices import local_devices, threads_per_rank, use_accelerator
    from textsql.strategy.opbuilds import node_local_extensions_dir
    from textsql.train.distributed import interface_of

    env = {**for_pod(environ), **spec["env"], POD_ENV: address}
    use_accelerator(spec["accelerator"], env)
    ranks = int(environ.get(RANKS_ENV) or 1)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(local_devices(), ranks)))
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if (interface := interface_of(address)) else ():
        env.setdefault(name, interface)
    if "TORCH_EXTENSIONS_DIR" not in env:
        env["TORCH_EXTENSIONS_DIR"] = node_local_extensions_dir()  # not the project folder every pod shares
    env[LAUNCH_ENV] = environ[LAUNCH_ENV]
    return env


def torchrun_args(spec: dict, address: str, ranks) -> list[str]:
    """An elastic round forms at once when every pod joined, else `join_window` s after the least it trains with did
    (torch's last_call_timeout)."""
    window = int(spec["limits"]["join_window"])
    join_timeout = int(spec["start_timeout"]) + window + 60
    return [
        *("--nnodes", spec["nnodes"], "--nproc-per-node", str(ranks)),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", spec["store"], "--rdzv-id", spec["launch_id"]),
        *("--rdzv-conf", f"is_host=0,join_timeout={join_timeout},last_call_timeout={window}"),
        *("--local-addr", address, "--max-restarts", str(spec["max_restarts"]), "--monitor-interval", "0.5"),
        *("--log-dir", str(Path(spec["launch_dir"]) / f"torchrun-{address}"), "--tee", "3"),
        *("-m", "textsql.cluster.rank"),
    ]


def pod_main(key: str | None = None) -> int:
    """A pod: torchrun's elastic agent in this process, its output appended to the launch folder's pod log. `key`:
    the launch's (a CML worker's code holds it), else read from the pipe $TEXTSQL_KEY_FD names."""
    key = key or read_key(os.environ.pop(KEY_FD_ENV, None)).decode()
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
        write_record(spec["launch_dir"], "failure", pod_failure(address, str(error)))
        print(f"textsql pod {address}: {error}", flush=True)
        return 3
    os.environ.clear()
    os.environ.update(env)
    _patch_torchrun(spec["launch_dir"], address, ":" in spec["nnodes"], rank_key(key, address))
    threading.Thread(target=_heartbeat, args=(spec, address, key), daemon=True).start()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(torchrun_args(spec, address, int(os.environ.get(RANKS_ENV) or 1)))
    except ChildFailedError:  # every failed rank has its record (its own, or torchrun's agent's: _patch_torchrun)
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
    beat: tuple[int, float] = field(default_factory=lambda: (0, time.monotonic()))  # counter as last seen, and when
    tail: deque = field(default_factory=lambda: deque(maxlen=6))  # its last lines of output


def start_local_pod(
    address: str, env: dict[str, str], launch_dir: Path, key: str, cpus: list[int] | None = None
) -> Pod:
    """A pod as a local process in its own session (a notebook interrupt reaches the session only), with what a pod
    keeps of this process's environment (textsql.redaction.for_pod), plus `env`; the launch's `key` in a pipe."""
    from textsql.redaction import for_pod
    from textsql.sharedfiles import open_unlinked

    read = key_pipe(key.encode())
    env = {**for_pod(), **env, POD_ENV: address, KEY_FD_ENV: str(read)}
    try:
        with open_unlinked(launch_dir / f"pod-{address}.log", "a", binary=True) as out:
            process = subprocess.Popen(
                [sys.executable, "-c", pod_code()],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(read,),
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
    finally:
        os.close(read)
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
    cores). `min_workers`: elastic (`--nnodes MIN:MAX`, with --output_dir): the pods that joined when training started
    train, the others are stopped. `max_restarts`: torchrun restarts every pod's ranks after a failure, from the newest
    complete checkpoint (docs/multi-pod.md). `limits`: how long a pod or a rank may go without a heartbeat or progress
    (textsql.train.watch.WatchLimits: the first step, a later one, an evaluation, a save; an elastic launch's join
    window), defaults sized for a 7B ZeRO-3 run. `forward_env`: your own variables every rank gets (names, or prefixes
    ending in *), besides textsql's allowlist; a name that looks like a credential never leaves (textsql.redaction).
    """

    backend: str = "local"
    workers: int = 1
    cpu: float = 4
    memory: float = DEFAULT_POD_MEMORY_GB
    nvidia_gpu: int = 1
    session_slots: int | None = None
    project_dir: Path = Path(".")
    name: str = "default"
    start_timeout: float = 600
    echo: object = print
    limits: WatchLimits = field(default_factory=WatchLimits)
    min_workers: int | None = None
    max_restarts: int = 0
    forward_env: tuple[str, ...] = ()
    pods: list[Pod] = field(default_factory=list, init=False)

    def __post_init__(self):
        if self.workers < 0:
            raise TextsqlError(f"workers must be 0 or more, not {self.workers}.")
        if self.min_workers is not None and not 0 <= self.min_workers <= self.workers:
            raise TextsqlError(f"min_workers must be between 0 and workers ({self.workers}), not {self.min_workers}.")
        if self.min_workers is not None and self.max_restarts:
            raise TextsqlError(
                "max_restarts cannot be combined with min_workers: an elastic restart may form at another world size "
                "mid-launch, and textsql resizes a run only at its next launch (the checkpoint converted then: "
                "docs/multi-pod.md). Choose one."
            )
        if self.backend not in ("local", "cml"):
            raise TextsqlError(f"backend must be 'cml' or 'local', not '{self.backend}'.")
        self.cml = None
        self.project_dir = Path(self.project_dir).absolute()
        self.dir = self.project_dir / CLUSTER_DIR / self.name
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
        from textsql.redaction import forwarded
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
            log_root=self.dir / LAUNCHES_DIR,
            env=forwarded(os.environ, self.forward_env),
            min_pods=None if self.min_workers is None else 1 + self.min_workers,
        )

    def preflight(self, *arguments):
        """Show what the launch would do (every rank checks its pod against it when it starts)."""
        plan = self.plan(*arguments)
        self.echo(plan.describe())
        self.echo(f"preflight OK: {1 + self.workers} pods, world size {plan.sizes()}")
        return plan

    def train(self, *arguments, grace_seconds: float = GRACE_SECONDS, timeout_s=None):
        """One launch on new pods: raises LaunchFailed naming the rank or pod that failed first, the interrupt, or
        textsql.train.local_launch.TrainingTimedOut past `timeout_s`; every pod is stopped before it returns."""
        from textsql.cluster.launch import finish, prepare
        from textsql.cluster.runs import run_lock
        from textsql.train.distributed import bound_store, close_stores

        plan = self.plan(*arguments)
        self.echo(plan.describe())
        with run_lock(plan.run_dir, plan.launch_id):
            prepare(plan)
            # The rendezvous store, on the session's address only, not shared with any other store of this process
            # (torch's multi-tenant cache would keep it listening as long as one lives); in a list that the finally
            # empties: it stops listening even while a kept traceback (a notebook's) holds the frames.
            store = [bound_store(self.session, shared=False)]
            nnodes = f"{1 + self.min_workers}:{1 + self.workers}" if self.min_workers is not None else 1 + self.workers
            spec = plan.spec(
                store=f"{self.session}:{store[0].port}", nnodes=str(nnodes), max_restarts=self.max_restarts
            )
            spec.update(limits=self.limits.as_dict(), start_timeout=self.start_timeout)
            command = ["torchrun", *torchrun_args(spec, "<pod address>", "<ranks>")]
            self.echo("every pod: " + " ".join(command))
            try:
                self.key = secrets.token_hex(32)  # the pods' heartbeats are signed with it (signed)
                self._start_pods(plan, spec)
                lost = self._watch(plan, store, grace_seconds, timeout_s)
            finally:
                with interrupts_deferred(self.echo):  # a second Ctrl-C is raised once all of this is done
                    self._stop_pods()
                    if left := close_stores(store):  # its last reference: it stops listening
                        self.echo(f"textsql: the rendezvous store still listens on port {left[0]}: something holds it")
            return finish(plan, lost, command)

    def _start_pods(self, plan, spec: dict) -> None:
        from textsql.strategy.devices import local_devices, split_local_cores, split_local_gpus

        if self.cml is None:  # pods on this machine: each its own GPUs and its share of the cores
            gpus = split_local_gpus(plan.ranks, local_devices(), os.environ.get("CUDA_VISIBLE_DEVICES"))
            cores = split_local_cores(sorted(os.sched_getaffinity(0)), len(plan.ranks))
        else:  # the session's pod keeps what it has; each worker pod has its own devices
            gpus, cores = [None], [None]
        env = {LAUNCH_ENV: encode(spec)}  # the key in no environment, file, log or command line
        self.echo(f"starting the session's pod ({self.session}) and {self.workers} {self.backend} worker pod(s)")
        with interrupts_deferred(self.echo, "starting the pods"):  # what is started is recorded, so it can be stopped
            local = [self.session] + ([f"127.0.0.{2 + n}" for n in range(self.workers)] if self.cml is None else [])
            self.pods = []
            for i, address in enumerate(local):
                pod_env = {**env, RANKS_ENV: str(plan.ranks[i])}
                if gpus[i] is not None:
                    pod_env["CUDA_VISIBLE_DEVICES"] = gpus[i]
                self.pods.append(start_local_pod(address, pod_env, plan.launch_dir, self.key, cores[i]))
            if self.workers and self.cml is not None:
                launched = self.cml.launch_workers(
                    n=self.workers,
                    cpu=self.cpu,
                    memory=self.memory,
                    nvidia_gpu=self.nvidia_gpu,
                    code=pod_code(self.key),
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

    def _watch(self, plan, store: list, grace_seconds: float, timeout_s) -> dict[str, str]:
        """Echo every pod's log until every pod that trains ended well, or the first failure and a grace for the other
        records (a rank's record only without restarts; else a pod whose torchrun gave up): returns the pods lost
        (address -> how). An elastic launch stops the pods missing from its first round. TrainingTimedOut past
        `timeout_s`."""
        from textsql.cluster.launch import new_lines
        from textsql.sharedfiles import open_unlinked

        began, offsets, lost, failing_since, formed = time.monotonic(), {}, {}, None, False
        recent: deque[str] = deque(maxlen=6)
        elastic = self.min_workers is not None
        needed = 1 + self.min_workers if elastic else len(self.pods)
        with open_unlinked(plan.launch_dir / "launch.log", "a", buffering=1) as launch_log:
            while True:
                now = time.monotonic()
                failures = read_records(plan.launch_dir, "failure", last_round(plan.launch_dir))
                recorded = {r.get("node_address") for r in failures}
                for pod in self.pods:
                    status = self._cml_status(pod) if pod.process is None else None
                    if pod.ended is None and pod.process is not None and pod.process.poll() is not None:
                        pod.ended = "ok" if pod.process.returncode == 0 else _how(pod.process.returncode)
                    elif pod.ended is None and status in ("failed", "stopped", "succeeded", "timedout", "missing"):
                        pod.ended = "ok" if status == "succeeded" else f"its CML worker {pod.worker_id} is {status}"
                    for line in new_lines(plan.launch_dir / f"pod-{pod.address}.log", offsets):
                        shown = f"{pod.address}: {line}"
                        launch_log.write(shown + "\n")
                        pod.tail.append(line)
                        recent.append(shown)
                        self.echo(shown)
                    beat = _beats_of(store[0], self.key, pod.address)
                    pod.joined = pod.joined or bool(beat) or pod.process is not None
                    if beat > pod.beat[0] or status == "scheduling":  # a worker's silence counts once it runs
                        pod.beat = (beat, now)
                    elif pod.ended is None and now - pod.beat[1] > (
                        self.limits.silence_seconds if pod.beat[0] else self.limits.first_heartbeat_timeout
                    ):
                        silent = f"{now - pod.beat[1]:.0f} s"  # the first beat comes once torch loaded
                        how = (
                            f"went silent for {silent}"
                            if pod.beat[0]
                            else f"sent no heartbeat in the {silent} since it started"
                        )
                        lost.setdefault(pod.address, f"it {how} (frozen, or cut off from the network)")
                    if pod.ended not in (None, "ok", LEFT_OUT) and pod.address not in recorded:
                        lost.setdefault(pod.address, pod.ended + "".join(f"\n  | {t}" for t in pod.tail))
                first = read_records(plan.launch_dir, "started", 0) if elastic and not formed else []
                if first and {r["rank"] for r in first} == set(range(_int(first[0].get("world_size")))):
                    formed, trains = True, {r.get("node_address") for r in first}  # the pods of the first round train
                    self.echo(f"textsql: training at world size {len(first)} on the pods {', '.join(sorted(trains))}")
                    for pod in [p for p in self.pods if p.ended is None and p.address not in trains]:
                        self.echo(
                            f"textsql: pod {pod.worker_id or pod.address} had not joined when the training started at "
                            f"world size {len(first)}: stopped (joining would restart every rank mid-run; the next "
                            "launch resumes the run at the size it gets)."
                        )
                        pod.ended, pod.joined = LEFT_OUT, False
                        with contextlib.suppress(Exception):
                            stop_local_pods([pod.process]) if pod.process else self.cml.stop_workers(pod.worker_id)
                waiting = [p for p in self.pods if not p.joined and p.ended is None]
                if not formed and now - began > self.start_timeout and len(self.pods) - len(waiting) < needed:
                    for pod in waiting:
                        how = f"it did not start within {self.start_timeout:.0f} s"
                        status = f" (its worker {pod.worker_id} is {self._cml_status(pod)})" if pod.worker_id else ""
                        lost.setdefault(pod.address if pod.address != "?" else pod.worker_id, how + status)
                if all(p.ended in ("ok", LEFT_OUT) for p in self.pods if p.joined or not elastic):
                    return lost
                ended_badly = any(p.ended not in (None, "ok", LEFT_OUT) for p in self.pods)
                if failing_since is None and (lost or ended_badly or (failures and not self.max_restarts)):
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


def _int(value) -> int:
    return value if type(value) is int else 0


def _how(code: int) -> str:
    return f"it was killed by {signal.Signals(-code).name}" if code < 0 else f"it ended with exit status {code}"


if __name__ == "__main__":
    sys.exit(pod_main())
