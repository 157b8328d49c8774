"""Multi-node training for real on this machine: two nodes (127.0.0.1 and 127.0.0.2), each a real sshd on port 2222
started with docker/sshd_config, real pdsh, the real `deepspeed` launcher, gloo on the CPU.

Local backend and the CML backend (against the stand-in `cml.workers_v1` in tests/cml_standin), ZeRO-2 and ZeRO-3 +
offload, a rank killed mid-training, a host key that is not the published one, and the notebook. Every fixture stops
what it started, and checks that nothing is left listening on port 2222.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_notebooks import execute, outputs_text
from test_train import check_model_reloads_and_generates

from textsql.cluster import Cluster, LaunchFailed, LocalBackend, PreflightError

REPO = Path(__file__).resolve().parent.parent
SSHD_CONFIG = REPO / "docker" / "sshd_config"
STANDIN = Path(__file__).resolve().parent / "cml_standin"
NODES = ("127.0.0.1", "127.0.0.2")
PORT = 2222

missing = [name for name in ("sshd", "ssh", "ssh-keygen", "pdsh") if not (shutil.which(name) or os.access(f"/usr/sbin/{name}", os.X_OK))]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (Debian/Ubuntu: apt-get install pdsh openssh-server openssh-client)")


def listening(address: str, port: int = PORT) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture
def project(cpu_env, monkeypatch, tmp_path):
    """A project folder as the working directory, with the CPU environment; nothing may be left listening afterwards."""
    for address in NODES:
        if listening(address):
            pytest.fail(f"something already listens on {address}:{PORT}; the cluster tests need that port")
    for key, value in cpu_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TEXTSQL_SSHD_CONFIG", str(SSHD_CONFIG))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    deadline = time.monotonic() + 15
    while any(listening(a) for a in NODES) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(listening(a) for a in NODES), "an sshd the test started is still listening"


@pytest.fixture
def clusters(project):
    """Start clusters that are stopped at the end of the test, whatever happens."""
    started = []

    def start(backend="local", **kwargs) -> Cluster:
        lines = kwargs.pop("lines", [])
        cluster = Cluster(backend, workers=1, cpu=1, memory=2, project_dir=project, echo=lambda line: (lines.append(line), print(line)), **kwargs)
        started.append(cluster)
        return cluster.start()

    yield start
    for cluster in started:
        cluster.stop()


def cluster_argv(assets, runs_root, *extra, steps=10):
    data_dir, model_dir = assets
    return ["--model_id", str(model_dir), "--dataset_dir", str(data_dir), "--runs_root", str(runs_root), "--max_steps", str(steps),
            "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "32", "--learning_rate", "3e-3", "--warmup_steps", "2",
            "--logging_steps", "5", "--eval_strategy", "no", "--save_strategy", "no", "--dataloader_num_workers", "0", *extra]


def check_two_node_run(result, assets, stage, offload, steps=10):
    summary = result["summary"]
    assert summary["world_size"] == 2 and summary["global_step"] == steps
    assert summary["strategy"]["zero_stage"] == stage and summary["strategy"]["offload_optimizer"] == offload
    assert sorted(m["rank"] for m in summary["peak_memory_per_rank"]) == [0, 1]
    ranks = result["ranks"]
    for rank in ranks:
        print(f"rank {rank['rank']} on node {rank['node_address']}: world size {rank['world_size']}, step {rank['global_step']}, "
              f"final loss {rank['final_loss']:.6f}, train loss {rank['train_loss']:.6f}")
    assert [(r["rank"], r["node_address"], r["world_size"], r["global_step"]) for r in ranks] == [(0, NODES[0], 2, steps), (1, NODES[1], 2, steps)]
    assert ranks[0]["final_loss"] == pytest.approx(ranks[1]["final_loss"], rel=1e-6)
    assert ranks[0]["train_loss"] == pytest.approx(ranks[1]["train_loss"], rel=1e-6)
    assert ranks[0]["logged_losses"][-1] < ranks[0]["logged_losses"][0]
    assert "Running training" in (result["launch_dir"] / "rank-0.log").read_text()  # each rank's own log, kept
    assert (result["launch_dir"] / "rank-1.log").exists() and "[rank 1]" in (result["launch_dir"] / "launch.log").read_text()
    check_model_reloads_and_generates(Path(summary["output_dir"]), assets[1])


def listeners_of_descendants() -> list[tuple[int, str, str, int]]:
    """(pid, name, address, port) of every listening TCP socket of this process's descendants."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            found += [(child.pid, child.name(), c.laddr.ip, c.laddr.port) for c in child.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
    return found


@pytest.mark.slow
def test_two_nodes_zero2_local_backend(assets, project, clusters):
    lines = []
    cluster = clusters("local", lines=lines)
    assert cluster.hostfile.read_text() == "127.0.0.1 slots=1\n127.0.0.2 slots=1\n"
    snapshot = []

    def echo(line):
        lines.append(line)
        print(line)
        if "Running training" in line and not snapshot:
            snapshot.extend(listeners_of_descendants())

    cluster.echo = echo
    result = cluster.train(cluster_argv(assets, project / "runs", "--deepspeed", "zero2"))
    command = result["command"]
    assert command[command.index("--launcher") + 1] == "pdsh" and command[command.index("--ssh_port") + 1] == "2222"
    assert command[command.index("--master_addr") + 1] == "127.0.0.1" and "--hostfile" in command and "--no_ssh_check" in command
    env = dict(line.split("=", 1) for line in (result["launch_dir"] / ".deepspeed_env").read_text().splitlines())
    assert env["DS_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"] == "1" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["PATH"].startswith(str(Path(sys.executable).parent))
    assert any(line.startswith("127.0.0.2: [rank 1] ") for line in lines), "rank 1's output did not stream through pdsh"
    assert result["shared_output"] is True
    check_two_node_run(result, assets, stage=2, offload="none")

    # Everything the test started listens on loopback only; the one exception is torch's rendezvous store, which rank 0
    # opens on MASTER_PORT for every address (torch has no setting for its bind address).
    master_port = int(command[command.index("--master_port") + 1])
    assert {(a, p) for _, name, a, p in snapshot if name == "sshd"} == {(NODES[0], PORT), (NODES[1], PORT)}
    outside = [s for s in snapshot if not s[2].startswith("127.") and s[3] != master_port]
    assert snapshot and not outside, outside
    cluster.stop()
    assert not any(listening(a) for a in NODES)


@pytest.mark.slow
def test_two_nodes_zero3_offload_cml_backend_against_the_standin(assets, project, clusters, monkeypatch):
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.setenv("CDSW_IP_ADDRESS", NODES[0])
    monkeypatch.setenv("CML_STANDIN_LOG_DIR", str(project))
    import cml.workers_v1 as standin

    standin.calls.clear()
    cluster = clusters("cml", nvidia_gpu=1)
    (launch,) = [c for c in standin.calls if c[0] == "launch_workers"]
    assert launch[1:6] == (1, 1, 2, 1, True)  # n, cpu, memory, nvidia_gpu, code
    assert ("await_workers", [cluster.nodes[0].id], False) == standin.calls[1][:3]
    assert cluster.hostfile.read_text() == "127.0.0.1 slots=1\n127.0.0.2 slots=1\n"
    result = cluster.train(cluster_argv(assets, project / "runs", "--deepspeed", "zero3_offload"))
    check_two_node_run(result, assets, stage=3, offload="cpu")
    cluster.stop()
    assert standin.calls[-1] == ("stop_workers", cluster.nodes[0].id)
    assert [w["status"] for w in standin.list_workers()] == ["stopped"]


@pytest.mark.slow
def test_a_dead_rank_ends_the_launch_within_60s_and_the_next_launch_resumes(assets, project, clusters):
    argv = cluster_argv(assets, project / "runs", "--deepspeed", "zero2", "--save_strategy", "steps", "--save_steps", "10", steps=30)
    output_dir = project / "runs" / "tiny-t5-zero2-ws2-bs16"
    cluster = clusters("local")
    killed = {}

    def kill_rank_1_after_first_checkpoint():
        checkpoint = output_dir / "checkpoint-10"
        deadline = time.monotonic() + 300
        while not ((checkpoint / "trainer_state.json").exists() and (checkpoint / "rng_state_1.pth").exists()):
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        time.sleep(0.5)
        pid = int(next((cluster.dir / "launches").glob("*/rank-1.pid")).read_text())
        os.kill(pid, signal.SIGKILL)
        killed.update(pid=pid, at=time.monotonic())

    killer = threading.Thread(target=kill_rank_1_after_first_checkpoint, daemon=True)
    killer.start()
    with pytest.raises(LaunchFailed) as failure:
        cluster.train(argv)
    ended = time.monotonic()
    killer.join(timeout=5)
    assert "at" in killed, "rank 1 was never killed: training ended or stalled before its first checkpoint"
    assert ended - killed["at"] < 60
    message = str(failure.value)
    print(message)
    assert message.startswith("Rank 1 on 127.0.0.2") and "killed by SIGKILL" in message and "rank-1.log" in message
    assert failure.value.failures[0]["rank"] == 1 and failure.value.failures[0]["pid"] == killed["pid"]
    launch_id = failure.value.launch_dir.name
    assert subprocess.run(["pgrep", "-f", f"[-]-textsql_launch={launch_id}"]).returncode == 1, "a process of the failed launch is left"
    assert not cluster.started and not any(listening(a) for a in NODES), "the workers were not stopped"
    assert not (output_dir / "run_summary.json").exists()

    again = clusters("local")
    result = again.train(argv)
    summary = result["summary"]
    assert Path(summary["resumed_from"]).name in ("checkpoint-10", "checkpoint-20")
    assert summary["global_step"] == 30 and [r["global_step"] for r in result["ranks"]] == [30, 30]
    assert result["ranks"][0]["final_loss"] == pytest.approx(result["ranks"][1]["final_loss"], rel=1e-6)


class PrivateRunsBackend(LocalBackend):
    """Local workers whose `runs` folder is their own (a tmpfs in a private mount namespace): no shared output folder."""

    def __init__(self, private_dir: Path):
        super().__init__()
        self.private_dir = private_dir

    def launch(self, n, spec, argv, log_dir):
        private = ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount -t tmpfs textsql-test "$0" && exec "$@"', str(self.private_dir)]
        return super().launch(n, spec, private + argv, log_dir)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="a private mount namespace for a local worker needs root")
def test_without_a_shared_output_folder_each_node_saves_its_checkpoints_and_resumes(assets, project, clusters):
    runs = project / "runs"
    runs.mkdir()
    cluster = clusters(PrivateRunsBackend(runs))
    first = cluster.train(cluster_argv(assets, runs, "--deepspeed", "zero2", "--save_strategy", "steps", "--save_steps", "5"))
    assert first["shared_output"] is False and "--save_on_each_node" in first["command"]
    checkpoint = runs / "tiny-t5-zero2-ws2-bs16" / "checkpoint-10" / "global_step10"
    node_1 = subprocess.run(["ssh", "-F", str(cluster.ssh_config), NODES[1], f"ls {checkpoint}"], capture_output=True, text=True, check=True).stdout.split()
    assert sorted(node_1) == ["mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert sorted(p.name for p in checkpoint.iterdir()) == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    (checkpoint.parent.parent / "run_summary.json").unlink()  # now an interrupted run, to be continued to step 15
    second = cluster.train(cluster_argv(assets, runs, "--deepspeed", "zero2", "--save_strategy", "steps", "--save_steps", "5", steps=15))
    assert Path(second["summary"]["resumed_from"]).name == "checkpoint-10"
    assert [r["global_step"] for r in second["ranks"]] == [15, 15]
    assert second["ranks"][0]["final_loss"] == pytest.approx(second["ranks"][1]["final_loss"], rel=1e-6)


def test_a_node_whose_host_key_differs_from_the_published_one_is_refused(assets, project, clusters):
    from textsql.cluster.workers import stop_processes, worker_argv

    cluster = clusters("local")
    key = cluster.key_dir / "id_ed25519"
    assert oct(key.stat().st_mode & 0o777) == "0o600" and oct(cluster.key_dir.stat().st_mode & 0o777) == "0o700"
    assert (cluster.dir / "hostkeys" / "127.0.0.2.json").exists() and len(cluster.known_hosts.read_text().splitlines()) == 2
    # An impostor takes over 127.0.0.2:2222 with a host key of its own (and publishes it, too late: known_hosts is built).
    cluster.backend.stop(cluster.nodes)
    deadline = time.monotonic() + 10
    while listening(NODES[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    impostor = subprocess.Popen(worker_argv(cluster.dir, "impostor", PORT, SSHD_CONFIG, NODES[1]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while not listening(NODES[1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(PreflightError) as refused:
            cluster.preflight(cluster_argv(assets, project / "runs"))
    finally:
        stop_processes([impostor])
    message = str(refused.value)
    assert "127.0.0.2: ssh refused 127.0.0.2: its host key is not the one it published" in message
    assert "127.0.0.1" not in message.split("\n", 1)[1], "node 0 should have passed"
    assert not cluster.started  # a failed preflight stops the workers


def test_a_worker_whose_sshd_cannot_start_fails_the_start_with_its_log(project, clusters):
    from textsql.errors import TextsqlError

    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the port may be in TIME_WAIT from an earlier test
        taken.bind((NODES[1], PORT))
        taken.listen()
        with pytest.raises(TextsqlError) as failed:
            clusters("local")
    message = str(failed.value)
    assert message.startswith("Cluster start failed: node(s) ended before its sshd was up: 127.0.0.2 (exited with status 1)")
    assert "worker-127.0.0.2.log" in message and "Address already in use" in message


def test_the_folder_of_the_project_key_is_ignored_by_git():
    """The repository-wide scan for private keys is tests/test_docker.py::test_repository_has_no_private_keys. Here: the
    folder textsql makes the project key in at run time is ignored by git, so a CML project (a git checkout) cannot commit it."""
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", ".textsql/ssh/id_ed25519"])
    assert ignored.returncode == 0, "add .textsql/ to .gitignore: it holds the project's private key and each cluster's state"


@pytest.mark.slow
def test_notebook_trains_on_two_local_nodes(assets, project):
    data_dir, model_dir = assets
    notebook = execute("deepspeed_train.ipynb", project, {
        "backend": "local", "workers": 1, "cpu": 1, "memory": 2, "model_id": str(model_dir), "dataset_dir": str(data_dir),
        "deepspeed": "zero2", "per_device_train_batch_size": 16,
        "extra_args": ["--max_steps", "6", "--logging_steps", "3", "--eval_strategy", "no", "--save_strategy", "no", "--dataloader_num_workers", "0"],
    })
    text = outputs_text(notebook)
    assert "127.0.0.1 slots=1" in text and "127.0.0.2 slots=1" in text and "preflight OK" in text
    assert "--launcher pdsh" in text and "[rank 1]" in text and "world size 2" in text and "final_loss" in text
    assert "stopped 1 worker(s)" in text
