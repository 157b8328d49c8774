"""Multi-node training for real on this machine: two nodes (127.0.0.1 and 127.0.0.2), each a node agent started by
the local backend or by the CML stand-in (tests/cml_standin: the `cml.workers_v1` signatures, real local processes),
the real `deepspeed --no_ssh` launcher on each node, gloo on the CPU; and user-managed nodes over real pdsh and sshd.

ZeRO-2 and ZeRO-3 + offload across two nodes; every fault of issue #13 (a rank killed mid-step, killed while saving,
the disk full while saving, workers that never start or never connect or die at start, Ctrl-C and a dead kernel at
each phase, a second launch into a running one, another world size, nodes without a shared run folder); the canary
secret never in a log or the notebook. Fault tests run plain DDP ranks (no DeepSpeed config): DeepSpeed adds nothing
to what they prove. Every test checks that nothing it started is left running.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import tiny_train_argv
from test_notebooks import execute, outputs_text
from test_train import check_model_reloads_and_generates

from textsql.cluster import Cluster, LaunchFailed, LocalBackend, PreflightError
from textsql.errors import TextsqlError

TESTS = Path(__file__).resolve().parents[1]
STANDIN = TESTS / "cml_standin"
FAULTS = TESTS / "faults"
NODES = ("127.0.0.1", "127.0.0.2")
CANARY = "hf_canary_7c1d0e5a9b3f24680"
ROOT = os.geteuid() == 0


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------------------------------


def check_rank_arguments(rank: dict, argv: list[str]):
    """A rank trained with exactly the arguments of `argv` (parsed once, on the session), plus what the launch decided
    for every rank: the CPU, fp32 (the Trainer's own precision flags folded in) and the DeepSpeed file every node reads."""
    from textsql.train.arguments import arguments_dict, parse_arguments

    decided = {"accelerator": "cpu", "precision": "fp32", "bf16": False, "fp16": False}
    got, given = rank["arguments"], arguments_dict(*parse_arguments(argv))
    assert {k: got[k] for k in decided} == decided
    if given["deepspeed"]:
        assert Path(got["deepspeed"]).is_absolute() and Path(got["deepspeed"]).stem in (
            given["deepspeed"],
            f"node-local-{given['deepspeed']}",
        )
    same = set(given) - set(decided) - {"deepspeed", "save_on_each_node"}
    assert {k: got[k] for k in same} == {k: given[k] for k in same}


def leftovers(root: Path) -> list[str]:
    """Processes (other than this one) working in the test's project folder: agents, launchers, ranks."""
    import psutil

    found = []
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


def wait_until_clean(root: Path, timeout: float = 60) -> float:
    """Seconds until no process of the test is left; fails (after killing them) if some outlive `timeout`."""
    start = time.monotonic()
    while (left := leftovers(root)) and time.monotonic() - start < timeout:
        time.sleep(0.2)
    if left:
        for line in left:
            try:
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail("processes left running:\n" + "\n".join(left))
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
    monkeypatch.setenv("CDSW_IP_ADDRESS", NODES[0])
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.chdir(tmp_path)
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


def check_two_node_run(result, assets, stage, offload, steps=10):
    summary = result["summary"]
    assert summary.world_size == 2 and summary.global_step == steps
    assert summary.strategy["zero_stage"] == stage and summary.strategy["offload_optimizer"] == offload
    assert sorted(m["rank"] for m in summary.peak_memory_per_rank) == [0, 1]
    ranks = result["ranks"]
    for rank in ranks:
        print(
            f"rank {rank['rank']} on node {rank['node_address']}: world size {rank['world_size']}, step {rank['global_step']}, "
            f"final loss {rank['final_loss']:.6f}, train loss {rank['train_loss']:.6f}"
        )
    assert [(r["rank"], r["node_address"], r["world_size"], r["global_step"]) for r in ranks] == [
        (0, NODES[0], 2, steps),
        (1, NODES[1], 2, steps),
    ]
    assert ranks[0]["final_loss"] == pytest.approx(ranks[1]["final_loss"], rel=1e-6)
    assert ranks[0]["train_loss"] == pytest.approx(ranks[1]["train_loss"], rel=1e-6)
    assert ranks[0]["logged_losses"][-1] < ranks[0]["logged_losses"][0]
    assert "Training starts" in (result["launch_dir"] / "rank-0.log").read_text()  # each rank's own log, kept
    assert (result["launch_dir"] / "rank-1.log").exists() and "[rank 1]" in (
        result["launch_dir"] / "launch.log"
    ).read_text()
    check_model_reloads_and_generates(Path(summary.output_dir), assets[1])


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


def rank_pids(project: Path) -> dict[int, int]:
    pids = {}
    for path in project.glob(".textsql/cluster/*/launches/*/rank-*.pid"):
        pids[int(path.stem.split("-")[1])] = int(path.read_text())
    return pids


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


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
# Two nodes, for real
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_nodes_zero2_local_backend(assets, project, clusters, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", CANARY)  # a secret in the session: it must reach no rank, log or file
    monkeypatch.setenv("TEXTSQL_TEST_PASSWORD", CANARY)
    for name, value in (
        ("NCCL_DEBUG", "WARN"),
        ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        ("DS_TEXTSQL_TEST", "reached"),
    ):
        monkeypatch.setenv(name, value)  # a user's tuning and debugging variables: they must reach every rank
    monkeypatch.delenv("OMP_NUM_THREADS")  # textsql chooses: each local node has 1 of this machine's cores
    seen, lines = {}, []
    # Sockets this test process had before the cluster: another test's in-process training leaves torch's TCPStore
    # listening (its rendezvous store outlives destroy_process_group); not the cluster's doing.
    before = {(pid, address, port) for pid, _, address, port in listeners([os.getpid()])}

    def snapshot(line):
        seen["listeners"] = listeners([os.getpid()])
        seen["environ"] = {rank: environ_of(pid) for rank, pid in rank_pids(project).items()}

    echo = on_line("Training starts", snapshot)
    cluster = clusters("local", echo=lambda line: (lines.append(line), echo(line)))
    runs = project / "runs $HOME;`id` *"
    argv = cluster_argv(
        assets, runs, "--deepspeed", "zero2", "--run_name", "a b;$(touch pwned) `touch pwned2` * 'q' \"q\" é\\"
    )
    result = cluster.train(argv)
    check_two_node_run(result, assets, stage=2, offload="none")

    # The training arguments reached both ranks exactly, through no shell; device and precision decided once.
    for rank in result["ranks"]:
        check_rank_arguments(rank, argv)
        assert rank["arguments"]["run_name"] == argv[argv.index("--run_name") + 1]
    assert not list(project.rglob("pwned*")) and Path(result["summary"].output_dir).parent == runs
    assert result["command"][result["command"].index("--node_rank") + 1] == "0" and "--no_ssh" in result["command"]
    # The ranks' environment: the allowlist and textsql's choices, no secret, no cluster token.
    assert sorted(seen["environ"]) == [0, 1]
    for env in seen["environ"].values():
        assert (
            env["NCCL_DEBUG"] == "WARN"
            and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
            and env["DS_TEXTSQL_TEST"] == "reached"
        )
        assert env["DS_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"] == "1" and env["GLOO_SOCKET_IFNAME"] == "lo"
        assert "HF_TOKEN" not in env and "TEXTSQL_TEST_PASSWORD" not in env and "TEXTSQL_CLUSTER_TOKEN" not in env
        assert CANARY not in json.dumps(env)
    # Everything listens on loopback only; the one exception is torch's rendezvous store, which rank 0 opens on
    # MASTER_PORT for every address (torch has no setting for its bind address).
    master_port = int(result["command"][result["command"].index("--master_port") + 1])
    outside = [
        s
        for s in seen["listeners"]
        if not s[2].startswith("127.") and s[3] != master_port and (s[0], s[2], s[3]) not in before
    ]
    assert seen["listeners"] and not outside, outside
    cluster.stop()
    wait_until_clean(project)
    assert CANARY not in "\n".join(lines) and files_holding(project, CANARY) == []
    assert key_files(project) == []


@pytest.mark.slow
def test_two_nodes_zero3_offload_cml_backend_against_the_standin(assets, project, clusters, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", CANARY)
    monkeypatch.setenv("CML_STANDIN_SCHEDULE_DELAY", "2")  # the worker pod starts late, well within the timeout
    import cml.workers_v1 as standin

    standin.calls.clear()
    cluster = clusters("cml", nvidia_gpu=1)
    (launch,) = [c for c in standin.calls if c[0] == "launch_workers"]
    assert launch[1:7] == (1, 1, 2, 1, True, False)  # n, cpu, memory, nvidia_gpu, code, no script
    env = launch[7]  # what the pod learns, in its environment only
    assert (
        env["TEXTSQL_CLUSTER_ADDRESS"] == f"{NODES[0]}:{cluster.coordinator.port}"
        and len(env["TEXTSQL_CLUSTER_TOKEN"]) == 64
    )
    assert "HF_TOKEN" not in env and CANARY not in json.dumps(env)
    assert ("await_workers", [cluster.nodes[0].id], False) in [c[:3] for c in standin.calls]
    assert [link.address for link in cluster.links] == list(NODES)
    result = cluster.train(cluster_argv(assets, project / "runs", "--deepspeed", "zero3_offload"))
    check_two_node_run(result, assets, stage=3, offload="cpu")
    cluster.stop()
    assert standin.calls[-1] == ("stop_workers", cluster.nodes[0].id)
    assert [w["status"] for w in standin.list_workers()] == ["stopped"]
    wait_until_clean(project)
    assert files_holding(project, CANARY) == [] and key_files(project) == []


@pytest.mark.slow
def test_tune_measures_each_candidate_on_both_nodes_keeps_the_workers_and_stops_one_past_its_limit(
    assets, project, clusters
):
    """`textsql tune` through a started two-node cluster: plain DDP and ZeRO-2 measured on both nodes (world size 2), a
    DeepSpeed file that contradicts the candidate's micro-batch recorded as failed, the fastest measured again after
    it, the results, table and recipe written; then a candidate far longer than its limit stopped on every node and
    recorded as timed out. The same workers serve every candidate and are still up at the end."""
    from textsql.tune import TuneArguments, run_tune

    data_dir, model_dir = assets
    contradicting = project / "contradicting.json"  # a valid file; the training refuses micro-batch 3 against 8
    contradicting.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 3,
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "zero_optimization": {"stage": 1},
            }
        )
    )
    cluster = clusters("local")
    agents = [cluster.node0.pid] + [worker.pid for worker in cluster.nodes]
    train_argv = ["--runs_root", str(project / "runs"), "--dataloader_num_workers", "0", "--learning_rate", "1e-3"]

    def tune(folder, **settings):
        args = TuneArguments(
            model_id=str(model_dir),
            dataset_dir=str(data_dir),
            tune_dir=str(project / folder),
            global_batch_size=16,
            micro_batches="8",
            nodes=2,
            **settings,
        )
        return run_tune(args, train_argv, cluster=cluster)

    result = tune(
        "tune",
        strategies=f"none,zero2,{contradicting}",
        warmup_steps=1,
        timed_steps=2,
        repeat_top=1,
        repeats=2,
    )
    tune_dir = project / "tune"
    rows = [json.loads(line) for line in (tune_dir / "tune_results.jsonl").read_text().splitlines()]
    print(*(f"{r['key']} r{r['repeat']}: {r['status']} {r.get('samples_per_second')} {r.get('error')}" for r in rows))
    assert [(r["key"], r["repeat"], r["status"]) for r in rows[:3]] == [
        ("none-mb8-acc1", 0, "ok"),
        ("zero2-mb8-acc1", 0, "ok"),
        ("contradicting-mb8-acc1", 0, "failed"),
    ]
    assert "contradicts the training arguments" in rows[2]["error"]
    winner = max(rows[:2], key=lambda r: r["samples_per_second"])["key"]
    # After the failure the fastest (and the default settings, when they are not the fastest) were measured again.
    assert {(r["key"], r["status"]) for r in rows[3:]} == {(winner, "ok"), ("none-mb8-acc1", "ok")}
    for row in (r for r in rows if r["status"] == "ok"):
        assert row["world_size"] == 2 and row["samples_per_second"] > 0, row
        log = Path(row["log"]).read_text()  # the launch's lines, from both nodes
        assert f"{NODES[0]}: " in log and f"{NODES[1]}: " in log
    assert result.winner is not None and result.measured_now == len(rows)
    assert (tune_dir / "tune_table.md").read_text().startswith("| candidate |")
    recipe = (tune_dir / "tune_recipe.yaml").read_text()
    assert "# Measured on 2 pods" in recipe and "workers=1" in recipe
    import yaml

    values = yaml.safe_load(recipe)
    assert values["per_device_train_batch_size"] == 8 and values["gradient_accumulation_steps"] == 1
    assert [cluster.node0.pid] + [worker.pid for worker in cluster.nodes] == agents and cluster.started

    # A candidate far longer than its limit (3,000 steps: about 90 s on an idle 2-core machine, against 20 s) is stopped
    # on every node; the workers stay for the next.
    timed_out = tune(
        "tune-limit", strategies="none", warmup_steps=1, timed_steps=3000, repeat_top=0, candidate_timeout_s=20
    )
    (row,) = [json.loads(line) for line in (project / "tune-limit" / "tune_results.jsonl").read_text().splitlines()]
    assert (row["status"], row.get("timeout_s")) == ("timed out", 20) and timed_out.winner is None
    assert rank_pids(project) and not [pid for pid in rank_pids(project).values() if alive(pid)]
    deadline = time.monotonic() + 30  # the launchers and ranks of every node: gone (the agents stay)
    while (
        left := [p for p in leftovers(project) if int(p.split(":")[0]) not in agents]
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == []
    assert [cluster.node0.pid] + [worker.pid for worker in cluster.nodes] == agents and cluster.started
    assert all(alive(pid) for pid in agents)
    cluster.stop()
    wait_until_clean(project)


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(
    gpus() < 2,
    reason="needs 2 CUDA GPUs (the CPU path of the same split is test_cluster_units.py::test_each_local_node_gets_its_own_gpus_and_cores)",
)
def test_two_local_nodes_on_one_gpu_box_each_use_their_own_gpu(assets, project, clusters, monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR")
    seen = {}

    def devices_of_ranks(line):
        seen.update({rank: environ_of(pid).get("CUDA_VISIBLE_DEVICES") for rank, pid in rank_pids(project).items()})

    cluster = clusters("local", nvidia_gpu=1, session_slots=1, echo=on_line("Training starts", devices_of_ranks))
    result = cluster.train(cluster_argv(assets, project / "runs", "--deepspeed", "zero2"))
    assert seen == {0: "0", 1: "1"}  # not GPU 0 twice
    assert all(m.get("cuda_max_allocated_bytes") for m in result["summary"].peak_memory_per_rank)
    assert result["ranks"][0]["final_loss"] == pytest.approx(result["ranks"][1]["final_loss"], rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Faults of a rank, and resuming
# ---------------------------------------------------------------------------------------------------------------------


def step_of(sentence: str) -> int:
    import re

    return int(re.search(r"resumes from checkpoint-(\d+)", sentence)[1])


@pytest.mark.slow
def test_rank_faults_end_the_launch_and_the_next_launch_resumes_from_a_complete_checkpoint(
    assets, project, clusters, monkeypatch
):
    """A rank killed mid-step; another world size refused; a rank killed while saving; the disk full while saving;
    each launch ends within 60 s naming the rank and what the next launch resumes from, and the last one does."""
    runs = project / "runs"
    runs.mkdir()
    tmpfs = (
        ROOT
        and shutil.which("mount")
        and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "textsql-test", str(runs)]).returncode == 0
    )
    try:
        argv = cluster_argv(assets, runs, "--save_strategy", "steps", "--save_steps", "4", steps=16, logging_steps=2)
        output_dir = runs / "tiny-t5-none-ws2-bs16-lr0.003-steps16-warmup2"

        # 1. Rank 1 killed (SIGKILL) mid-step, once checkpoint-4 is complete.
        cluster = clusters("local")
        killed = {}

        def kill_rank_1():
            deadline = time.monotonic() + 300
            while not (
                (output_dir / "checkpoint-4" / "trainer_state.json").exists()
                and (output_dir / "checkpoint-4" / "rng_state_1.pth").exists()
            ):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
            pid = rank_pids(project)[1]
            os.kill(pid, signal.SIGKILL)
            killed.update(pid=pid, at=time.monotonic())

        killer = threading.Thread(target=kill_rank_1, daemon=True)
        killer.start()
        with pytest.raises(LaunchFailed) as failure:
            cluster.train(argv)
        ended = time.monotonic()
        killer.join(timeout=5)
        assert "at" in killed, "rank 1 was never killed: training ended or stalled before its first checkpoint"
        message = str(failure.value)
        print(message)
        assert ended - killed["at"] < 60
        assert (
            message.startswith("Rank 1 on node 1 (127.0.0.2, host ")
            and "failed first: killed by SIGKILL." in message
            and "rank-1.log" in message
        )
        assert failure.value.failures[0]["pid"] == killed["pid"] and "Then rank 0 on 127.0.0.1" in message
        resume = step_of(failure.value.resume)
        assert (
            resume >= 4
            and f"the next launch resumes from checkpoint-{resume} (the newest checkpoint complete on every node"
            in message
        )
        assert not cluster.started  # the workers were stopped, too
        wait_until_clean(project)
        assert not (output_dir / "run_summary.json").exists()

        # 2. The same run with another world size is refused, naming both sizes (no silent restart from step 0).
        with pytest.raises(
            PreflightError, match=r"holds an interrupted run of world size 2, but this launch has world size 1"
        ):
            clusters("local", workers=0).train(argv)

        # 3. Rank 1 killed while saving the next checkpoint (half its RNG state written).
        cluster = clusters("local")
        monkeypatch.setenv("TEXTSQL_TEST_FAULT", f"kill:1:checkpoint-{resume + 4}/rng_state_1.pth")
        with pytest.raises(LaunchFailed) as failure:
            cluster.train(argv, stop_on_failure=False)
        message = str(failure.value)
        print(message)
        assert time.time() - failure.value.failures[0]["ended_at"] < 60
        assert (
            message.startswith("Rank 1 on node 1 (127.0.0.2")
            and "killed by SIGKILL" in message
            and "textsql test fault: kill while writing" in message
        )
        assert failure.value.resume == (
            f"resumes from checkpoint-{resume} (the newest checkpoint complete on every node; checkpoint-{resume + 4} is "
            f"incomplete: rank 1's RNG state (rng_state_1.pth) is cut short)"
        )
        assert not [p for p in leftovers(project) if "textsql.cluster.node" not in p], (
            "a launcher or rank of the failed launch is left"
        )

        # 4. The disk fills up while rank 0 saves the next checkpoint (a tmpfs with 1 MiB left; a failing writer otherwise).
        if tmpfs:
            used = shutil.disk_usage(runs).used
            subprocess.run(["mount", "-o", f"remount,size={used + 2**20}", str(runs)], check=True)
            monkeypatch.delenv("TEXTSQL_TEST_FAULT")
        else:
            monkeypatch.setenv("TEXTSQL_TEST_FAULT", f"enospc:0:checkpoint-{resume + 4}/model.safetensors")
        with pytest.raises(LaunchFailed) as failure:
            cluster.train(argv, stop_on_failure=False)
        message = str(failure.value)
        print(message)
        assert message.startswith("Rank 0 on node 0 (127.0.0.1") and "No space left on device" in message
        assert "(stopped because of it)" in message or len(failure.value.failures) == 1
        assert failure.value.resume.startswith(
            f"resumes from checkpoint-{resume} (the newest checkpoint complete on every node; checkpoint-{resume + 4} is incomplete"
        )

        # 5. Space again: the next launch resumes from the checkpoint it said, the partial ones set aside (never deleted).
        if tmpfs:
            subprocess.run(["mount", "-o", "remount,size=256m", str(runs)], check=True)
        monkeypatch.delenv("TEXTSQL_TEST_FAULT", raising=False)
        result = cluster.train(argv)
        summary = result["summary"]
        assert Path(summary.resumed_from).name == f"checkpoint-{resume}"
        assert summary.global_step == 16 and [r["global_step"] for r in result["ranks"]] == [16, 16]
        assert result["ranks"][0]["final_loss"] == pytest.approx(result["ranks"][1]["final_loss"], rel=1e-6)
        assert len(list(output_dir.glob(f"incomplete-checkpoint-{resume + 4}-*"))) == 2
        assert json.loads((output_dir / "textsql-launch.json").read_text())["world_size"] == 2
        cluster.stop()
        wait_until_clean(project)
    finally:
        if tmpfs:
            wait_until_clean(project)
            subprocess.run(["umount", str(runs)])


class PrivateRunsBackend(LocalBackend):
    """Local workers whose `runs` folder is their own (a tmpfs in a private mount namespace): no shared run folder."""

    def __init__(self, private_dir: Path):
        super().__init__()
        self.command_prefix = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount -t tmpfs textsql-test "$0" && exec "$@"',
            str(private_dir),
        ]

    def on_node_1(self, *command: str) -> subprocess.CompletedProcess:
        """Run a command in node 1's mount namespace (where its private runs folder is)."""
        pid = self.processes["local-127.0.0.2"].pid
        return subprocess.run(
            ["nsenter", "-t", str(pid), "-m", "--", *command], capture_output=True, text=True, check=True
        )


@pytest.mark.slow
@pytest.mark.skipif(
    not ROOT or not shutil.which("unshare") or not shutil.which("nsenter"),
    reason="a private mount namespace for a local worker needs root",
)
def test_without_a_shared_run_folder_every_node_resumes_from_the_same_checkpoint(assets, project, clusters):
    runs = project / "runs"
    runs.mkdir()
    backend = PrivateRunsBackend(runs)
    cluster = clusters(backend)
    argv = cluster_argv(
        assets, runs, "--deepspeed", "zero2", "--save_strategy", "steps", "--save_steps", "3", steps=6, logging_steps=3
    )
    first = cluster.train(argv)
    assert first["shared_output"] is False and first["ranks"][1]["arguments"]["save_on_each_node"] is True
    run = runs / "tiny-t5-zero2-ws2-bs16-lr0.003-steps6-warmup2"
    shards = run / "checkpoint-6" / "global_step6"
    assert sorted(backend.on_node_1("ls", str(shards)).stdout.split()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert sorted(p.name for p in shards.iterdir()) == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ]
    # Node 1 loses the end of its newest shard; the run is made an interrupted one. Node 0's checkpoint-6 is complete,
    # node 1's is not: both nodes must resume from checkpoint-3.
    backend.on_node_1("truncate", "-s", "1000", str(shards / "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    (run / "run_summary.json").unlink()
    second = cluster.train(argv)  # the same command: the same run folder (a longer run would be another experiment)
    assert Path(second["summary"].resumed_from).name == "checkpoint-3"
    assert [r["global_step"] for r in second["ranks"]] == [6, 6]
    assert second["ranks"][0]["final_loss"] == pytest.approx(second["ranks"][1]["final_loss"], rel=1e-6)
    assert "incomplete-checkpoint-6-" in backend.on_node_1("ls", str(run)).stdout and list(
        run.glob("incomplete-checkpoint-6-*")
    )


# ---------------------------------------------------------------------------------------------------------------------
# Workers that never start, never connect, or die at start
# ---------------------------------------------------------------------------------------------------------------------


class UnreachableSessionBackend(LocalBackend):
    """Workers that start but cannot reach the session (a firewall): they dial a port nobody listens on."""

    def launch(self, n, spec, env, log_dir, placements):
        with socket.socket() as s:
            s.bind((NODES[0], 0))
            closed = s.getsockname()[1]
        return super().launch(n, spec, dict(env, TEXTSQL_CLUSTER_ADDRESS=f"{NODES[0]}:{closed}"), log_dir, placements)


def test_workers_that_never_start_never_connect_or_die_at_start_fail_the_start_and_are_stopped(
    project, clusters, monkeypatch
):
    import cml.workers_v1 as standin

    monkeypatch.setenv("CML_STANDIN_UNSCHEDULABLE", "1")
    with pytest.raises(TextsqlError, match=r"1 of 1 CML worker\(s\) did not start within 3 s: standin-\S+: scheduling"):
        clusters("cml", start_timeout=3)
    assert [w["status"] for w in standin.list_workers()] == ["stopped"]
    monkeypatch.delenv("CML_STANDIN_UNSCHEDULABLE")

    with pytest.raises(TextsqlError) as silent:
        clusters(UnreachableSessionBackend(), start_timeout=6)
    message = str(silent.value)
    assert message.startswith("Cluster start failed: local-127.0.0.2 did not connect to the session at 127.0.0.1:")
    assert (
        "within 6 s (started but published nothing" in message and "cannot reach the session at 127.0.0.1:" in message
    )

    crashing = LocalBackend()
    crashing.command_prefix = [
        sys.executable,
        "-c",
        "import sys; sys.exit('this pod cannot run textsql: no module named textsql')",
    ]
    with pytest.raises(TextsqlError) as died:
        clusters(crashing, start_timeout=60)
    message = str(died.value)
    assert message.startswith(
        "Cluster start failed: node(s) ended before their agent connected: local-127.0.0.2 (127.0.0.2): exited with status 1"
    )
    assert "this pod cannot run textsql" in message
    wait_until_clean(project)


# ---------------------------------------------------------------------------------------------------------------------
# Interrupts, dead kernels, two launches at once
# ---------------------------------------------------------------------------------------------------------------------

KERNEL = textwrap.dedent("""
    import sys
    from textsql.cluster import Cluster
    backend, argv = sys.argv[1], sys.argv[2:]
    cluster = Cluster(backend, workers=1, cpu=1, memory=2, echo=lambda line: print(line, flush=True))
    cluster.start()
    cluster.train(argv)
""")


def start_kernel(backend: str, argv: list[str]) -> tuple[subprocess.Popen, list[str]]:
    """A stand-in for a notebook kernel: a Python process running the notebook's calls; its output lines collected."""
    kernel = subprocess.Popen(
        [sys.executable, "-u", "-c", KERNEL, backend, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line.rstrip()) for line in kernel.stdout], daemon=True).start()
    return kernel, lines


def wait_for_line(lines: list[str], text: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in line for line in lines):
        assert process.poll() is None, "the kernel ended early:\n" + "\n".join(lines[-30:])
        assert time.monotonic() < deadline, f"no '{text}' within {timeout} s:\n" + "\n".join(lines[-30:])
        time.sleep(0.1)


@pytest.mark.slow
def test_ctrl_c_during_training_and_again_during_clean_up_stops_everything_and_a_second_launch_is_refused(
    assets, project, clusters
):
    argv = cluster_argv(assets, project / "runs", steps=100000, logging_steps=50)
    refused, lines = {}, []

    def second_launch_then_ctrl_c(line):
        other = Cluster(
            LocalBackend(first_worker_address="127.0.0.3"), workers=1, name="second", project_dir=project, echo=print
        )
        try:
            other.start().train(argv)
        except TextsqlError as error:
            refused["message"] = str(error)
        other.stop()
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C (the kernel's interrupt) while the ranks train

    cleanup = on_line(
        "interrupted; stopping launch", lambda line: os.kill(os.getpid(), signal.SIGINT)
    )  # again, during the clean-up
    training = on_line("Training starts", second_launch_then_ctrl_c, cleanup)
    cluster = clusters("local", echo=lambda line: (lines.append(line), training(line)))
    with pytest.raises(KeyboardInterrupt):
        cluster.train(argv)
    print(refused)
    assert f"is in use by process {os.getpid()}" in refused["message"] and "(launch " in refused["message"]
    assert "Two launches into one run would overwrite each other's checkpoints" in refused["message"]
    assert any("still stopping the cluster" in line for line in lines) and not cluster.started
    assert wait_until_clean(project) < 60
    assert (
        Cluster("local", workers=0, project_dir=project, echo=print).start().stop() is None
    )  # the locks are free again


@pytest.mark.slow
def test_a_kernel_killed_during_training_takes_its_workers_with_it(assets, project):
    kernel, lines = start_kernel("local", cluster_argv(assets, project / "runs", steps=100000, logging_steps=50))
    try:
        wait_for_line(lines, "Training starts", kernel)
        kernel.kill()  # a kernel restart: no clean-up code runs
        killed = time.monotonic()
        kernel.wait()
        # The agents see their connection close and stop their launchers (SIGTERM, SIGKILL after 10 s).
        wait_until_clean(project, timeout=60)
        assert time.monotonic() - killed < 60
    finally:
        kernel.kill()
    again = Cluster(
        "local", workers=1, cpu=1, memory=2, project_dir=project, echo=print
    ).start()  # the kernel's locks died with it
    again.stop()


@pytest.mark.slow
def test_a_frozen_worker_or_a_killed_agent_ends_the_launch_naming_its_node_with_nothing_left_running(
    assets, project, clusters
):
    """A worker's agent frozen (SIGSTOP: a hung pod, or one cut off from the network) and, in a second launch, killed
    (SIGKILL: a pod that died): each launch ends within 60 s naming node 1 and how it was lost, not rank 0 that only
    lost its peer; when the session says that every process stopped, none is left (the killed agent's launcher and
    rank included)."""
    for fault, signum in (("frozen", signal.SIGSTOP), ("killed", signal.SIGKILL)):
        hit, lines, started = {}, [], []

        def strike(line, signum=signum, hit=hit, started=started):
            hit["pid"] = started[0].backend.processes["local-127.0.0.2"].pid
            os.kill(hit["pid"], signum)
            hit["at"] = time.monotonic()

        echo = on_line("Training starts", strike, lambda line, lines=lines: (lines.append(line), print(line)))
        cluster = clusters("local", silence_seconds=6, echo=echo)
        started.append(cluster)
        with pytest.raises(LaunchFailed) as failure:
            cluster.train(cluster_argv(assets, project / f"runs-{fault}", steps=100000, logging_steps=50))
        ended = time.monotonic()
        message = str(failure.value)
        print(message)
        assert "at" in hit, "the worker's agent was never hit: training ended before it started"
        print(f"{fault}: the launch ended and the cluster stopped {ended - hit['at']:.1f} s after the agent was hit")
        assert ended - hit["at"] < 60
        how = "its agent went silent for" if fault == "frozen" else "its agent vanished"
        assert message.startswith(f"Node 1 (127.0.0.2, rank(s) 1) was lost first: {how}"), message
        assert "Rank 0 on node 0" not in message and not cluster.started
        assert lines[-1] == "stopped 1 worker(s) and node 0's agent"
        assert leftovers(project) == []  # gone before the session said so


def test_interrupts_while_workers_start_and_a_dead_kernel_s_workers_are_stopped_by_the_next_start(
    project, clusters, monkeypatch
):
    import cml.workers_v1 as standin

    monkeypatch.setenv("CML_STANDIN_SCHEDULE_DELAY", "60")
    for phase, delay in (
        ("starting node 0's agent", 0.0),
        ("waiting for 1 worker(s)", 0.5),
    ):  # launching, then waiting for the pods
        with pytest.raises(KeyboardInterrupt):
            clusters("cml", echo=on_line(phase, lambda line, delay=delay: interrupt_soon(delay)))
        assert {w["status"] for w in standin.list_workers()} <= {"stopped"}
        wait_until_clean(project)

    # A kernel restarted while its worker pod is still being scheduled: the pod outlives it; the next start stops it.
    kernel, lines = start_kernel("cml", [])
    try:
        wait_for_line(lines, "waiting for 1 worker(s)", kernel, timeout=60)
        kernel.kill()
        kernel.wait()
    finally:
        kernel.kill()
    (stale,) = [w for w in standin.list_workers() if w["status"] == "scheduling"]
    monkeypatch.setenv("CML_STANDIN_SCHEDULE_DELAY", "0")
    said = []
    cluster = clusters("cml", lines=said)
    (report,) = [line for line in said if "stale worker(s) of an earlier start" in line]
    assert (
        stale["id"] in report
    )  # (and node 0's agent of that kernel, unless it noticed first that its session is gone)
    assert {w["id"]: w["status"] for w in standin.list_workers()}[stale["id"]] == "stopped"
    # The notebook's start cell run again in the same kernel: the earlier cluster of that name is stopped first.
    again = clusters("cml", lines=said)
    assert (
        not cluster.started
        and again.started
        and any("stopping the earlier cluster 'default' of this kernel" in line for line in said)
    )
    again.stop()
    assert [w["status"] for w in standin.list_workers()] == ["stopped"] * len(standin.list_workers())
    wait_until_clean(project)


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
        "train_main",
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
                        if "train_main" in command:
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
    assert watch.rank_envs and all(
        env.get("TEXTSQL_PROBE") == "reaches the ranks" and env.get("DS_ACCELERATOR") == "cpu"
        for env in watch.rank_envs
    ), [(env.get("TEXTSQL_PROBE"), env.get("DS_ACCELERATOR"), env["COMMAND_SEEN"][:150]) for env in watch.rank_envs]
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
    with pytest.raises(PreflightError) as refused:
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
def test_notebook_trains_on_two_local_nodes(assets, project, monkeypatch):
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
    assert "--no_ssh" in text and "[rank 1]" in text and "final_loss" in text and "stopped 1 worker(s)" in text
    assert CANARY not in text and files_holding(project, CANARY) == []
