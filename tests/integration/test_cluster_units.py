"""The parts of textsql.cluster that need no running pod, each fed the facts it decides on: hostfiles and addresses,
the ranks' environment (allowlist, no secrets), the decision made once on the session, GPUs of pods split on one
machine, run locks, checkpoint completeness and resume choice, preparing a run folder, failure attribution and
reports, a rank checking its pod, interrupts during clean-up, and a scan that no code writes an ssh key."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_train_argv

from textsql.cluster.hostfile import Host, HostfileError, check_addresses, parse_hostfile, read_hostfile
from textsql.errors import TextsqlError

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------------------------------
# Hostfiles and addresses
# ---------------------------------------------------------------------------------------------------------------------


def test_hostfile_round_trip_and_the_shipped_example(tmp_path):
    hosts = parse_hostfile("# comment\n\n10.0.0.11 slots=1\n  worker-2.example slots=4  \n")
    assert hosts == [Host("10.0.0.11", 1), Host("worker-2.example", 4)]
    (tmp_path / "hostfile").write_text("10.0.0.11 slots=1\nworker-2.example slots=4\n")
    assert read_hostfile(tmp_path / "hostfile") == hosts
    assert len(read_hostfile(REPO / "hostfile.example")) >= 2


def test_hostfile_errors_name_every_bad_line(tmp_path):
    text = (
        "10.0.0.1 slots=1\n10.0.0.2\n10.0.0.3 slots=0\n10.0.0.1 slots=2\n10.0.0.4 slots=two\n10.0.0.5 slots=1 # gpu box\nbad/host slots=1\n"
        "nœud-1 slots=1\n10.0.0.6 slots=１\n10.0.0.7 slots=٢\nfe80::1 slots=1\n[2001:db8::2] slots=1\n10.0.0.08 slots=1\nWORKER-9 slots=1\nworker-9 slots=1\n"
    )
    with pytest.raises(HostfileError) as error:
        parse_hostfile(text, "my-hostfile")
    message = str(error.value)
    assert message.startswith("Hostfile my-hostfile has 13 problems:")
    for expected in (
        "line 2 ('10.0.0.2'): expected '<address> slots=<N>'",
        "line 3 ('10.0.0.3 slots=0'): slots must be at least 1",
        "line 4 ('10.0.0.1 slots=2'): duplicate host 10.0.0.1, already on line 1",
        "line 5 ('10.0.0.4 slots=two'): slots must be a whole number",
        "line 6 ('10.0.0.5 slots=1 # gpu box'): a comment after an entry",
        "line 7 ('bad/host slots=1'): 'bad/host' is not a host name",
        "line 8 ('nœud-1 slots=1'): 'nœud-1' has non-ASCII characters",
        "line 9 ('10.0.0.6 slots=１'): slots must be a whole number of GPUs in ASCII digits",
        "line 10 ('10.0.0.7 slots=٢'): slots must be a whole number of GPUs in ASCII digits",
        "line 11 ('fe80::1 slots=1'): 'fe80::1' is an IPv6 address",
        "line 12 ('[2001:db8::2] slots=1'): '[2001:db8::2]' is an IPv6 address",
        "line 13 ('10.0.0.08 slots=1'): '10.0.0.08' has a part with a leading zero",
        "line 15 ('worker-9 slots=1'): duplicate host worker-9, already on line 14",
    ):
        assert expected in message, expected
    with pytest.raises(HostfileError, match="no hosts"):
        parse_hostfile("# nothing\n")
    with pytest.raises(HostfileError, match="does not exist"):
        read_hostfile(tmp_path / "missing")


def test_aliases_of_one_machine_and_unresolvable_hosts_are_refused():
    # The real resolver: localhost is 127.0.0.1 on every machine.
    with pytest.raises(HostfileError, match=r"localhost and 127.0.0.1 are the same machine \(127.0.0.1\)"):
        check_addresses([Host("localhost"), Host("127.0.0.1")])
    check_addresses([Host("127.0.0.1"), Host("127.0.0.2")])
    table = {"gpu-a": {"10.0.0.1"}, "gpu-a.corp": {"10.0.0.1"}, "10.0.0.1": {"10.0.0.1"}, "gpu-b": {"10.0.0.2"}}
    with pytest.raises(HostfileError) as error:
        check_addresses(
            [Host("gpu-a"), Host("gpu-b"), Host("gpu-a.corp"), Host("10.0.0.1"), Host("gone")],
            resolver=lambda a: table.get(a, set()),
        )
    message = str(error.value)
    assert (
        "gpu-a and gpu-a.corp are the same machine (10.0.0.1)" in message
        and "gpu-a and 10.0.0.1 are the same machine" in message
    )
    assert "gone does not resolve to an IPv4 address here" in message


# ---------------------------------------------------------------------------------------------------------------------
# The ranks' environment
# ---------------------------------------------------------------------------------------------------------------------

CANARY = "hf_canary_0123456789abcdef"


def test_only_allowlisted_variables_reach_the_ranks_and_never_a_secret():
    from textsql.redaction import for_pod, forwarded, system

    environ = {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "NCCL_DEBUG": "INFO",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "CUDA_LAUNCH_BLOCKING": "1",
        "DS_ACCELERATOR": "cpu",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": "/h",
        "GLOO_SOCKET_IFNAME": "eth0",
        "TEXTSQL_TEST_FAULT": "x",
        "TEXTSQL_FORWARD_ENV": "TEXTSQL_TEST_FAULT, MY_APP_*",
        "MY_APP_LEVEL": "3",
        "PYTHONPATH": "/p",
        "OMP_NUM_THREADS": "4",
        "HF_TOKEN": CANARY,
        "TEXTSQL_CLUSTER_TOKEN": CANARY,
        "AWS_SECRET_ACCESS_KEY": CANARY,
        "NCCL_PASSWORD": CANARY,
        "DS_API_KEY": CANARY,
        "CDSW_API_KEY": CANARY,
        "MY_APP_SETTING": "no",
        "HOME": "/home/cdsw",
        "PATH": "/usr/bin",
        "LC_ALL": "C.UTF-8",
        # bare KEY, PWD, PASS and PAT as a word of the name, and credentials inside a URL (issue 23)
        "HF_KEY": CANARY,
        "TEXTSQL_DB_PWD": CANARY,
        "TEXTSQL_DB_PASS": CANARY,
        "HF_PAT": CANARY,
        "DS_KEYS": CANARY,
        "NCCL_PASSPHRASE": CANARY,
        "TEXTSQL_DB_URL": f"postgresql://textsql:{CANARY}@db.internal:5432/wikisql",
        "HF_ENDPOINT": f"https://{CANARY}@hub.internal",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_CACHE": "/pat/h",
        "TEXTSQL_PATH_HINT": "keyboard",
        # secrets under names no filter knows, and a value that is a connection string (issue 40): not asked for
        "TEXTSQL_DB_CONN": f"host=db.internal user=textsql password={CANARY}",
        "HF_HUB_DOWNLOAD_SIG": CANARY,
        "NCCL_SOCKET_OPTS": f"dbname=x password={CANARY}",
        # credentials under the allowlisted prefixes (issue 48): a bearer token, a key anywhere in the name
        "DS_BEARER": CANARY,
        "NCCL_BEARER_HEADER": CANARY,
        "GLOO_KEYFILE": CANARY,
        "DS_AUTHORIZATION": CANARY,
        "TORCH_NCCL_CREDENTIALS": CANARY,
        # the user's own variables, by name (Cluster(forward_env=...), --forward_env): never a secret either
        "MY_SETTING": "on",
        "MY_BEARER": CANARY,
    }
    env = forwarded(environ, ("MY_SETTING", "MY_BEARER"))
    assert "MY_SETTING" not in forwarded(environ)
    assert sorted(env) == [
        "CUDA_LAUNCH_BLOCKING",
        "DS_ACCELERATOR",
        "GLOO_SOCKET_IFNAME",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "MY_APP_LEVEL",
        "MY_APP_SETTING",
        "MY_SETTING",
        "NCCL_DEBUG",
        "OMP_NUM_THREADS",
        "PYTHONPATH",
        "PYTORCH_CUDA_ALLOC_CONF",
        "TEXTSQL_TEST_FAULT",
        "TOKENIZERS_PARALLELISM",
        "TORCH_DISTRIBUTED_DEBUG",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    ]
    assert CANARY not in json.dumps(for_pod(dict(environ, CUDA_VISIBLE_DEVICES="1")))
    assert for_pod(dict(environ, CUDA_VISIBLE_DEVICES="1"))["CUDA_VISIBLE_DEVICES"] == "1"
    basics = system(dict(environ, LANG=f"ftp://anonymous:{CANARY}@x"))
    assert basics["PATH"].split(os.pathsep)[:2] == [str(Path(sys.executable).parent), "/usr/bin"]
    assert basics["HOME"] == "/home/cdsw" and basics["LC_ALL"] == "C.UTF-8" and CANARY not in json.dumps(basics)


def test_the_node_local_build_folder_is_private_or_refused(tmp_path, monkeypatch):
    import stat
    import tempfile

    from textsql.strategy.opbuilds import node_local_extensions_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = tmp_path / f"textsql-{os.getuid()}"
    assert node_local_extensions_dir() == str(root / "torch-extensions")
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700 and os.lstat(root).st_uid == os.getuid()
    root.chmod(0o755)  # made by an earlier textsql with the default umask: nobody else could write into it
    node_local_extensions_dir()
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700

    root.chmod(0o777)  # anyone could have planted a library in it
    with pytest.raises(TextsqlError, match=r"is not your private folder: others can write into it \(mode 777\)"):
        node_local_extensions_dir()
    root.chmod(0o700)
    root.rename(tmp_path / "elsewhere")
    root.symlink_to(tmp_path / "elsewhere")  # another user's link to a folder they control
    with pytest.raises(TextsqlError, match=r"is not your private folder: it is a symbolic link"):
        node_local_extensions_dir()
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["torch-extensions"]  # untouched
    root.unlink()
    if os.geteuid() == 0:  # only root can make a folder of another user's here
        root.mkdir(mode=0o700)
        os.chown(root, 65534, 65534)
        with pytest.raises(TextsqlError, match=r"belongs to user id 65534, not to you"):
            node_local_extensions_dir()
        root.rmdir()
    root.mkdir()
    root.chmod(0o777)  # as another user would, first
    # A pod refuses to start, naming itself, unless the user chose a folder.
    from textsql.cluster.pods import pod_environment

    spec = {"env": {}, "accelerator": "cpu", "launch_id": "L1"}
    environ = {"TEXTSQL_LAUNCH": "x", "TEXTSQL_POD_RANKS": "1", "HF_TOKEN": "secret", "OMP_NUM_THREADS": "1"}
    with pytest.raises(TextsqlError, match=r"is not your private folder"):
        pod_environment(spec, "127.0.0.1", environ)
    env = pod_environment(dict(spec, env={"TORCH_EXTENSIONS_DIR": "/mine"}), "127.0.0.1", environ)
    assert env["TORCH_EXTENSIONS_DIR"] == "/mine" and "HF_TOKEN" not in env and env["DS_ACCELERATOR"] == "cpu"
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["TEXTSQL_POD_ADDRESS"] == "127.0.0.1"


def test_a_pods_heartbeat_counts_only_signed_with_the_launchs_key():
    """What the session reads of a pod's heartbeat in its store (a real TCPStore): the count the pod signed with the
    launch's key; nothing for a value another process added, replayed one higher or signed with another key."""
    from textsql.cluster.pods import _beats_of, signed
    from textsql.train.distributed import bound_store

    store, key, name = bound_store("127.0.0.1"), "k" * 64, "textsql/alive/10.0.0.2"
    assert _beats_of(store, key, "10.0.0.2") == 0
    store.set(name, signed(key, "10.0.0.2", 7))
    assert _beats_of(store, key, "10.0.0.2") == 7
    count, mac = store.get(name).decode().split(":")
    for forged in (f"8:{mac}", signed("another key", "10.0.0.2", 8), signed(key, "10.0.0.3", 8), "x:y", "9" * 5000):
        store.set(name, forged)
        assert _beats_of(store, key, "10.0.0.2") == 0, forged
    store.add("textsql/alive/10.0.0.3", 1)
    assert _beats_of(store, key, "10.0.0.3") == 0


def test_a_store_closed_stops_listening_unless_another_store_of_the_process_shares_it():
    """A process group's store (torch's multi-tenant TCPStore on the same port) gets a shared store's server and keeps
    it listening after the launch let it go; the session's store is not shared (torch cannot open a second server on
    its port), and one held only in a reference cycle stops listening when it is closed."""
    import datetime
    import gc

    import torch.distributed as dist

    from textsql.train.distributed import bound_store, close_stores

    def process_groups_store(port):
        timeout = datetime.timedelta(seconds=5)
        return dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timeout)

    shared = [bound_store("127.0.0.1")]
    port = shared[0].port
    other = process_groups_store(port)
    assert close_stores(shared) == [port]  # still listening: the process group's store holds it
    del other
    session = [bound_store("127.0.0.1", shared=False)]
    with pytest.raises(Exception, match="(?i)address already in use|failed to bind|address in use"):
        process_groups_store(session[0].port)
    cycle = [session[0]]
    cycle.append(cycle)  # garbage that holds the store until a collection
    gc.disable()
    try:
        del cycle
        assert close_stores(session) == []
    finally:
        gc.enable()


def test_a_ranks_signal_says_when_its_main_thread_waits_in_a_collective_and_counts_only_signed():
    """The rank's heartbeat thread (textsql.train.watch.beat) signs each signal into its pipe and looks at where the
    main thread is: inside code of torch.distributed (here a frame compiled under that name, waiting) it says
    "collective", elsewhere not. A line read with another key, for another process, or rewritten is nothing."""
    import json
    import threading

    from textsql.train import watch
    from textsql.train.watch import WatchLimits, beat, read_signal

    read, write = os.pipe()
    os.set_blocking(read, False)
    key, lines = b"k" * 64, []
    threading.Thread(
        target=beat, args=(write, key, WatchLimits(silence_seconds=0.2, first_heartbeat_timeout=1)), daemon=True
    ).start()

    def look():
        with contextlib.suppress(BlockingIOError):
            lines.extend(os.read(read, 65536).splitlines())
        return read_signal(lines[-1], key, os.getpid())["collective"] if lines else None

    time.sleep(0.5)
    # the phase this process is in (a training run earlier in this test process may have moved it past "setup")
    assert look() is False and read_signal(lines[-1], key, os.getpid())["phase"] == watch.current()["name"]
    seen = []
    waiting = "import time\nfor _ in range(40):\n    seen.append(look())\n    time.sleep(0.05)\n"
    exec(compile(waiting, "/venv/lib/torch/distributed/distributed_c10d.py", "exec"), {"look": look, "seen": seen})
    assert True in seen[10:]
    seen.clear()  # a lock taken under such a frame (a signal handler's, a callback's) is no collective
    blocked = (
        "import time\ndef wait():\n    for _ in range(40):\n        seen.append(look())\n        time.sleep(0.05)\n"
    )
    exec(compile(blocked, "/elsewhere/lock.py", "exec"), scope := {"look": look, "seen": seen})
    exec(compile("wait()", "/venv/lib/torch/autograd/graph.py", "exec"), scope)
    assert True not in seen[10:]
    outer = json.loads(lines[-1])
    assert read_signal(lines[-1], b"another key", os.getpid()) is None and read_signal(lines[-1], key, 1) is None
    forged = json.loads(outer["signal"]) | {"count": 10**6}
    assert (
        read_signal(json.dumps({"signal": json.dumps(forged), "mac": outer["mac"]}).encode(), key, os.getpid()) is None
    )


def test_each_phase_is_judged_by_its_own_limit_and_the_step_limit_is_learned():
    """textsql.train.watch: the training loop's callbacks announce each phase; the first step has its own allowance,
    later steps a limit learned from the slowest since (never above --step_timeout), a save and an evaluation their
    own; nothing is watched before the loop or after the last save; a rank waiting for its peers gets the longest."""
    from textsql.train import watch
    from textsql.train.watch import WatchLimits

    limits = WatchLimits()
    assert limits.of(dict(watch.current(), name="setup"), False) == (None, "not watched")  # loading
    watch.begin_training()
    assert limits.of(watch.current(), False)[0] == limits.first_step_timeout == 900
    for took in (0.3, 0.05, 0.2):  # the first step (0.3 s) is not learned from
        time.sleep(took)
        watch.advance(step_done=True)
    limit, assumed = limits.of(watch.current(), False)
    assert 30.8 <= limit < 31.5 and assumed.startswith("30 s + 4 x its slowest step (0.2 s)")
    assert limits.of(dict(watch.current(), slowest=500.0), False) == (
        600,
        "--step_timeout 600 s (its slowest step took 500.0 s)",
    )
    assert limits.of(watch.current(), True)[0] == 900  # waiting in a collective: its peers may be saving
    with watch.phase("final save"):
        assert limits.of(watch.current(), False) == (900, "--save_timeout 900 s without a byte written")
    assert limits.of(watch.current(), False)[0] is None  # finishing: after the last save
    watch.enter("final evaluation")
    assert limits.of(watch.current(), False)[0] == 600
    with pytest.raises(TextsqlError, match="save_timeout must be a number of seconds above 0"):
        WatchLimits(save_timeout=0)
    with pytest.raises(TextsqlError, match="first_heartbeat_timeout .* must be at least silence_seconds"):
        WatchLimits(silence_seconds=60)


def test_every_rank_slow_in_the_same_phase_is_said_so_instead_of_naming_one(tmp_path):
    from textsql.cluster.launch import failure_message

    def slow(rank, phase, at):
        how = f"it made no progress in its {phase} for 901 s while alive, blocked (a deadlock, a lock; its limit: ...)"
        return {"rank": rank, "node_address": f"10.0.0.{rank}", "how": how, "phase": phase, "ended_at": at}

    message = failure_message([slow(1, "final save", 2.0), slow(0, "final save", 1.0)], {}, tmp_path, None)
    assert message.startswith(
        "Every rank that failed (ranks 0 on pod 10.0.0.0, 1 on pod 10.0.0.1) was in its final save without progress"
    ), message
    assert "failed first" not in message
    message = failure_message([slow(1, "final save", 2.0), slow(0, "step", 1.0)], {}, tmp_path, None)
    assert message.startswith("Rank 0 on pod 10.0.0.0 failed first: it made no progress in its step"), message


def test_each_local_node_gets_its_own_gpus_and_cores():
    from textsql.strategy.devices import (
        A100_40GB,
        NodeDevices,
        node_gpu_ids,
        split_local_cores,
        split_local_gpus,
    )

    box = NodeDevices((A100_40GB,) * 4, 16)
    assert split_local_gpus([2, 2], box, None) == ["0,1", "2,3"]
    assert split_local_gpus([1, 1, 1], box, None) == ["0", "1", "2"]
    assert split_local_gpus([2, 2], box, "4,5,6,7") == ["4,5", "6,7"]  # the user's CUDA_VISIBLE_DEVICES is respected
    assert split_local_gpus([1, 1], NodeDevices((), 2), None) == [None, None]
    with pytest.raises(TextsqlError, match="need 6 GPUs, but this machine has 4 visible"):
        split_local_gpus([2, 4], box, None)
    with pytest.raises(TextsqlError, match="names GPUs by UUID"):
        split_local_gpus([1], NodeDevices((A100_40GB,), 4), "GPU-6e1f4c7a")
    assert split_local_cores([0, 1], 2) == [[0], [1]] and split_local_cores([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]]
    assert split_local_cores([0, 1], 3) == [[0], [1], [0]]
    node1 = NodeDevices((A100_40GB,) * 2, 8)  # node 1 of a box split in two sees GPUs 2,3
    assert node_gpu_ids(2, node1, "2,3") == [2, 3] and node_gpu_ids(1, node1, None) == [0]
    assert node_gpu_ids(1, NodeDevices(), None) is None


def test_a_nodes_devices_asked_in_a_child_process_are_the_same():
    from textsql.strategy.devices import NodeDevices, local_devices

    assert local_devices(isolated=True) == local_devices(isolated=False) == NodeDevices.local()


@pytest.mark.parametrize(
    "flags",
    [
        {"include": "b:1,2@a"},
        {"include": "c"},
        {"exclude": "b"},
        {"exclude": "a:0@b:0,3"},
        {"num_nodes": 2},
    ],
)
def test_host_selection_means_what_deepspeeds_launcher_makes_of_the_same_flags(tmp_path, flags):
    """--include/--exclude/--num_nodes choose the hosts and slots DeepSpeed's own runner would, in hostfile order."""
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, fetch_hostfile, parse_inclusion_exclusion

    from textsql.cluster.hostfile import HostSelection, select_hosts

    (tmp_path / "hostfile").write_text("a slots=2\nb slots=4\nc slots=1\n")
    hosts = read_hostfile(tmp_path / "hostfile")
    theirs = parse_inclusion_exclusion(
        fetch_hostfile(str(tmp_path / "hostfile")), flags.get("include", ""), flags.get("exclude", "")
    )
    theirs = apply_num_nodes_and_gpus(theirs, flags.get("num_nodes", -1), -1)
    ours = select_hosts(hosts, HostSelection(**flags))
    assert [(h.address, h.slots) for h in ours] == [(a, len(slots)) for a, slots in theirs.items()]


def test_host_selection_is_checked_against_the_hostfile_with_the_fix(tmp_path):
    from textsql.cluster.hostfile import HostfileError, HostSelection, select_hosts

    hosts = parse_hostfile("a slots=2\nb slots=1\n")
    cases = {  # DeepSpeed's own reading of the flags, with the hostfile's hosts and the fix
        r"Hostname 'nowhere' not found in hostfile\. Write HOST\[:SLOT.* of the hostfile \(a, b\)": {
            "include": "a@nowhere"
        },
        r"No slot '2' specified on host 'a'": {"exclude": "a:2"},
        r"'a:x': invalid literal": {"include": "a:x"},
        r"leaves no host of the hostfile \(a, b\) to train on": {"exclude": "a@b"},
        r"--num_nodes 3 asks for more hosts than the hostfile has \(2: a, b\)": {"num_nodes": 3},
    }
    for message, flags in cases.items():
        with pytest.raises(HostfileError, match=message):
            select_hosts(hosts, HostSelection(**flags))
    refused = {
        "cannot both be given": dict(include="a", exclude="b"),
        "cannot be combined with --include or --exclude": dict(include="a", num_nodes=1),
        "--num_nodes must be at least 1": dict(num_nodes=0),
        "--master_port must be a port from 1024 to 65535": dict(master_port=80),
    }
    for message, flags in refused.items():
        with pytest.raises(HostfileError, match=message):
            HostSelection(**flags)
    assert select_hosts(hosts, HostSelection(exclude="a:0")) == [Host("a", 1), Host("b", 1)]


# ---------------------------------------------------------------------------------------------------------------------
# Runs: the lock, checkpoints, resume
# ---------------------------------------------------------------------------------------------------------------------


def test_a_second_launch_into_a_run_folder_is_refused_here_and_from_another_process(tmp_path):
    from textsql.cluster.runs import run_lock

    run = tmp_path / "runs" / "tiny-t5-zero2-ws2-bs16"
    with run_lock(run, "L1"):
        with pytest.raises(
            TextsqlError, match=r"The run folder .*tiny-t5-zero2-ws2-bs16 is in use by process \d+ on .* \(launch L1\)"
        ):
            run_lock(run, "L2")
        code = "import sys; from pathlib import Path; from textsql.cluster.runs import run_lock; run_lock(Path(sys.argv[1]), 'L3')"
        other = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True)
        assert other.returncode != 0 and "is in use by process" in other.stderr and "(launch L1)" in other.stderr
    run_lock(run, "L4").release()  # free again once the first launch ended


def files(*names, cut=()):
    return {name: name not in cut for name in names}


def ddp(step, ranks=(0, 1), cut=()):
    return files(
        "trainer_state.json",
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "config.json",
        *[f"rng_state_{r}.pth" for r in ranks],
        cut=cut,
    )


def zero(step, stage, ranks=(0, 1), model_states=True, trainer_state=True, cut=()):
    names = ["config.json", "model.safetensors", "latest", "scheduler.pt"] + (
        ["trainer_state.json"] if trainer_state else []
    )
    names += [f"rng_state_{r}.pth" for r in ranks] + [
        f"global_step{step}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in ranks
    ]
    if stage == 3:
        names += [f"global_step{step}/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks]
    elif model_states:
        names.append(f"global_step{step}/mp_rank_00_model_states.pt")
    return files(*names, cut=cut)


def test_what_makes_a_checkpoint_complete():
    from textsql.checkpoints import missing_parts

    assert missing_parts(ddp(10), 10, 2, None) == []
    assert missing_parts(ddp(10, ranks=(0,)), 10, 2, None) == ["rank 1's RNG state (rng_state_1.pth) is missing"]
    assert missing_parts(ddp(10, cut=("optimizer.pt",)), 10, 2, None) == [
        "the optimizer state (optimizer.pt) is cut short"
    ]
    assert missing_parts(zero(10, 2), 10, 2, 2) == [] and missing_parts(zero(10, 3), 10, 2, 3) == []
    assert missing_parts(zero(10, 3, cut=("global_step10/zero_pp_rank_1_mp_rank_00_model_states.pt",)), 10, 2, 3) == [
        "rank 1's model states (global_step10/zero_pp_rank_1_mp_rank_00_model_states.pt) is cut short"
    ]
    assert missing_parts(zero(10, 2, trainer_state=False), 10, 2, 2) == [
        "the trainer state (trainer_state.json) is missing"
    ]
    bf16 = {k.replace("zero_pp", "bf16_zero_pp"): v for k, v in zero(10, 2).items()}
    assert missing_parts(bf16, 10, 2, 2) == []  # the bf16 optimizer's shard names


def test_resume_picks_the_newest_checkpoint_complete_everywhere_and_says_so():
    from textsql.cluster.runs import choose_checkpoint

    shared = {"checkpoint-5": zero(5, 2), "checkpoint-10": zero(10, 2), "checkpoint-15": zero(15, 2, ranks=(0,))}
    plan = choose_checkpoint(shared, 2, 2)
    assert plan.checkpoint == "checkpoint-10" and list(plan.set_aside) == ["checkpoint-15"]
    assert plan.sentence() == (
        "resumes from checkpoint-10 (the newest checkpoint complete on every node; checkpoint-15 is incomplete: rank 1's RNG "
        "state (rng_state_1.pth) is missing, rank 1's optimizer shard (global_step15/zero_pp_rank_1_mp_rank_00_optim_states.pt) is missing)"
    )
    nothing = choose_checkpoint({"checkpoint-5": ddp(5, cut=("model.safetensors",))}, 2, None)
    assert nothing.checkpoint is None and nothing.sentence().startswith(
        "starts from step 0 (no checkpoint is complete on every node; checkpoint-5 is incomplete"
    )
    assert choose_checkpoint({}, 2, None).sentence() == "starts from step 0 (no checkpoint is complete on every node)"


def test_resume_at_another_world_size_takes_zero_and_ddp_checkpoints_and_refuses_sharded_ones_naming_both_sizes():
    """A checkpoint is complete for the ranks that wrote it: at another size, ZeRO's shards (converted to the universal
    format before training) and DDP's whole-model files resume; FSDP's sharded files and ZeRO-Infinity's swapped
    optimizer states are refused, naming both sizes and why. The global batch is kept where it divides."""
    from textsql.cluster.runs import choose_checkpoint, kept_accumulation

    two = {"checkpoint-5": zero(5, 2), "checkpoint-10": zero(10, 2, ranks=(0,))}
    for world, recorded in ((3, 2), (1, None), (4, 2)):
        plan = choose_checkpoint(two, world, 2, recorded_world_size=recorded)
        assert (plan.checkpoint, plan.saved_world_size, list(plan.set_aside)) == ("checkpoint-5", 2, ["checkpoint-10"])
        assert plan.sentence().startswith(
            "resumes from checkpoint-5 (the newest checkpoint complete on every node, written at world size 2; checkpoint-10 is incomplete: rank 1's"
        )
    one = {
        "checkpoint-5": files(
            "trainer_state.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"
        )
    }
    assert (
        choose_checkpoint(one, 2, None).saved_world_size == 1
        and choose_checkpoint(one, 1, None).saved_world_size is None
    )
    fsdp = {"checkpoint-5": dict(ddp(5), **files("pytorch_model_fsdp_0/__0_0.distcp", "optimizer_0/__0_0.distcp"))}
    nvme = {"checkpoint-5": dict(zero(5, 3), **files("global_step5/offloaded_tensors/rank0/tensor.swp"))}
    for listing, why in ((fsdp, "FSDP's sharded checkpoints"), (nvme, "ZeRO-Infinity's checkpoints")):
        with pytest.raises(
            TextsqlError,
            match=rf"checkpoints of a run with world size 2 \(checkpoint-5\), but this launch has world size 3: {why}",
        ):
            choose_checkpoint(listing, 3, None, recorded_world_size=2)
    assert kept_accumulation(2, 3, 1) == (6, None) and kept_accumulation(2, 3, 3) == (2, None)
    accumulation, said = kept_accumulation(2, 1, 3)
    assert accumulation == 1 and said.startswith(
        "the global batch of 2 micro-batches (2 ranks x 1) cannot be kept at world size 3: it becomes 3"
    )


def test_the_planned_run_folder_is_the_one_train_writes(tmp_path):
    from textsql.arguments.training import parse_arguments
    from textsql.cluster.runs import interrupted_siblings, planned_run_dir

    def planned(argv, world_size):
        model, _, training = parse_arguments(argv)
        return planned_run_dir(model, training, world_size, tmp_path)

    assert (
        planned(["--model_id", "x/tiny-t5", "--deepspeed", "zero3_offload", "--per_device_train_batch_size", "8"], 4)
        == tmp_path / "runs" / "tiny-t5-zero3_offload-ws4-bs8"
    )
    assert planned(["--runs_root", "/r", "--output_dir", "out"], 2) == tmp_path / "out"
    assert planned(["--runs_root", "/r"], 2) == Path("/r/t5-small-none-ws2-bs32")
    assert "WORLD_SIZE" not in os.environ
    (tmp_path / "runs" / "tiny-t5-none-ws2-bs16" / "checkpoint-5").mkdir(parents=True)
    (tmp_path / "runs" / "tiny-t5-none-ws4-bs16" / "checkpoint-5").mkdir(parents=True)
    (tmp_path / "runs" / "tiny-t5-none-ws4-bs16" / "run_summary.json").write_text("{}")  # finished: not in the way
    assert interrupted_siblings(tmp_path / "runs" / "tiny-t5-none-ws3-bs16", 3) == {
        2: tmp_path / "runs" / "tiny-t5-none-ws2-bs16"
    }


# ---------------------------------------------------------------------------------------------------------------------
# Interrupts, the CLI, and no ssh keys anywhere
# ---------------------------------------------------------------------------------------------------------------------


def test_a_second_ctrl_c_waits_until_clean_up_is_done():
    from textsql.cluster.pods import interrupts_deferred

    said, done = [], []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred(said.append):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            done.append("clean-up finished")
    assert done == ["clean-up finished"] and "still stopping the pods" in said[0]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_cluster_cli_checks_a_hostfile(tmp_path, capsys):
    from textsql.cli.cluster import cluster_cli

    assert cluster_cli(["check-hostfile", str(REPO / "hostfile.example")]) == 0
    assert "OK, 3 nodes, 3 ranks (rank 0 on 10.0.0.11)" in capsys.readouterr().out
    (tmp_path / "h").write_text("a slots=0\n")
    with pytest.raises(HostfileError, match="slots must be at least 1"):
        cluster_cli(["check-hostfile", str(tmp_path / "h")])
    assert cluster_cli(["--help"]) == 0 and cluster_cli([]) == 2
    job = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "cml_job.py"), "cluster", "--help"], capture_output=True, text=True
    )
    assert job.returncode == 0 and "as a Job" in job.stdout  # what a CML Job runs


KEY_WRITING = re.compile(
    r"ssh-keygen|authorized_keys|\bid_(?:rsa|dsa|ecdsa|ed25519)\b|PRIVATE KEY|ssh_host_[a-z0-9]+_key|HostKey="
)


def test_no_code_path_writes_an_ssh_key_or_authorized_keys():
    """textsql, its notebooks, scripts and images never make, write or name an ssh key or authorized_keys file (the
    multi-pod design needs none); the user-managed path uses the user's own keys, read by ssh itself."""
    checked = [
        p
        for folder in ("textsql", "scripts", "notebooks", "docker")
        for p in (REPO / folder).rglob("*")
        if p.is_file() and p.suffix in ("", ".py", ".sh", ".ipynb", ".jupyter", ".workbench", ".yaml", ".md")
    ]
    assert len(checked) > 20
    found = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in checked
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if KEY_WRITING.search(line)
    ]
    assert found == []


# ---------------------------------------------------------------------------------------------------------------------
# The launch on the session, and a rank checking its pod
# ---------------------------------------------------------------------------------------------------------------------


def test_the_rank_that_failed_first_is_named_not_a_peer_that_lost_its_connection(tmp_path):
    from textsql.cluster.launch import failure_message, first_failure, read_records, write_record

    (tmp_path / "ranks").mkdir()
    write_record(
        tmp_path,
        "failure",
        {
            "rank": 0,
            "node_address": "10.0.0.1",
            "ended_at": 5.0,
            "how": "RuntimeError: [gloo] Connection closed by peer [10.0.0.2]:1234",
            "tail": [],
        },
    )
    write_record(
        tmp_path,
        "failure",
        {
            "rank": 1,
            "node_address": "10.0.0.2",
            "ended_at": 7.0,
            "how": "OSError: [Errno 28] No space left on device",
            "tail": ["Traceback", "OSError: ..."],
        },
    )
    (tmp_path / "ranks" / "r0-rank-2.failure.json").write_text("{not json")  # skipped, not a crash
    failures = read_records(tmp_path, "failure")
    assert [f["rank"] for f in failures] == [0, 1] and first_failure(failures)["rank"] == 1
    message = failure_message(failures, {}, tmp_path, "resumes from checkpoint-4 (...)")
    assert message.startswith("Rank 1 on pod 10.0.0.2 failed first: OSError: [Errno 28] No space left on device.")
    assert "  | OSError: ..." in message and "Then rank 0 on 10.0.0.1: RuntimeError" in message
    assert "(stopped because of it)" in message and message.endswith("the next launch resumes from checkpoint-4 (...).")
    lost = failure_message(failures[:1], {"10.0.0.2": "it was killed by SIGKILL"}, tmp_path, None)
    assert lost.startswith("Pod 10.0.0.2 was lost first: it was killed by SIGKILL.\nThen rank 0 on 10.0.0.1")


def test_the_session_decides_once_and_prepares_the_run_folder(assets, tmp_path, monkeypatch):
    from textsql.cluster.launch import PreflightError, plan_launch, prepare
    from textsql.cluster.runs import RECORD
    from textsql.strategy.devices import A100_40GB, V100, NodeDevices

    argv = tiny_train_argv(assets, tmp_path / "runs", "--save_steps", "2", max_steps=4)
    cpu, a100 = NodeDevices((), 8), NodeDevices((A100_40GB,) * 2, 16)
    plan = plan_launch(argv, ranks=[None, 1], devices=cpu, workdir=tmp_path, log_root=tmp_path / "l", env={})
    assert (plan.world_size, plan.accelerator, plan.precision.name) == (2, "cpu", "fp32")
    assert plan.arguments["accelerator"] == "cpu" and plan.arguments["bf16"] is False
    gpus = plan_launch(
        argv,
        ranks=[None, 2],
        devices=a100,
        workdir=tmp_path,
        log_root=tmp_path / "l",
        env={"NCCL_DEBUG": "INFO"},
    )
    assert (gpus.world_size, gpus.accelerator) == (4, "cuda") and gpus.env == {"NCCL_DEBUG": "INFO"}
    # What a cluster's ranks get of this environment: the allowlist and the user's own names, never a secret.
    from textsql.cluster import Cluster

    for name, value in {"HF_TOKEN": "x", "NCCL_DEBUG": "INFO", "DS_BEARER": "x", "MINE": "1", "MY_KEY": "x"}.items():
        monkeypatch.setenv(name, value)
    with Cluster("local", forward_env=("MINE", "MY_KEY"), project_dir=tmp_path) as cluster:
        env = cluster.plan(argv).env
    assert env["MINE"] == "1" and env["NCCL_DEBUG"] == "INFO" and not {"HF_TOKEN", "DS_BEARER", "MY_KEY"} & set(env)
    with pytest.raises(PreflightError, match="2 processes per node were asked for"):
        plan_launch(argv, ranks=[2, 1], devices=NodeDevices((V100,), 8), workdir=tmp_path, log_root=tmp_path, env={})
    # A partial newer checkpoint is set aside (renamed, never deleted); the launch record says the world size.
    run = plan.run_dir
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoint-2" / "trainer_state.json").write_text("{}")
    plan = plan_launch(argv, ranks=[None, 1], devices=cpu, workdir=tmp_path, log_root=tmp_path / "l", env={})
    prepare(plan)
    assert plan.resume.checkpoint is None and list(run.glob("incomplete-checkpoint-2-*"))
    assert not (run / RECORD).exists()  # rank 0 writes it, once the launch's world size is known
    assert str(plan.launch_dir / "shared-marker") in plan.expect["files"]


def test_a_rank_checks_its_pod_against_the_session(tmp_path):
    from textsql.cluster.launch import digest, versions
    from textsql.cluster.rank import check_pod

    (tmp_path / "ds.json").write_text("{}")
    good = {
        "versions": versions(),
        "dirs": [str(tmp_path)],
        "files": {str(tmp_path / "ds.json"): digest(tmp_path / "ds.json")},
    }
    check_pod({"expect": good, "accelerator": "cpu", "precision": "fp32", "workdir": os.getcwd()}, "pod 10.0.0.2")
    bad = {
        "versions": dict(versions(), torch="0.0"),
        "dirs": [str(tmp_path / "missing")],
        "files": {str(tmp_path / "ds.json"): "0" * 64, str(tmp_path / "shared-marker"): "1" * 64},
    }
    with pytest.raises(TextsqlError) as error:
        check_pod({"expect": bad, "accelerator": "cuda", "precision": "fp32", "workdir": "/x"}, "pod 10.0.0.2 (rank 1)")
    message = str(error.value)
    assert message.startswith("The preflight failed on pod 10.0.0.2 (rank 1): torch ")
    assert "does not exist here" in message and "differs from the session copy" in message
    assert "launch folder is not shared with this pod" in message and "this rank has none" in message
    assert "the session in /x (relative paths would differ)" in message
