"""Each fault of issues #30 and #40 on real local pods (the fixtures and helpers of test_cluster.py): a rank that
raises, a pod killed, the session that hosts the store killed, a pod that never starts, elastic or not, a frozen pod, a
stopped rank, Ctrl-C: each ends the launch naming the rank or pod within 60 s with no process left; the next launch
resumes after a lost pod; torchrun's restart resumes from the newest complete checkpoint; an elastic run resumes at
the size it trained at or another (FSDP's shards refused there); a worker that comes after an elastic launch started is stopped, and
a torchrun that joins late restarts nothing; nothing listens beyond the pods' own addresses, nor in a one-process
training. Fault tests run plain DDP ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from test_cluster import (  # noqa: F401  (project, clusters: the fixtures, shared with test_cluster.py)
    NODES,
    RENDEZVOUS_LOG,
    cluster_argv,
    clusters,
    environ_of,
    leftovers,
    on_line,
    project,
    rank_pids,
    wait_until_clean,
)

from textsql.cluster import Cluster, LaunchFailed, PreflightError
from textsql.errors import TextsqlError
from textsql.train.watch import STEP_FLOOR_S, STEP_MULTIPLE, WatchLimits

SHORT_WINDOW = WatchLimits(join_window=5)  # for elastic launches whose late pods are not the point

# ---------------------------------------------------------------------------------------------------------------------
# Faults, and resuming
# ---------------------------------------------------------------------------------------------------------------------


def step_of(sentence: str) -> int:
    import re

    return int(re.search(r"resumes from checkpoint-(\d+)", sentence)[1])


def pod_tree(cluster: Cluster, address: str) -> list:
    import psutil

    (root,) = [psutil.Process(p.process.pid) for p in cluster.pods if p.address == address]
    return [root, *root.children(recursive=True)]


@pytest.mark.slow
def test_a_killed_pod_then_a_raising_rank_end_the_launch_named_and_the_next_launch_resumes(
    assets, project, clusters, monkeypatch
):
    """Pod 127.0.0.2 killed (every process of it) once checkpoint-4 is complete; then rank 1 raising while it saves
    the next checkpoint (the earliest failure record wins over rank 0, which only lost its peer); then the same
    launch again resumes from the newest checkpoint complete for every rank, the partial one set aside."""
    runs = project / "runs"
    argv = cluster_argv(assets, runs, "--save_strategy", "steps", "--save_steps", "4", steps=16, logging_steps=2)
    output_dir = runs / "tiny-t5-none-ws2-bs16-lr0.003-steps16-warmup2"
    cluster, killed = clusters("local"), {}

    def kill_pod():
        deadline = time.monotonic() + 300
        while (
            not (output_dir / "checkpoint-4" / "rng_state_1.pth").exists()
            or not (output_dir / "checkpoint-4" / "trainer_state.json").exists()
        ):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        for process in pod_tree(cluster, NODES[1]):
            process.kill()
        killed["at"] = time.monotonic()

    killer = threading.Thread(target=kill_pod, daemon=True)
    killer.start()
    with pytest.raises(LaunchFailed) as failure:
        cluster.train(argv)
    ended = time.monotonic()
    killer.join(timeout=5)
    message = str(failure.value)
    print(message)
    assert "at" in killed, "the pod was never killed: training ended or stalled before its first checkpoint"
    assert ended - killed["at"] < 60 and message.startswith("Pod 127.0.0.2 was lost first: it was killed by SIGKILL")
    resume = step_of(failure.value.resume)
    assert resume >= 4 and f"the next launch resumes from checkpoint-{resume}" in message
    wait_until_clean(project)
    # The same run with another world size is refused, naming both sizes (no silent restart from step 0).
    with pytest.raises(
        PreflightError, match=r"holds an interrupted run of world size 2, but this launch has world size 1"
    ):
        clusters("local", workers=0, name="one").train(argv)

    monkeypatch.setenv("TEXTSQL_TEST_FAULT", f"enospc:1:checkpoint-{resume + 4}/rng_state_1.pth")
    with pytest.raises(LaunchFailed) as failure:
        cluster.train(argv)
    message = str(failure.value)
    print(message)
    assert time.time() - failure.value.failures[0]["ended_at"] < 60
    assert message.startswith("Rank 1 on pod 127.0.0.2 failed first: OSError: [Errno 28] No space left on device")
    assert failure.value.resume.startswith(
        f"resumes from checkpoint-{resume} (the newest checkpoint complete on every node; checkpoint-{resume + 4} is incomplete"
    )
    wait_until_clean(project)

    monkeypatch.delenv("TEXTSQL_TEST_FAULT")
    result = cluster.train(argv)
    summary = result["summary"]
    assert Path(summary.resumed_from).name == f"checkpoint-{resume}" and summary.global_step == 16
    assert [r["global_step"] for r in result["ranks"]] == [16, 16]
    assert list(output_dir.glob(f"incomplete-checkpoint-{resume + 4}-*"))
    assert json.loads((output_dir / "textsql-launch.json").read_text())["world_size"] == 2
    wait_until_clean(project)


@pytest.mark.slow
def test_a_pod_killed_while_starting_is_named_and_leaves_nothing_behind(assets, project, clusters):
    """The worker pod SIGKILLed as soon as it says it runs (before its torchrun started a rank): it is named, and
    nothing of the launch is left."""
    hit = {}

    def kill_when_started(line):
        (pod,) = [p for p in cluster.pods if p.address == NODES[1]]
        pod.process.kill()
        hit["at"] = time.monotonic()

    cluster = clusters("local", echo=on_line(f"{NODES[1]}: textsql pod {NODES[1]}: log in", kill_when_started))
    with pytest.raises(LaunchFailed) as failure:
        cluster.train(cluster_argv(assets, project / "runs", steps=100000), timeout_s=150)
    message = str(failure.value)
    print(message)
    assert time.monotonic() - hit["at"] < 60
    assert message.startswith("Pod 127.0.0.2 was lost first: it was killed by SIGKILL"), message
    assert leftovers(project) == []


def keys_in_environments() -> set[str]:
    """What a process of the same user finds of a launch key in every process's environment as it was started
    (/proc/PID/environ): each value of 64 hex digits (issue 53: the pod key was one, and forged beats hid a pod)."""
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            found |= set(re.findall(rb"=([0-9a-f]{64})(?:\0|$)", environ.read_bytes()))
    return {value.decode() for value in found}


def forge_heartbeats(line, address=NODES[1], every=2.0):
    """Another local process's forgery of a pod's heartbeat (issues 48, 53): it reaches the session's store (its
    address is in the launch's echo) and, every `every` s, adds to the pod's counter, replays its newest value one
    higher, and signs the next count with every key it can read in any process's environment."""
    import datetime

    import torch.distributed as dist

    from textsql.cluster.pods import signed

    host, port = re.search(r"--rdzv-endpoint (\S+):(\d+)", line).groups()
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))
    name = f"textsql/alive/{address}"

    def forge():
        while True:
            try:
                count, _, rest = (store.get(name).decode() if store.check([name]) else "0").partition(":")
                store.set(name, f"{int(count) + 1}:{rest}") if rest else store.add(name, 1)
                for key in keys_in_environments():
                    store.set(name, signed(key, address, int(count) + 2))
            except Exception:
                return  # the launch's store is gone
            time.sleep(every)

    threading.Thread(target=forge, daemon=True).start()


@pytest.mark.slow
def test_a_frozen_pod_and_ctrl_c_end_the_launch_with_nothing_left_running(assets, project, clusters):
    """Every process of pod 127.0.0.2 stopped (SIGSTOP: a hung pod, or one cut off) while another local process
    forges its heartbeat in the session's store (signing with any key it reads in any process's environment: none is
    there): named by its silent heartbeat at the default silence (20 s); then
    Ctrl-C while the ranks train (and again during the clean-up, which waits): every pod stopped, in a finally."""
    hit, lines = {}, []

    def freeze(line):
        hit["keys"] = keys_in_environments()  # every process of the launch is running
        for process in pod_tree(cluster, NODES[1]):
            process.suspend()
        hit["at"] = time.monotonic()

    echo = on_line("every pod:", forge_heartbeats, on_line("Training starts", freeze, lines.append))
    cluster = clusters("local", echo=echo)
    with pytest.raises(LaunchFailed) as failure:
        cluster.train(cluster_argv(assets, project / "runs-frozen", steps=100000, logging_steps=50), timeout_s=200)
    message = str(failure.value)
    print(message)
    assert time.monotonic() - hit["at"] < 60
    assert message.startswith("Pod 127.0.0.2 was lost first: it went silent for"), message
    assert len(cluster.key) == 64 and cluster.key not in hit["keys"]
    assert leftovers(project) == []  # gone before train() returned

    again = on_line("textsql: stopping", lambda line: os.kill(os.getpid(), signal.SIGINT), lines.append)
    interrupt = on_line("Training starts", lambda line: os.kill(os.getpid(), signal.SIGINT), again)
    cluster = clusters("local", name="ctrl-c", echo=interrupt)
    with pytest.raises(KeyboardInterrupt):
        cluster.train(cluster_argv(assets, project / "runs-ctrl-c", steps=100000, logging_steps=50))
    assert leftovers(project) == []
    assert any("still stopping the pods" in line for line in lines)


@pytest.mark.slow
def test_a_pod_frozen_before_its_first_heartbeat_is_named_not_the_session(assets, project, clusters):
    """The worker pod SIGSTOPped as soon as its process exists (before it loads torch and sends its first heartbeat),
    at the default silence: it is named within 60 s, not the session's pod that waits for it in the rendezvous."""
    hit = {}

    def freeze_when_started(line):
        def freeze():
            while not (pods := [p for p in cluster.pods if p.address == NODES[1]]):
                time.sleep(0.005)
            os.kill(pods[0].process.pid, signal.SIGSTOP)
            hit["at"] = time.monotonic()

        threading.Thread(target=freeze, daemon=True).start()

    cluster = clusters("local", echo=on_line("starting the session's pod", freeze_when_started))
    with pytest.raises(LaunchFailed) as failure:
        cluster.train(cluster_argv(assets, project / "runs", steps=100000, logging_steps=50), timeout_s=150)
    message = str(failure.value)
    print(message)
    assert time.monotonic() - hit["at"] < 60
    assert re.match(r"Pod 127\.0\.0\.2 was lost first: it sent no heartbeat in the \d+ s since it started", message)
    assert leftovers(project) == []


def test_the_store_stops_listening_when_a_launch_ends_even_while_its_traceback_is_kept(assets, project, clusters):
    """A Ctrl-C in the launch's watch loop, its traceback kept (as a notebook keeps it, frames and all): the session's
    rendezvous store no longer listens once train() has raised, without waiting for the garbage collector."""
    import gc

    from test_cluster import listeners

    seen = {}

    def interrupt(line):
        raise KeyboardInterrupt

    def port(line):
        seen["port"] = int(re.search(r"--rdzv-endpoint 127\.0\.0\.1:(\d+)", line)[1])

    cluster = clusters("local", echo=on_line("every pod:", port, on_line("textsql pod", interrupt)))
    try:
        cluster.train(cluster_argv(assets, project / "runs", steps=100000))
    except KeyboardInterrupt:
        kept = sys.exc_info()  # noqa: F841  (what IPython keeps: the traceback and every frame of it)
    gc.disable()  # nothing but the launch's own clean-up may close it
    try:
        assert [s for s in listeners([os.getpid()]) if s[3] == seen["port"]] == []
    finally:
        gc.enable()
    assert leftovers(project) == []


KERNEL = textwrap.dedent("""
    import sys
    from textsql.cluster import Cluster
    cluster = Cluster("local", workers=1, cpu=1, memory=2, echo=lambda line: print(line, flush=True))
    cluster.start()
    cluster.train(sys.argv[1:])
""")


@pytest.mark.slow
def test_the_session_that_hosts_the_store_killed_takes_every_pod_with_it(assets, project):
    argv = cluster_argv(assets, project / "runs", steps=100000, logging_steps=50)
    kernel = subprocess.Popen([sys.executable, "-u", "-c", KERNEL, *argv], stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line) for line in kernel.stdout], daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not any("Training starts" in line for line in lines):
            assert kernel.poll() is None and time.monotonic() < deadline, "".join(lines[-30:])
            time.sleep(0.1)
        kernel.kill()  # a kernel restart: no clean-up code runs, the rendezvous store is gone with it
        killed = time.monotonic()
        kernel.wait()
        assert wait_until_clean(project, timeout=60) < 60 and time.monotonic() - killed < 60
    finally:
        kernel.kill()
    Cluster("local", workers=1, project_dir=project).start().stop()  # the kernel's locks died with it


@pytest.mark.parametrize("min_workers", [None, 1])
def test_a_pod_that_never_starts_is_named_and_stopped(project, clusters, assets, monkeypatch, min_workers):
    """Two pods needed (min_workers 1 of 1 worker: elastic, --nnodes 2:2): the worker that never starts is named, not
    the session's pod that waits for it (torchrun's rendezvous would fail there a minute later)."""
    import cml.workers_v1 as standin

    monkeypatch.setenv("CML_STANDIN_UNSCHEDULABLE", "1")
    cluster = clusters("cml", start_timeout=3, min_workers=min_workers)
    began = time.monotonic()
    with pytest.raises(LaunchFailed) as failure:
        cluster.train(cluster_argv(assets, project / "elastic", "--output_dir", str(project / "elastic"), steps=2))
    message = str(failure.value)
    print(message)
    (worker,) = standin.list_workers()
    first = message.splitlines()[0]  # the worker, by its address once CML lists one, else by its id
    assert re.fullmatch(
        rf"Pod \S+ was lost first: it did not start within 3 s \(its worker {worker['id']} is scheduling\)\.", first
    )
    assert NODES[0] not in first
    assert time.monotonic() - began < 60 and worker["status"] == "stopped"
    wait_until_clean(project)


@pytest.mark.slow
def test_a_cml_worker_that_dies_is_named_by_its_worker_status(project, clusters, assets):
    """The CML worker's pod killed (every process of it, the stand-in's too): the session learns it from CML's worker
    status and names the pod with it, in one sentence."""
    import psutil

    def kill_worker(line):
        (worker,) = standin_workers()  # this test's own (the stand-in's registry is in the test's folder)
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if process.environ().get("CDSW_ENGINE_ID") == worker["id"]:
                    process.kill()

    cluster = clusters("cml", echo=on_line("Training starts", kill_worker))
    with pytest.raises(LaunchFailed) as failure:
        cluster.train(cluster_argv(assets, project / "runs", steps=100000, logging_steps=50))
    print(failure.value)
    (worker,) = standin_workers()
    assert str(failure.value).startswith(f"Pod 127.0.0.2 was lost first: its CML worker {worker['id']} is failed.")
    wait_until_clean(project)


@pytest.mark.slow
def test_an_elastic_launch_trains_on_the_pods_that_joined(project, clusters, assets, monkeypatch):
    """--nnodes 1:2 (min_workers=0): the worker pod never starts; torchrun's c10d rendezvous completes with the
    session's pod alone once its join window (5 s here) has passed, the training finishes at world size 1, and the worker
    that never started is stopped, not named as a failure."""
    import cml.workers_v1 as standin

    monkeypatch.setenv("CML_STANDIN_UNSCHEDULABLE", "1")
    cluster = clusters("cml", min_workers=0, start_timeout=3, limits=SHORT_WINDOW)
    argv = cluster_argv(assets, project / "runs", "--output_dir", str(project / "elastic"), steps=4, logging_steps=2)
    result = cluster.train(argv)
    assert "--nnodes 1:2" in " ".join(result["command"])
    assert result["summary"].world_size == 1 and result["summary"].global_step == 4
    assert [(r["rank"], r["node_address"], r["world_size"]) for r in result["ranks"]] == [(0, NODES[0], 1)]
    assert [w["status"] for w in standin.list_workers()] == ["stopped"]
    wait_until_clean(project)


@pytest.mark.slow
def test_an_elastic_run_resumes_at_the_size_it_trained_at_or_another(project, clusters, assets, monkeypatch):
    """An elastic launch whose worker never starts trains at world size 1 and fails while saving checkpoint-4: the
    run's record says 1 (not the planned 2); a launch of 2 pods resumes the plain DDP run from checkpoint-2 at world
    size 2 (its whole-model files as they are; its global batch of 1 micro-batch cannot be kept at 2 ranks: said)."""
    from textsql.cluster.runs import RECORD

    monkeypatch.setenv("CML_STANDIN_UNSCHEDULABLE", "1")
    run = project / "elastic-run"
    argv = cluster_argv(assets, project / "runs", "--output_dir", str(run), "--save_strategy", "steps")
    argv += ["--save_steps", "2", "--max_steps", "6", "--logging_steps", "2"]
    monkeypatch.setenv("TEXTSQL_TEST_FAULT", "enospc:0:checkpoint-4/rng_state.pth")
    cluster = clusters("cml", min_workers=0, start_timeout=3, limits=SHORT_WINDOW)
    with pytest.raises(LaunchFailed) as failure:
        cluster.train(argv)
    print(failure.value)
    assert str(failure.value).startswith("Rank 0 on pod 127.0.0.1 failed first: OSError: [Errno 28]")
    assert failure.value.resume.startswith("resumes from checkpoint-2 (the newest checkpoint complete on every node;")
    assert json.loads((run / RECORD).read_text())["world_size"] == 1
    assert [w["status"] for w in standin_workers()] == ["stopped"]
    monkeypatch.delenv("TEXTSQL_TEST_FAULT")
    wait_until_clean(project)
    lines = []
    result = clusters("local", name="two", min_workers=1, limits=SHORT_WINDOW, lines=lines).train(argv)
    summary = result["summary"]
    assert (summary.world_size, summary.global_step, Path(summary.resumed_from).name) == (2, 6, "checkpoint-2")
    assert list(run.glob("incomplete-checkpoint-4-*")) and json.loads((run / RECORD).read_text())["world_size"] == 2
    assert any(
        "checkpoint-2 of world size 1 resumed at 2: the global batch of 1 micro-batches" in line for line in lines
    )
    wait_until_clean(project)


@pytest.mark.slow
def test_an_elastic_launch_that_loses_a_pod_names_it_and_the_next_resumes(assets, project, clusters):
    """Elastic (min_workers=1: --nnodes 2:2), two pods training: pod 127.0.0.2 killed (every process of it) once
    checkpoint-4 is complete. It is named, not the session's pod; the same launch again resumes at world size 2 from
    the newest checkpoint complete on every node, and finishes."""
    from textsql.cluster.runs import RECORD

    run = project / "elastic"
    argv = cluster_argv(assets, project / "runs", "--output_dir", str(run), "--save_strategy", "steps", steps=12)
    argv += ["--save_steps", "4", "--logging_steps", "2"]
    cluster, killed = clusters("local", min_workers=1), {}

    def kill_pod():
        deadline = time.monotonic() + 300
        while not all((run / "checkpoint-4" / name).exists() for name in ("rng_state_1.pth", "trainer_state.json")):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        for process in pod_tree(cluster, NODES[1]):
            process.kill()
        killed["at"] = time.monotonic()

    threading.Thread(target=kill_pod, daemon=True).start()
    with pytest.raises(LaunchFailed) as failure:
        cluster.train(argv, timeout_s=400)
    message = str(failure.value)
    print(message)
    assert "at" in killed, "the pod was never killed: training ended or stalled before its first checkpoint"
    assert time.monotonic() - killed["at"] < 60
    assert message.startswith("Pod 127.0.0.2 was lost first: it was killed by SIGKILL"), message
    resume = step_of(failure.value.resume)
    wait_until_clean(project)
    result = cluster.train(argv, timeout_s=400)
    summary = result["summary"]
    assert (summary.world_size, summary.global_step, Path(summary.resumed_from).name) == (2, 12, f"checkpoint-{resume}")
    assert resume >= 4 and json.loads((run / RECORD).read_text())["world_size"] == 2
    wait_until_clean(project)


def standin_workers() -> list[dict]:
    import cml.workers_v1 as standin

    return standin.list_workers()


def test_a_rank_resumes_a_round_of_another_world_size_or_refuses_what_cannot_be_resharded(project, assets):
    """What each rank checks when an elastic launch's world size is known (textsql.cluster.rank.start_round), on a
    real run folder: a DDP checkpoint of world size 1 resumed at 2, its global batch kept (accumulation 4 becomes 2) and
    recorded for every rank; an FSDP-sharded one refused at another size, naming both, and accepted at its own."""
    import torch
    from safetensors.torch import save_file

    from textsql.cluster.rank import start_round
    from textsql.cluster.runs import RECORD

    run = project / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    for name in ("trainer_state.json", "config.json"):
        (run / "checkpoint-2" / name).write_text("{}")
    # A whole checkpoint's files (none is read: a DDP checkpoint loads at any world size as it is)
    save_file({"weight": torch.zeros(1)}, run / "checkpoint-2" / "model.safetensors")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        torch.save({}, run / "checkpoint-2" / name)
    (run / RECORD).write_text(json.dumps({"launch": "L0", "world_size": 1, "gradient_accumulation_steps": 4}))
    spec = {"run_dir": str(run), "launch_id": "L1", "zero_stage": None, "arguments": {"gradient_accumulation_steps": 4}}
    assert start_round(spec, 0, 2, 0) == 2
    record = {"launch": "L1", "round": 0, "world_size": 2, "gradient_accumulation_steps": 2}
    assert json.loads((run / RECORD).read_text()) == record
    assert start_round(spec, 1, 2, 0) == 2  # another rank: the record of its launch and round is there, it goes on

    (run / "checkpoint-2" / "pytorch_model_fsdp_0").mkdir()  # torch's distributed checkpoint of FSDP's shards
    torch.save({}, run / "checkpoint-2" / "pytorch_model_fsdp_0" / "__0_0.distcp")
    (run / RECORD).write_text(json.dumps({"launch": "L2", "world_size": 1}))
    spec = dict(spec, launch_id="L3")
    with pytest.raises(TextsqlError, match=r"world size 1 \(checkpoint-2\), but this launch has world size 2: FSDP"):
        start_round(spec, 0, 2, 0)
    assert json.loads((run / RECORD).read_text())["world_size"] == 1
    assert start_round(spec, 0, 1, 0) == 4


@pytest.mark.slow
def test_a_worker_that_comes_after_an_elastic_launch_started_is_stopped_and_a_late_torchrun_restarts_nothing(
    project, clusters, assets, monkeypatch
):
    """An elastic launch (--nnodes 1:2, a join window of 5 s) whose worker is scheduled 30 s late trains at world size
    1; the worker, still scheduling when the training starts, is stopped and named (no failure). A torchrun that joins
    the rendezvous afterwards (a pod started by hand with the launch's environment and key, at 127.0.0.3) waits in
    torch's wait list and restarts nothing: the same ranks finish, in round 0; it ends with the launch's store."""
    monkeypatch.setenv("CML_STANDIN_SCHEDULE_DELAY", "30")
    late, lines = {}, []

    def start_late_pod(line):
        from textsql.cluster.pods import pod_code

        (session_pod,) = [p for p in cluster.pods if p.process is not None]
        env = dict(environ_of(session_pod.process.pid), TEXTSQL_POD_ADDRESS="127.0.0.3")
        late["pids"] = rank_pids(project)
        code = f"import logging\nlogging.getLogger({RENDEZVOUS_LOG!r}).setLevel(logging.DEBUG)\n{pod_code(cluster.key)}"
        with open(project / "late-pod.log", "wb") as log:
            late["pod"] = subprocess.Popen(
                [sys.executable, "-c", code], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=project
            )

    cluster = clusters(
        "cml",
        min_workers=0,
        start_timeout=600,
        limits=SHORT_WINDOW,
        echo=on_line("Training starts", start_late_pod, lines.append),
    )
    argv = cluster_argv(assets, project / "runs", "--output_dir", str(project / "late"), steps=600, logging_steps=100)
    try:
        result = cluster.train(argv)
        late_log = (project / "late-pod.log").read_text() + "".join(
            p.read_text() for p in project.glob(".textsql/cluster/*/launches/*/pod-127.0.0.3.log")
        )
        late["pod"].wait(timeout=60)  # its rendezvous store is gone with the launch
    finally:
        if "pod" in late and late["pod"].poll() is None:
            late["pod"].kill()
    summary = result["summary"]
    assert (summary.world_size, summary.global_step) == (1, 600) and result["restarts"] == []
    assert [(r["rank"], r["pid"], r["round"]) for r in result["ranks"]] == [(0, late["pids"][0], 0)]
    assert "added itself to the wait list of round 1" in late_log, late_log[-3000:]
    (worker,) = standin_workers()
    assert worker["status"] == "stopped"
    assert any(
        f"pod {worker['id']} had not joined when the training started at world size 1: stopped" in line
        for line in lines
    )
    wait_until_clean(project)


@pytest.mark.slow
def test_max_restarts_resumes_from_the_newest_complete_checkpoint_after_a_killed_rank(assets, project, clusters):
    """max_restarts=1: rank 1's process alone SIGKILLed once checkpoint-4 is complete; torchrun restarts every pod's
    ranks (a new rendezvous round, a new trainers' store), they resume from the newest checkpoint complete for every
    rank and finish; the restart names rank 1, not rank 0 that lost its peer."""
    runs = project / "runs"
    argv = cluster_argv(assets, runs, "--save_strategy", "steps", "--save_steps", "4", steps=16, logging_steps=2)
    output_dir = runs / "tiny-t5-none-ws2-bs16-lr0.003-steps16-warmup2"
    killed = {}

    def kill_rank():
        deadline = time.monotonic() + 300
        while not (output_dir / "checkpoint-4" / "trainer_state.json").exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        os.kill(rank_pids(project)[1], signal.SIGKILL)
        killed["at"] = time.monotonic()

    killer = threading.Thread(target=kill_rank, daemon=True)
    killer.start()
    result = clusters("local", max_restarts=1).train(argv)
    killer.join(timeout=5)
    assert "at" in killed, "rank 1 was never killed: training ended or stalled before its first checkpoint"
    (restart,) = result["restarts"]
    assert (restart["rank"], restart["node_address"], restart["how"]) == (1, NODES[1], "killed by SIGKILL")
    summary = result["summary"]
    assert summary.global_step == 16 and int(Path(summary.resumed_from).name.split("-")[1]) >= 4
    assert [(r["rank"], r["round"], r["global_step"]) for r in result["ranks"]] == [(0, 1, 16), (1, 1, 16)]
    wait_until_clean(project)


@pytest.mark.slow
def test_max_restarts_restarts_a_raising_rank_and_says_so_when_the_restarts_are_used_up(
    assets, project, clusters, monkeypatch
):
    """max_restarts=1: rank 1 raises while it saves checkpoint-8 in every round. torchrun restarts every pod's ranks
    once (they resume from checkpoint-4), then the restarts are used up: the launch names the last round's failure
    and says that a restart happened, and after which failure."""
    runs = project / "runs"
    argv = cluster_argv(assets, runs, "--save_strategy", "steps", "--save_steps", "4", steps=16, logging_steps=2)
    monkeypatch.setenv("TEXTSQL_TEST_FAULT", "enospc:1:checkpoint-8/rng_state_1.pth")
    with pytest.raises(LaunchFailed) as failure:
        clusters("local", max_restarts=1).train(argv, timeout_s=400)
    message = str(failure.value)
    print(message)
    assert message.startswith("Rank 1 on pod 127.0.0.2 failed first: OSError: [Errno 28] No space left on device")
    assert {f["round"] for f in failure.value.failures} == {1}
    assert re.search(
        r"The restarts are used up: torchrun restarted every rank 1 time\(s\), after rank 1 on pod 127\.0\.0\.2 "
        r"failed in round 0 \(OSError: \[Errno 28\]",
        message,
    ), message
    assert "resumes from checkpoint-4" in failure.value.resume
    assert leftovers(project) == []


def test_max_restarts_is_refused_with_min_workers_from_the_command_line(assets, project):
    from textsql.cli.cluster import cluster_cli

    argv = ["train", "--backend", "local", "--min_workers", "0", "--max_restarts", "1", "--"]
    with pytest.raises(TextsqlError, match="max_restarts cannot be combined with min_workers"):
        cluster_cli(argv + cluster_argv(assets, project / "runs"))


@pytest.mark.slow
def test_a_stopped_rank_is_named_by_its_own_pod_within_60_s(assets, project, clusters):
    """Rank 1's process alone SIGSTOPped (its pod's torchrun runs on, rank 0 waits in a collective): its pod sees
    its heartbeat stop and names it; every process is gone after."""
    hit = {}

    def stop_rank(line):
        os.kill(rank_pids(project)[1], signal.SIGSTOP)
        hit["at"] = time.monotonic()

    cluster = clusters("local", echo=on_line("Training starts", stop_rank))
    with pytest.raises(LaunchFailed) as failure:
        cluster.train(cluster_argv(assets, project / "runs", steps=100000, logging_steps=50))
    message = str(failure.value)
    print(message)
    assert time.monotonic() - hit["at"] < 60
    assert re.match(
        r"Rank 1 on pod 127\.0\.0\.2 failed first: it hung: no sign of life for \d+ s \(its process is stopped\)",
        message,
    )
    assert leftovers(project) == []


def forge_rank_signals(pid: int, stop: threading.Event) -> None:
    """Another local process's forgery of a rank's signals to its pod: through /proc/PID/fd, it writes into the
    rank's own pipe every second a signal one count higher, its progress moved now (it cannot sign it: the key is in
    no environment)."""
    number = environ_of(pid)["TEXTSQL_SIGNAL_FD"]
    with open(f"/proc/{pid}/fd/{number}", "wb", buffering=0) as pipe:
        for count in range(1000, 10**6):
            signal_ = dict(count=count, pid=pid, phase="step", since=time.time(), limit=30.0, assumed="", collective=0)
            pipe.write((json.dumps({"signal": json.dumps(signal_, sort_keys=True), "mac": "0" * 64}) + "\n").encode())
            if stop.wait(1.0):
                return


@pytest.mark.slow
def test_a_rank_blocked_at_step_3_is_named_by_its_pod_even_with_forged_signals(assets, project, clusters, monkeypatch):
    """Rank 1's main thread waits forever in its third step (its heartbeat thread beats on; rank 0 waits for it in a
    collective) while another process rewrites its signals: at the default limits its pod names it, with the limit it
    learned from the steps before, within 60 s; rank 0, which waited, is not the one named."""
    hit, stop = {}, threading.Event()

    def blocked(line):
        hit["at"] = time.monotonic()
        threading.Thread(target=forge_rank_signals, args=(rank_pids(project)[1], stop), daemon=True).start()

    monkeypatch.setenv("TEXTSQL_TEST_FAULT", "block:1:backward:3")
    cluster = clusters("local", echo=on_line("textsql test fault: block", blocked))
    try:
        with pytest.raises(LaunchFailed) as failure:
            cluster.train(cluster_argv(assets, project / "runs", steps=100000), timeout_s=300)
    finally:
        stop.set()
    message = str(failure.value)
    print(message)
    assert time.monotonic() - hit["at"] < 60
    assert re.match(
        r"Rank 1 on pod 127\.0\.0\.2 failed first: it made no progress in its step for \d+ s while alive, blocked",
        message,
    ), message
    assert re.search(r"its limit: 30 s \+ 4 x its slowest step \([\d.]+ s\)", message), message
    waited = [f["how"] for f in failure.value.failures if f["rank"] == 0]
    assert all("made no progress" not in how or "waiting for its peers" in how for how in waited), waited
    assert leftovers(project) == []  # the session's store closed when train() raised (not shared, cycles collected)


def beyond_the_short_limits() -> int:
    """Seconds of healthy slowness that only a phase's own default limit allows: past a pod's silence and first
    heartbeat, and past the learned step limit of a run whose steps take a few seconds (its floor, plus 4 x 2.5 s), so
    that a first step or a save judged by one of those would be named; far inside the first step's and a save's own
    defaults (900 s)."""
    defaults = WatchLimits()
    shorter = max(defaults.silence_seconds, defaults.first_heartbeat_timeout, STEP_FLOOR_S + STEP_MULTIPLE * 2.5)
    assert shorter + 10 < min(defaults.first_step_timeout, defaults.save_timeout)
    return int(shorter + 10)


@pytest.mark.slow
def test_slow_healthy_work_at_the_default_limits_finishes_and_a_pod_30_s_late_trains(
    assets, project, clusters, monkeypatch
):
    """Healthy but slow, at the default limits, in one elastic launch (min_workers=0 of 1 worker): the CML worker is
    scheduled 30 s late and joins within the join window (world size 2, as printed); every rank's first step takes
    50 s more (ZeRO-3 gathers, a cold file system), rank 0's checkpoint save 50 s more and its final save 50 s more
    (a network folder): each past every shorter limit (beyond_the_short_limits). Nothing is named: the run finishes
    with checkpoint-2 and the model saved."""
    run = project / "slow"
    monkeypatch.setenv("CML_STANDIN_SCHEDULE_DELAY", "30")
    slow = beyond_the_short_limits()
    faults = [
        f"sleep={slow}:*:backward:1",
        f"sleep={slow}:0:checkpoint-2/model.safetensors",
        f"sleep={slow}:0:{run.name}/model.safetensors",
    ]
    monkeypatch.setenv("TEXTSQL_TEST_FAULT", ";".join(faults))
    lines = []
    cluster = clusters("cml", min_workers=0, lines=lines)
    argv = cluster_argv(assets, project / "runs", "--output_dir", str(run), "--save_strategy", "steps", steps=4)
    result = cluster.train(argv + ["--save_steps", "2", "--logging_steps", "2"], timeout_s=900)
    summary = result["summary"]
    assert (summary.world_size, summary.global_step) == (2, 4)
    assert [(r["rank"], r["world_size"]) for r in result["ranks"]] == [(0, 2), (1, 2)]
    assert (run / "model.safetensors").is_file() and (run / "checkpoint-2" / "trainer_state.json").is_file()
    assert any("textsql: training at world size 2 on the pods 127.0.0.1, 127.0.0.2" in line for line in lines)
    shown = "\n".join(lines)
    for fault in ("at backward:1", "checkpoint-2/model.safetensors", f"{run.name}/model.safetensors"):
        assert "textsql test fault: sleep=" in shown and fault in shown, fault  # each struck
    wait_until_clean(project)


@pytest.mark.slow
def test_a_one_process_training_binds_torchs_store_to_127_0_0_1(assets, project):
    """`textsql train` in one process with DeepSpeed (a process group of one): torch's store listens on 127.0.0.1
    only, never on every address, for the whole training, in the process and in any child process of it."""
    from test_cluster import listeners

    argv = cluster_argv(assets, project / "runs", "--deepspeed", "zero2", steps=4, logging_steps=2)
    process = subprocess.Popen([sys.executable, "-m", "textsql.train", *argv], cwd=project)
    seen = set()
    while process.poll() is None:
        seen |= {(address, port) for _, _, address, port in listeners([process.pid])}  # its children's too
        time.sleep(0.1)
    assert process.returncode == 0
    assert seen and {ip for ip, _ in seen} == {"127.0.0.1"}, seen


@pytest.mark.slow
def test_tune_measures_a_candidate_on_two_pods_and_stops_one_past_its_limit(assets, project, clusters):
    from textsql.arguments.tune import TuneArguments
    from textsql.tune import run_tune

    data_dir, model_dir = assets
    cluster = clusters("local")
    train_argv = ["--runs_root", str(project / "runs"), "--dataloader_num_workers", "0", "--learning_rate", "1e-3"]

    def tune(folder, **settings):
        args = TuneArguments(
            model_id=str(model_dir),
            dataset_dir=str(data_dir),
            tune_dir=str(project / folder),
            global_batch_size=16,
            micro_batches="8",
            nodes=2,
            strategies="none",
            warmup_steps=1,
            repeat_top=0,
            confirm=False,
            **settings,
        )
        return run_tune(args, train_argv, cluster=cluster)

    result = tune("tune", timed_steps=2)
    (row,) = [json.loads(line) for line in (project / "tune" / "tune_results.jsonl").read_text().splitlines()]
    assert (row["key"], row["status"], row["world_size"]) == ("none-mb8-acc1", "ok", 2) and result.winner is not None
    assert "# Measured on 2 pods" in (project / "tune" / "tune_recipe.yaml").read_text()
    # A candidate far longer than its limit (3,000 steps against 20 s) is stopped on every pod.
    timed_out = tune("tune-limit", timed_steps=3000, candidate_timeout_s=20)
    (row,) = [json.loads(line) for line in (project / "tune-limit" / "tune_results.jsonl").read_text().splitlines()]
    assert (row["status"], row.get("timeout_s")) == ("timed out", 20) and timed_out.winner is None
    assert leftovers(project) == [] and cluster.started
