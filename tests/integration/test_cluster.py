"""Several pods for real on this machine: every pod (the session's own on 127.0.0.1, workers on 127.0.0.2) runs
torchrun's elastic agent as a real local process, started by the local backend or by the CML stand-in
(tests/cml_standin: the `cml.workers_v1` signatures, real local processes), gloo on the CPU; and user-managed nodes
over real pdsh and sshd.

ZeRO-2 full fine-tuning and a LoRA run across two pods, over pdsh, and from the notebook; the canary secret, under
known and unknown names, is never in a log, a rank's environment, the CML worker's or the notebook. The fault paths
(each fault ending the launch named, resuming, elastic launches, nothing listening) are in test_cluster_faults.py, a
file of their own so that the two test workers share the pods' minutes (the fixtures and helpers are this file's).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import tiny_train_argv
from test_notebooks import execute, outputs_text
from test_train import check_model_reloads_and_generates

from textsql.cluster import Cluster, PreflightError
from textsql.errors import TextsqlError

TESTS = Path(__file__).resolve().parents[1]
STANDIN = TESTS / "cml_standin"
FAULTS = TESTS / "faults"
NODES = ("127.0.0.1", "127.0.0.2")
CANARY = "hf_canary_7c1d0e5a9b3f24680"
RENDEZVOUS_LOG = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
UNKNOWN_SECRETS = {"TEXTSQL_DB_CONN": f"host=db.internal user=textsql password={CANARY}", "HF_HUB_DOWNLOAD_SIG": CANARY}


def check_rank_arguments(rank: dict, argv: list[str]):
    """A rank trained with exactly the arguments of `argv` (parsed once, on the session), plus what the launch decided
    for every rank: the CPU, fp32 (the Trainer's own precision flags folded in) and the DeepSpeed file every pod reads."""
    from textsql.arguments.training import arguments_dict, parse_arguments

    decided = {"accelerator": "cpu", "precision": "fp32", "bf16": False, "fp16": False}
    got, given = rank["arguments"], arguments_dict(*parse_arguments(argv))
    assert {k: got[k] for k in decided} == decided
    if given["deepspeed"]:
        assert Path(got["deepspeed"]).is_absolute() and Path(got["deepspeed"]).stem == given["deepspeed"]
    same = set(given) - set(decided) - {"deepspeed"}
    assert {k: got[k] for k in same} == {k: given[k] for k in same}


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------------------------------


BEFORE: dict[str, tuple] = {}  # per project folder: when its test began, /dev/shm's entries and this process's sockets


def leftovers(root: Path) -> list[str]:
    """What the test's launches left: processes (other than this one) working in its project folder (agents,
    launchers, ranks); sockets this process
    listens on that it did not before (a rendezvous store); shared memory (/dev/shm) of torch, NCCL or gloo made
    since (or named with a rank's process id); and DeepSpeed build locks no process holds, made since."""
    import psutil

    from textsql.strategy.opbuilds import build_locks, extensions_folder, lock_holders

    began, shm, sockets = BEFORE.get(str(root), (time.time(), set(), set()))
    pids = {str(pid) for pid in rank_pids(root).values()}
    # the user-managed nodes' sshd is the test's own server (a fixture's child), listening for the whole module
    found = [f"left: listening {s}" for s in listeners([os.getpid()]) if s not in sockets and s[1] != "sshd"]
    found += [
        f"left: /dev/shm/{name}"
        for name in set(os.listdir("/dev/shm")) - shm
        if any(word in name for word in ("torch", "nccl", "gloo", *pids))
    ]
    found += [
        f"left: {lock}"
        for lock in build_locks(extensions_folder())
        if modified(lock) >= began and not lock_holders(lock)
    ]
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            cwd = process.cwd()
        except psutil.Error:
            continue
        if (
            process.pid != os.getpid()
            and (cwd == str(root) or cwd.startswith(str(root) + os.sep))
            and process.status() != psutil.STATUS_ZOMBIE
        ):
            found.append(f"{process.pid}: {' '.join(process.info['cmdline'] or [])[:160]}")
    return found


def modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # gone meanwhile
        return 0.0


def wait_until_clean(root: Path, timeout: float = 60) -> float:
    """Seconds until no process of the test is left; fails (after killing them) if some outlive `timeout`."""
    start = time.monotonic()
    while (left := leftovers(root)) and time.monotonic() - start < timeout:
        time.sleep(0.2)
    if left:
        for line in left:
            try:
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        pytest.fail("processes or files left behind:\n" + "\n".join(left))
    return time.monotonic() - start


@pytest.fixture
def project(cpu_env, monkeypatch, tmp_path):
    """A project folder as the working directory, with the CPU environment, the CML stand-in (its registry in the
    folder) and the fault injector (inactive unless TEXTSQL_TEST_FAULT is set) on PYTHONPATH. Nothing may be left
    running after."""
    for key, value in cpu_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(FAULTS), str(STANDIN), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    )
    monkeypatch.setenv("CML_STANDIN_DIR", str(tmp_path / ".cml-standin"))
    monkeypatch.setenv("TEXTSQL_FORWARD_ENV", "TEXTSQL_TEST_FAULT")  # the fault injector's: the user's own addition
    monkeypatch.setenv("CDSW_IP_ADDRESS", NODES[0])
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.chdir(tmp_path)
    BEFORE[str(tmp_path)] = (time.time(), set(os.listdir("/dev/shm")), set(listeners([os.getpid()])))
    yield tmp_path
    wait_until_clean(tmp_path, timeout=30)


@pytest.fixture
def clusters(project):
    """Start clusters that are stopped at the end of the test, whatever happens."""
    started = []

    def start(backend="local", lines=None, **kwargs) -> Cluster:
        lines = [] if lines is None else lines
        kwargs.setdefault("echo", lambda line: (lines.append(line), print(line)))
        cluster = Cluster(backend, **{"workers": 1, "cpu": 1, "memory": 2, "project_dir": project, **kwargs})
        started.append(cluster)
        return cluster.start()

    yield start
    for cluster in started:
        cluster.stop()


def cluster_argv(assets, runs_root, *extra, steps=10, logging_steps=5):
    return tiny_train_argv(
        assets,
        runs_root,
        *extra,
        max_steps=steps,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        learning_rate="3e-3",
        warmup_steps=2,
        logging_steps=logging_steps,
        eval_strategy="no",
        save_strategy="no",
        dataloader_num_workers=0,
        report_to="none",
    )


def check_two_pod_run(result, assets, stage, offload, steps=10):
    summary = result["summary"]
    assert summary.world_size == 2 and summary.global_step == steps
    assert summary.strategy["zero_stage"] == stage and summary.strategy["offload_optimizer"] == offload
    ranks = result["ranks"]
    assert [(r["rank"], r["node_address"], r["world_size"], r["global_step"]) for r in ranks] == [
        (0, NODES[0], 2, steps),
        (1, NODES[1], 2, steps),
    ]
    assert ranks[0]["final_loss"] == pytest.approx(ranks[1]["final_loss"], rel=1e-6)
    assert ranks[0]["logged_losses"][-1] < ranks[0]["logged_losses"][0]
    # Each rank's memory and the real tokens of both, gathered without a pickle (distributed.gather_fields).
    memory = summary.peak_memory_per_rank
    assert [(m["rank"], m["device"]) for m in memory] == [(0, "cpu"), (1, "cpu")] and summary.real_tokens > 0
    assert all(m["host"] == socket.gethostname() and m["cpu_peak_rss_bytes"] > 2**20 for m in memory)
    for address in NODES:  # each pod's log, and torchrun's files of its rank's output (--log-dir)
        assert (result["launch_dir"] / f"pod-{address}.log").is_file()
        assert list((result["launch_dir"] / f"torchrun-{address}").rglob("stdout.log")), address
    # Rank 0 reports the training (rank 1 prints nothing now that the packages' noise is filtered).
    rank0 = (result["launch_dir"] / f"torchrun-{NODES[0]}").rglob("std*.log")
    assert "".join(p.read_text() for p in rank0).strip()


def listeners(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """(pid, name, address, port) of every listening TCP socket of these processes and their descendants."""
    import psutil

    found = []
    for pid in pids:
        try:
            processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            continue
        for process in processes:
            try:
                found += [
                    (process.pid, process.name(), c.laddr.ip, c.laddr.port)
                    for c in process.net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN
                ]
            except psutil.Error:
                pass
    return found


def rank_pids(project: Path, round_: int = 0) -> dict[int, int]:
    """Each rank's process id in a round, from the records the ranks write when they start (the newest launch's)."""
    pids = {}
    for path in sorted(project.glob(f".textsql/cluster/*/launches/*/ranks/r{round_}-rank-*.started.json")):
        record = json.loads(path.read_text())
        pids[record["rank"]] = record["pid"]
    return pids


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def cmdline_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")


def launch_pids(cluster: Cluster) -> list[int]:
    """Every process of a launch's pods now: the local pods' trees and the CML stand-in workers' (by their id)."""
    import psutil

    roots = [p.process.pid for p in cluster.pods if p.process is not None]
    ids = {p.worker_id for p in cluster.pods if p.worker_id}
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if ids and process.environ().get("CDSW_ENGINE_ID") in ids and process.ppid() not in roots:
                roots.append(process.pid)
    pids = []
    for root in roots:
        with contextlib.suppress(psutil.Error):
            pids += [root, *(c.pid for c in psutil.Process(root).children(recursive=True))]
    return sorted(set(pids))


def files_holding(root: Path, needle: str) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if (
            path.is_file()
            and not path.is_symlink()
            and path.stat().st_size < 50_000_000
            and needle.encode() in path.read_bytes()
        ):
            found.append(str(path.relative_to(root)))
    return found


def key_files(root: Path) -> list[str]:
    """Anything in the project folder that is, or is named like, an ssh private key or an authorized_keys file."""
    import re

    named = re.compile(r"^(?:authorized_keys2?|id_(?:rsa|dsa|ecdsa|ed25519)(?:_sk)?|ssh_host_.*_key|known_hosts)$")
    found = [str(p.relative_to(root)) for p in root.rglob("*") if named.match(p.name)]
    return found + files_holding(root, "-----BEGIN OPENSSH " + "PRIVATE KEY-----")


def on_line(text: str, action, echo_next=print):
    """An echo that passes every line on (to print, or another such echo) and calls action(line) once, on the first
    line containing `text`."""
    done = []

    def echo(line):
        echo_next(line)
        if text in line and not done:
            done.append(line)
            action(line)

    return echo


def interrupt_soon(delay: float = 0.0) -> None:
    """A Ctrl-C for this process (a notebook kernel's interrupt), after `delay` seconds, wherever the main thread is."""
    threading.Timer(delay, os.kill, args=(os.getpid(), signal.SIGINT)).start()


# ---------------------------------------------------------------------------------------------------------------------
# Two pods, for real
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_pods_zero2_full_fine_tuning_local_backend(assets, project, clusters, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", CANARY)  # a secret in the session: it must reach no pod, rank, log or file
    monkeypatch.setenv("TEXTSQL_TEST_PASSWORD", CANARY)
    for name, value in UNKNOWN_SECRETS.items():  # secrets under names no filter knows: not asked for, not forwarded
        monkeypatch.setenv(name, value)
    for name, value in (("NCCL_DEBUG", "WARN"), ("DS_TEXTSQL_TEST", "reached")):
        monkeypatch.setenv(name, value)  # a user's tuning and debugging variables: they must reach every rank
    monkeypatch.delenv("OMP_NUM_THREADS")  # textsql chooses: each local pod has 1 of this machine's cores
    seen, lines = {}, []
    # Sockets this test process had before: another test's in-process training leaves torch's TCPStore listening on
    # every address (its rendezvous store outlives destroy_process_group); not the cluster's doing.
    before = {(pid, address, port) for pid, _, address, port in listeners([os.getpid()])}

    def snapshot(line):
        seen["listeners"] = listeners([os.getpid()])
        seen["environ"] = {rank: environ_of(pid) for rank, pid in rank_pids(project).items()}
        seen["every environ"] = [environ_of(pid) for pid in launch_pids(cluster)]  # the pods' and the ranks'

    echo = on_line("Training starts", snapshot)
    cluster = clusters("local", echo=lambda line: (lines.append(line), echo(line)))
    runs = project / "runs $HOME;`id` *"
    argv = cluster_argv(
        assets, runs, "--deepspeed", "zero2", "--run_name", "a b;$(touch pwned) `touch pwned2` * 'q' \"q\" é\\"
    )
    result = cluster.train(argv)
    check_two_pod_run(result, assets, stage=2, offload="none")
    check_model_reloads_and_generates(Path(result["summary"].output_dir), assets[1])
    for rank in result["ranks"]:  # the training arguments reached both ranks exactly, through no shell
        check_rank_arguments(rank, argv)
    assert not list(project.rglob("pwned*")) and Path(result["summary"].output_dir).parent == runs
    assert "--rdzv-backend" in result["command"] and "c10d" in result["command"]
    assert sorted(seen["environ"]) == [0, 1]
    # The launch's key (issue 53): in no environment of its processes, a pod's, its torchrun's or a rank's.
    assert len(seen["every environ"]) >= 4 and cluster.key not in json.dumps(seen["every environ"])
    for env in seen["environ"].values():
        assert env["NCCL_DEBUG"] == "WARN" and env["DS_TEXTSQL_TEST"] == "reached" and env["DS_ACCELERATOR"] == "cpu"
        assert env["OMP_NUM_THREADS"] == "1" and env["GLOO_SOCKET_IFNAME"] == "lo"
        assert "HF_TOKEN" not in env and "TEXTSQL_TEST_PASSWORD" not in env and CANARY not in json.dumps(env)
        assert not set(UNKNOWN_SECRETS) & set(env)
    # No textsql process listens beyond the pods' own addresses: the session's rendezvous store, each torchrun's
    # store and gloo are bound to 127.0.0.x, never to every address; no port takes orders (there is none left).
    new = [s for s in seen["listeners"] if (s[0], s[2], s[3]) not in before]
    assert new and all(s[2] in NODES for s in new), new
    cluster.stop()
    wait_until_clean(project)
    assert CANARY not in "\n".join(lines) and files_holding(project, CANARY) == []
    assert key_files(project) == []


# Relative, each step's loss after a resize against the uninterrupted run's. Measured (2026-12-07): ZeRO-2 within
# 1e-7; ZeRO-3 step 5 exact, then drifting to 6e-4 by step 8 at world size 1 (its cause not found yet).
RESIZE_TOLERANCE = {"zero2": 1e-4, "zero3": 2e-3}


def logged_losses(run: Path, checkpoint: str = "checkpoint-8") -> dict[int, float]:
    state = json.loads((run / checkpoint / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_a_zero_run_of_two_ranks_resumes_at_one_and_three_ranks_with_its_global_batch(assets, project, clusters, stage):
    """8 steps at world size 2 (gradient accumulation 3: 6 micro-batches of 4 a step), saved at step 4; that run's
    folder as an interruption after checkpoint-4 leaves it (a copy without its later files) resumed at world size 1
    (accumulation 6) and 3 (accumulation 2): checkpoint-4 converted to DeepSpeed's universal format, steps 5-8 each
    within RESIZE_TOLERANCE of the uninterrupted run's loss: the weights, Adam's moments and the data position restored
    (ZeRO-2 to the last digits; ZeRO-3 drifts a little, see RESIZE_TOLERANCE)."""
    from textsql.cluster.runs import RECORD

    def argv(run):
        flags = ("--deepspeed", stage, "--output_dir", str(run), "--save_strategy", "steps", "--save_steps", "4")
        batch = ("--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "3")
        return cluster_argv(assets, project / "runs", *flags, *batch, steps=8, logging_steps=1)

    whole = project / "whole"
    assert clusters("local").train(argv(whole))["summary"].global_step == 8
    expected = logged_losses(whole)
    print("uninterrupted, world size 2:", expected)
    for size in (1, 3):
        run = project / f"resumed-at-{size}"
        shutil.copytree(whole, run, ignore=lambda d, names: {"checkpoint-8", "run_summary.json"} & set(names))
        lines = []
        result = clusters("local", workers=size - 1, name=f"size-{size}", lines=lines).train(argv(run))
        summary = result["summary"]
        assert (summary.world_size, summary.global_step) == (size, 8)
        assert (
            Path(summary.resumed_from).name == "checkpoint-4" and (run / "checkpoint-4" / "latest_universal").is_file()
        )
        record = json.loads((run / RECORD).read_text())
        assert (record["world_size"], record["gradient_accumulation_steps"]) == (size, 6 // size)
        assert any(
            f"resumed at {size}: gradient accumulation {6 // size} keeps its global batch" in line for line in lines
        )
        losses = logged_losses(run)
        print(f"resumed at world size {size}:", losses)
        assert sorted(losses) == list(range(1, 9))
        for step in range(5, 9):
            assert abs(losses[step] - expected[step]) <= RESIZE_TOLERANCE[stage] * expected[step], (
                step,
                losses,
                expected,
            )
    wait_until_clean(project)


@pytest.mark.slow
def test_lora_on_a_causal_lm_on_two_pods_through_the_cml_standin(causal_assets, project, clusters, monkeypatch):
    """The causal road across pods: a LoRA adapter on the tiny Qwen2 (all linear layers), two pods of the CML
    stand-in; the T5 road's two-pod run is the ZeRO-2 test above."""
    assets = causal_assets
    monkeypatch.setenv("HF_TOKEN", CANARY)
    for name, value in UNKNOWN_SECRETS.items():  # the stand-in gives the worker every variable, as CML gives the
        monkeypatch.setenv(name, value)  # project's: the worker's pod keeps none of them for its ranks
    monkeypatch.setenv("CML_STANDIN_SCHEDULE_DELAY", "2")  # the worker pod starts late, well within the timeout
    import cml.workers_v1 as standin

    from textsql.cluster.launch import decode

    standin.calls.clear()
    seen = {}

    def snapshot(line):
        seen.update({r: environ_of(pid) for r, pid in rank_pids(project).items()})
        seen["every"] = [(environ_of(pid), cmdline_of(pid)) for pid in launch_pids(cluster)]

    cluster = clusters("cml", nvidia_gpu=1, echo=on_line("Training starts", snapshot))
    argv = cluster_argv(assets, project / "runs", "--lora", "True", "--lora_targets", "all", "--learning_rate", "1e-2")
    result = cluster.train(argv)
    (launch,) = [c for c in standin.calls if c[0] == "launch_workers"]
    assert launch[1:7] == (1, 1, 2, 1, True, False)  # n, cpu, memory, nvidia_gpu, code, no script
    env = launch[7]  # what the pod learns in its environment: the launch's spec, no secret, no key
    assert sorted(env) == ["TEXTSQL_LAUNCH", "TEXTSQL_POD_RANKS"] and CANARY not in json.dumps(env)
    assert CANARY not in json.dumps(decode(env["TEXTSQL_LAUNCH"]))
    assert set(seen) == {0, 1, "every"} and all(CANARY not in json.dumps(seen[rank]) for rank in (0, 1))
    # The launch's heartbeat key (issue 53): in no environment or command line of any process of the launch (the
    # worker's is in the code CML runs), in no file or log.
    key = cluster.key
    assert len(key) == 64 and len(seen["every"]) >= 4 and key not in json.dumps(seen) and key not in str(result)
    check_two_pod_run(result, assets, stage=None, offload="none")
    assert result["summary"].lora and (Path(result["summary"].output_dir) / "adapter_model.safetensors").exists()
    assert standin.calls[-1][0] == "stop_workers" and [w["status"] for w in standin.list_workers()] == ["stopped"]
    wait_until_clean(project)
    assert files_holding(project, CANARY) == [] and files_holding(project, key) == [] and key_files(project) == []


# ---------------------------------------------------------------------------------------------------------------------
# User-managed nodes: pdsh over the user's own ssh setup
# ---------------------------------------------------------------------------------------------------------------------

SSHD_CONFIG = """\
Port 2222
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitRootLogin prohibit-password
PidFile none
LogLevel ERROR
"""


@pytest.fixture
def user_ssh(tmp_path_factory):
    """The user's own ssh setup (made by the test, outside the project): an sshd on 127.0.0.1 and 127.0.0.2 port
    2222, a client key, known_hosts with both host keys, and an ssh config naming them. Stopped at the end."""
    missing = [
        name
        for name in ("sshd", "ssh", "ssh-keygen", "pdsh")
        if not (shutil.which(name) or os.access(f"/usr/sbin/{name}", os.X_OK))
    ]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian/Ubuntu: apt-get install pdsh openssh-server openssh-client)")
    home = tmp_path_factory.mktemp("user-ssh")
    keygen = lambda path: subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)  # noqa: E731
    keygen(home / "client")
    (home / "authorized").write_text((home / "client.pub").read_text())
    (home / "sshd_config").write_text(SSHD_CONFIG)
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    servers, known = [], []
    try:
        for address in NODES:
            keygen(home / f"host-{address}")
            sshd = shutil.which("sshd") or "/usr/sbin/sshd"
            servers.append(
                subprocess.Popen(
                    [
                        sshd,
                        "-D",
                        "-e",
                        "-f",
                        str(home / "sshd_config"),
                        "-o",
                        f"ListenAddress={address}",
                        "-o",
                        f"HostKey={home / f'host-{address}'}",
                        "-o",
                        f"AuthorizedKeysFile={home / 'authorized'}",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            known.append(f"[{address}]:2222 " + " ".join((home / f"host-{address}.pub").read_text().split()[:2]))
        (home / "known_hosts").write_text("\n".join(known) + "\n")
        (home / "config").write_text(
            f"Host {' '.join(NODES)}\n  Port 2222\n  IdentityFile {home / 'client'}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {home / 'known_hosts'}\n  GlobalKnownHostsFile /dev/null\n"
        )
        deadline = time.monotonic() + 20
        for address in NODES:
            while True:
                try:
                    socket.create_connection((address, 2222), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"sshd on {address} did not start"
                    time.sleep(0.1)
        yield home
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=10)


class ProcessWatch:
    """The command line of every process working in the project folder (the machine is shared with other tests), and
    the environment of the launch's own (DeepSpeed's runner, pdsh, each node's launcher, the ranks),
    looked at twice a second while a launch runs."""

    LAUNCH = (
        "deepspeed.launcher",
        "pdsh",
        "textsql.cluster.rank",
    )  # pdsh's ssh inherits pdsh's environment

    def __init__(self, project: Path):
        self.project = str(project)
        self.argv_hits, self.env_hits, self.rank_envs = [], [], []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def run(self):
        import psutil

        while not self.stop.is_set():
            for process in psutil.process_iter():
                if process.pid == os.getpid():
                    continue
                try:
                    cwd = process.cwd()
                    if cwd != self.project and not cwd.startswith(self.project + os.sep):
                        continue
                    command = " ".join(process.cmdline())
                    if CANARY in command:
                        self.argv_hits.append(f"{process.pid}: {command[:300]}")
                    if any(word in command for word in self.LAUNCH):
                        environ = process.environ()
                        if any(CANARY in value for value in environ.values()):
                            self.env_hits.append(f"{process.pid}: {command[:200]}")
                        if "textsql.cluster.rank" in command:
                            self.rank_envs.append(dict(environ, COMMAND_SEEN=command))
                except psutil.Error:
                    continue
            self.stop.wait(0.5)


@pytest.mark.slow
def test_user_managed_nodes_train_over_pdsh_a_wrong_host_key_is_refused_and_an_excluded_host_is_left_alone(
    assets, project, user_ssh, monkeypatch
):
    import pwd

    from textsql.cluster import HostSelection, launch_training, preflight
    from textsql.train.distributed import free_port

    # Secrets in the session's environment (what DeepSpeed's runner would export to every node on pdsh's command line),
    # and a .deepspeed_env whose line a remote shell would run: none reaches argv, a rank or a shell.
    for name in ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "HF_KEY", "TEXTSQL_DB_PWD", "HF_TOKEN"):
        monkeypatch.setenv(name, CANARY)
    monkeypatch.setenv("TEXTSQL_DB_URL", f"postgresql://textsql:{CANARY}@127.0.0.1/wikisql")
    monkeypatch.setenv("TEXTSQL_PROBE", "reaches the ranks")
    marker = project / "deepspeed-env-ran"
    (project / ".deepspeed_env").write_text(f"TEXTSQL_FROM_FILE=$(touch {marker})\n")
    (project / "hostfile").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    argv = cluster_argv(assets, project / "runs", steps=4, logging_steps=2)
    said = []
    with ProcessWatch(project) as watch:
        result = launch_training(
            project / "hostfile",
            argv,
            ssh_config=user_ssh / "config",
            echo=lambda line: (said.append(line), print(line)),
        )
    assert "--launcher" in result["command"] and result["command"][result["command"].index("--launcher") + 1] == "pdsh"
    ranks = result["ranks"]
    assert [(r["rank"], r["node_address"], r["world_size"], r["global_step"]) for r in ranks] == [
        (0, NODES[0], 2, 4),
        (1, NODES[1], 2, 4),
    ]
    assert ranks[0]["final_loss"] == pytest.approx(ranks[1]["final_loss"], rel=1e-6)
    check_rank_arguments(ranks[1], argv)
    assert watch.argv_hits == [] and watch.env_hits == []
    assert watch.rank_envs and not any("TEXTSQL_PROBE" in env for env in watch.rank_envs)  # nothing of the session's
    assert not marker.exists() and any("ignoring " + str(project / ".deepspeed_env") in line for line in said)
    assert CANARY not in "\n".join(said) and files_holding(project, CANARY) == []
    wait_until_clean(project)

    # A working folder whose name a remote shell would run ($(...) in DeepSpeed's unquoted `cd`): refused before any ssh.
    planted = f"textsql-marker-{os.getpid()}"
    home_marker = Path(pwd.getpwuid(os.getuid()).pw_dir) / planted
    folder = project / f"w$(touch {planted})"
    folder.mkdir()
    try:
        with pytest.raises(
            TextsqlError, match=r"The working folder .* holds characters a shell interprets \(' \$\(\)'\)"
        ):
            launch_training(
                project / "hostfile",
                cluster_argv(assets, project / "runs2", steps=2),
                ssh_config=user_ssh / "config",
                workdir=folder,
            )
        assert not home_marker.exists()
    finally:
        home_marker.unlink(missing_ok=True)
    wait_until_clean(project)

    # Another machine answers at 127.0.0.2 (its host key is not the known one): refused before anything starts.
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(user_ssh / "impostor")], check=True)
    known = (user_ssh / "known_hosts").read_text().splitlines()
    known[1] = "[127.0.0.2]:2222 " + " ".join((user_ssh / "impostor.pub").read_text().split()[:2])
    (user_ssh / "known_hosts").write_text("\n".join(known) + "\n")
    with pytest.raises(PreflightError) as refused:  # before anything starts
        preflight(project / "hostfile", argv, ssh_config=user_ssh / "config")
    message = str(refused.value)
    assert (
        "127.0.0.2: ssh refused 127.0.0.2: its host key is not the one in your known_hosts" in message
        and "127.0.0.1" not in message
    )
    assert key_files(project) == []

    # The same hostfile with 127.0.0.2 excluded (DeepSpeed's --exclude) and a chosen port: one node trains, and the
    # excluded one is never contacted (its impostor key would be refused).
    port = free_port()
    result = launch_training(
        project / "hostfile",
        cluster_argv(assets, project / "runs-excluded", steps=2),
        ssh_config=user_ssh / "config",
        selection=HostSelection(exclude=NODES[1], master_port=port),
    )
    assert [(r["rank"], r["node_address"], r["world_size"], r["global_step"]) for r in result["ranks"]] == [
        (0, NODES[0], 1, 2)
    ]
    command = result["command"]
    assert command[command.index("--master_port") + 1] == str(port)
    wait_until_clean(project)


# ---------------------------------------------------------------------------------------------------------------------
# The notebook
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_notebook_trains_on_two_local_pods(assets, project, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", CANARY)
    data_dir, model_dir = assets
    notebook = execute(
        "train_multi_pod.ipynb",
        project,
        {
            "backend": "local",
            "workers": 1,
            "cpu": 1,
            "memory": 2,
            "model_id": str(model_dir),
            "dataset_dir": str(data_dir),
            "deepspeed": "zero2",
            "per_device_train_batch_size": 16,
            "limits": {"first_step_timeout": 600},
            "extra_args": {
                "max_steps": 6,
                "logging_steps": 3,
                "eval_strategy": "no",
                "save_strategy": "no",
                "dataloader_num_workers": 0,
            },
        },
    )
    text = outputs_text(notebook)
    assert (
        "127.0.0.1" in text and "127.0.0.2" in text and "preflight OK" in text and "world size 2 on CPUs (gloo)" in text
    )
    assert "--rdzv-backend c10d" in text and "[default0]:" in text and "final_loss" in text
    assert CANARY not in text and files_holding(project, CANARY) == []
