"""The parts of textsql.cluster that need no running node, each fed the facts it decides on: hostfiles and addresses,
the ranks' environment (allowlist, no secrets), device and precision decisions for A100/V100/CPU clusters, GPUs of
nodes split on one machine, the control channel's handshake, run locks, checkpoint completeness and resume choice,
failure attribution and reports, the DeepSpeed command and its spec, interrupts during clean-up, and a scan that no
code writes an ssh key."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import tiny_train_argv

from textsql.cluster.hostfile import (
    Host,
    HostfileError,
    check_addresses,
    format_hostfile,
    parse_hostfile,
    rank_layout,
    read_hostfile,
    write_hostfile,
)
from textsql.errors import TextsqlError

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------------------------------
# Hostfiles and addresses
# ---------------------------------------------------------------------------------------------------------------------


def test_hostfile_round_trip_and_the_shipped_example(tmp_path):
    hosts = parse_hostfile("# comment\n\n10.0.0.11 slots=1\n  worker-2.example slots=4  \n")
    assert hosts == [Host("10.0.0.11", 1), Host("worker-2.example", 4)]
    path = write_hostfile(tmp_path / "hostfile", hosts)
    assert path.read_text() == "10.0.0.11 slots=1\nworker-2.example slots=4\n" and read_hostfile(path) == hosts
    assert rank_layout(hosts) == {
        0: ("10.0.0.11", 0),
        1: ("worker-2.example", 0),
        2: ("worker-2.example", 1),
        3: ("worker-2.example", 2),
        4: ("worker-2.example", 3),
    }
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
    with pytest.raises(HostfileError):
        format_hostfile([Host("a", 1), Host("a", 1)])


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
    from textsql.cluster.environment import forwarded, system

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
    }
    env = forwarded(environ)
    assert sorted(env) == [
        "CUDA_LAUNCH_BLOCKING",
        "DS_ACCELERATOR",
        "GLOO_SOCKET_IFNAME",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "NCCL_DEBUG",
        "OMP_NUM_THREADS",
        "PYTHONPATH",
        "PYTORCH_CUDA_ALLOC_CONF",
        "TEXTSQL_PATH_HINT",
        "TEXTSQL_TEST_FAULT",
        "TOKENIZERS_PARALLELISM",
        "TORCH_DISTRIBUTED_DEBUG",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    ]
    basics = system(dict(environ, LANG=f"ftp://anonymous:{CANARY}@x"))
    assert basics["PATH"].split(os.pathsep)[:2] == [str(Path(sys.executable).parent), "/usr/bin"]
    assert basics["HOME"] == "/home/cdsw" and basics["LC_ALL"] == "C.UTF-8" and CANARY not in json.dumps(basics)


def test_the_node_local_build_folder_is_private_or_refused(tmp_path, monkeypatch):
    import stat
    import tempfile

    from textsql.cluster.environment import node_local_extensions_dir
    from textsql.cluster.launch import PreflightError, rank_environments
    from textsql.cluster.node import describe_node

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
    # The node says so in its facts, and the launch is refused naming the node, unless the user chose a folder.
    node = describe_node("127.0.0.1")
    assert "local_extensions_dir" not in node and "is not your private folder" in node["local_extensions_error"]
    from textsql.cluster.launch import Decision, NodeFacts
    from textsql.strategy.devices import PrecisionChoice

    decision = Decision(
        [Host("127.0.0.1", 1)], "cpu", PrecisionChoice("fp32", False), {"127.0.0.1": 1}, {"127.0.0.1": None}
    )
    with pytest.raises(PreflightError, match=r"^127.0.0.1: .* is not your private folder"):
        rank_environments(decision, [NodeFacts("127.0.0.1", node)], {}, tmp_path)
    common, per_node = rank_environments(
        decision, [NodeFacts("127.0.0.1", node)], {"TORCH_EXTENSIONS_DIR": "/mine"}, tmp_path
    )
    assert common["TORCH_EXTENSIONS_DIR"] == "/mine" and "TORCH_EXTENSIONS_DIR" not in per_node["0"]


def facts(address, gpus=(), cores=16, visible=None):
    from textsql.strategy.devices import NodeDevices

    return {
        "address": address,
        "devices": NodeDevices(tuple(gpus), cores).as_dict(),
        "visible_devices": visible,
        "interface": "eth0",
        "local_extensions_dir": "/tmp/ext",
        "python": "3.11.7",
        "executable": "/venv/bin/python",
        "versions": {"textsql": "0.1.0", "deepspeed": "0.19.8", "torch": "2.13.0", "transformers": "5.23.0"},
    }


def decide_for(nodes, argv: list[str]):
    """The launch's decision for a `textsql train` command line (parsed once, as the launch does)."""
    from textsql.cluster.launch import decide
    from textsql.train.arguments import parse_arguments

    model, _, training = parse_arguments(argv)
    return decide(nodes, model, training)


def test_device_precision_ranks_and_threads_are_decided_from_every_node():
    from textsql.cluster.launch import NodeFacts, PreflightError, rank_environments
    from textsql.strategy.devices import A100_40GB, H100_SXM, V100

    a100s = [
        NodeFacts("10.0.0.1", facts("10.0.0.1", [A100_40GB] * 2, cores=16)),
        NodeFacts("10.0.0.2", facts("10.0.0.2", [A100_40GB] * 2, cores=16), 2),
    ]
    d = decide_for(a100s, ["--model_id", "t5-small"])
    assert d.accelerator == "cuda" and d.precision.name == "bf16" and d.precision.tf32
    assert [h.line() for h in d.hosts] == ["10.0.0.1 slots=2", "10.0.0.2 slots=2"] and d.world_size == 4
    assert d.threads == {"10.0.0.1": 8, "10.0.0.2": 8}  # each rank its share of the pod's cores, not OMP_NUM_THREADS=1
    common, per_node = rank_environments(d, a100s, {"NCCL_DEBUG": "WARN", "HF_TOKEN": CANARY}, Path("/logs"))
    assert common == {"NCCL_DEBUG": "WARN", "PYTHONUNBUFFERED": "1"} and "DS_ACCELERATOR" not in common
    assert per_node["1"] == {
        "OMP_NUM_THREADS": "8",
        "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_SOCKET_IFNAME": "eth0",
        "TORCH_EXTENSIONS_DIR": "/tmp/ext",
    }
    mine = rank_environments(
        d, a100s, {"OMP_NUM_THREADS": "3", "NCCL_SOCKET_IFNAME": "ib0", "TORCH_EXTENSIONS_DIR": "/x"}, Path("/l")
    )
    assert (
        mine[1]["0"] == {"GLOO_SOCKET_IFNAME": "eth0"} and mine[0]["OMP_NUM_THREADS"] == "3"
    )  # what the user set wins
    with pytest.raises(TextsqlError, match="DS_ACCELERATOR=cpu is set, but this process trains on the GPU"):
        rank_environments(d, a100s, {"DS_ACCELERATOR": "cpu"}, Path("/l"))
    assert decide_for(a100s, ["--model_id", "t5-small", "--precision", "fp32"]).precision.tf32 is False

    # A CPU-only session launching GPU workers must not put every rank on the CPU: it is refused, naming the node.
    mixed = [
        NodeFacts("10.0.0.1", facts("10.0.0.1", [], cores=8), 1),
        NodeFacts("10.0.0.2", facts("10.0.0.2", [A100_40GB])),
    ]
    with pytest.raises(
        TextsqlError, match=r"10.0.0.2 has 1 x NVIDIA A100-PCIE-40GB, 16 CPU cores, but node 0 \(10.0.0.1\) has no GPU"
    ):
        decide_for(mixed, [])
    cpu = decide_for(mixed, ["--accelerator", "cpu"])  # unless the user asks for the CPU everywhere
    assert (
        cpu.accelerator == "cpu"
        and cpu.precision.name == "fp32"
        and [h.slots for h in cpu.hosts] == [1, 1]
        and cpu.threads["10.0.0.1"] == 8
    )
    assert rank_environments(cpu, mixed, {}, Path("/l"))[0]["DS_ACCELERATOR"] == "cpu"
    with pytest.raises(
        PreflightError, match=r"10.0.0.1: GPUs were asked for \(--accelerator cuda\), but this process sees none"
    ):
        decide_for(mixed, ["--accelerator", "cuda"])
    with pytest.raises(TextsqlError, match="native bf16 on some GPUs and not on others"):
        decide_for([NodeFacts("a", facts("a", [V100])), NodeFacts("b", facts("b", [H100_SXM]))], [])


def test_nodes_whose_addresses_the_launch_cannot_use_are_refused_before_anything_is_asked(tmp_path):
    from textsql.cluster.launch import NodeFacts, PreflightError, plan_launch

    def never(op, payloads):
        raise AssertionError("no node may be asked anything")

    for addresses, expected in (
        (("10.0.0.1", "fe80::2"), "fe80::2: 'fe80::2' is an IPv6 address"),
        (("127.0.0.1", "localhost"), "127.0.0.1 and localhost are the same machine"),
        (("127.0.0.1", "no-such-node.invalid"), "no-such-node.invalid does not resolve"),
    ):
        with pytest.raises(TextsqlError, match=re.escape(expected)):
            plan_launch([NodeFacts(a, facts(a)) for a in addresses], [], never, workdir=tmp_path, log_root=tmp_path)
    assert issubclass(PreflightError, TextsqlError)


def test_bf16_on_pre_ampere_gpus_and_fp16_on_t5_are_refused_and_auto_is_fp32_there():
    from textsql.cluster.launch import NodeFacts
    from textsql.strategy.devices import T4

    t4s = [NodeFacts("a", facts("a", [T4])), NodeFacts("b", facts("b", [T4]))]
    assert decide_for(t4s, []).precision.name == "fp32"
    with pytest.raises(TextsqlError, match="--precision bf16 needs native bf16, and Tesla T4 has none"):
        decide_for(t4s, ["--bf16", "True"])
    with pytest.raises(TextsqlError, match="fp16 is refused for T5"):
        decide_for(t4s, ["--model_id", "t5-large", "--fp16"])
    with pytest.raises(TextsqlError, match="2 processes per node were asked for, but this node has 1 GPU"):
        decide_for([NodeFacts("a", facts("a", [T4]), 2)], [])


def test_each_local_node_gets_its_own_gpus_and_cores():
    from textsql.strategy.devices import (
        A100_40GB,
        NodeDevices,
        multi_node_launcher_args,
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
    # Node 1 of a box split in two sees GPUs 2,3: DeepSpeed must be told their ids, or it would use 0,1 again.
    node1 = NodeDevices((A100_40GB,) * 2, 8)
    assert (
        node_gpu_ids(2, node1, "2,3") == [2, 3]
        and node_gpu_ids(1, node1, None) == [0]
        and node_gpu_ids(1, NodeDevices(), None) is None
    )
    entries, args = multi_node_launcher_args([("127.0.0.1", 2, [0, 1]), ("127.0.0.2", 2, [2, 3])])
    assert entries == [("127.0.0.1", 2), ("127.0.0.2", 4)] and args == ["--include", "127.0.0.1:0,1@127.0.0.2:2,3"]
    assert multi_node_launcher_args([("10.0.0.1", 1, [0]), ("10.0.0.2", 1, None)]) == (
        [("10.0.0.1", 1), ("10.0.0.2", 1)],
        [],
    )


def test_a_nodes_devices_asked_in_a_child_process_are_the_same():
    from textsql.strategy.devices import NodeDevices, local_devices

    assert local_devices(isolated=True) == local_devices(isolated=False) == NodeDevices.local()


def test_deepspeed_runner_parses_our_hostfile_and_include_into_the_gpus_each_node_gets(tmp_path):
    """What DeepSpeed's own runner makes of the hostfile and --include: node 1 of a split box gets GPUs 2 and 3."""
    from deepspeed.launcher.runner import fetch_hostfile, parse_inclusion_exclusion

    from textsql.strategy.devices import multi_node_launcher_args

    entries, args = multi_node_launcher_args([("127.0.0.1", 2, [0, 1]), ("127.0.0.2", 2, [2, 3])])
    (tmp_path / "hostfile").write_text("".join(f"{a} slots={s}\n" for a, s in entries))
    resources = parse_inclusion_exclusion(fetch_hostfile(str(tmp_path / "hostfile")), args[1], "")
    assert dict(resources) == {"127.0.0.1": [0, 1], "127.0.0.2": [2, 3]}


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

    hosts = parse_hostfile("a slots=2\nb slots=4\nc slots=1\n")
    (tmp_path / "hostfile").write_text(format_hostfile(hosts))
    theirs = parse_inclusion_exclusion(
        fetch_hostfile(str(tmp_path / "hostfile")), flags.get("include", ""), flags.get("exclude", "")
    )
    theirs = apply_num_nodes_and_gpus(theirs, flags.get("num_nodes", -1), -1)
    ours = select_hosts(hosts, HostSelection(**flags))
    assert {h.address: slots or list(range(h.slots)) for h, slots in ours} == dict(theirs)
    assert [h.address for h, _ in ours] == list(theirs)  # rank 0 on the first host of the hostfile still chosen


def test_host_selection_is_checked_against_the_hostfile_with_the_fix(tmp_path):
    from textsql.cluster.hostfile import HostfileError, HostSelection, select_hosts

    hosts = parse_hostfile("a slots=2\nb slots=1\n")
    cases = {
        "which is not in the hostfile \\(its hosts: a, b\\)": HostSelection(include="a@nowhere"),
        "names slot\\(s\\) \\[2\\] of a, which has slots=2": HostSelection(exclude="a:2"),
        "leaves no host of the hostfile \\(a, b\\) to train on": HostSelection(exclude="a@b"),
        "--num_nodes 3 asks for more hosts than the hostfile has \\(2: a, b\\)": HostSelection(num_nodes=3),
    }
    for message, selection in cases.items():
        with pytest.raises(HostfileError, match=message):
            select_hosts(hosts, selection)
    refused = {
        "cannot both be given": dict(include="a", exclude="b"),
        "cannot be combined with --include or --exclude": dict(include="a", num_nodes=1),
        "--num_nodes must be at least 1": dict(num_nodes=0),
        "--master_port must be a port from 1024 to 65535": dict(master_port=80),
        "is not HOST or HOST:SLOT": dict(include="a:x"),
        "names a twice": dict(exclude="a:0@a:1"),
    }
    for message, flags in refused.items():
        with pytest.raises(HostfileError, match=message):
            HostSelection(**flags)
    assert select_hosts(hosts, HostSelection(exclude="a:0")) == [(Host("a", 1), [1]), (Host("b", 1), None)]


def test_chosen_slots_are_the_gpus_a_node_runs_on():
    from textsql.cluster.launch import NodeFacts, PreflightError
    from textsql.strategy.devices import A100_40GB

    nodes = [
        NodeFacts("10.0.0.1", facts("10.0.0.1", [A100_40GB] * 4), 2, [1, 3]),
        NodeFacts("10.0.0.2", facts("10.0.0.2", [A100_40GB] * 4), 4),
    ]
    d = decide_for(nodes, ["--model_id", "t5-small"])
    assert d.gpu_ids == {"10.0.0.1": [1, 3], "10.0.0.2": [0, 1, 2, 3]} and d.world_size == 6
    with pytest.raises(PreflightError, match="slot\\(s\\) \\[5\\] were chosen, but it has 4 GPU\\(s\\) visible"):
        decide_for([NodeFacts("10.0.0.1", facts("10.0.0.1", [A100_40GB] * 4), 1, [5])], [])


# ---------------------------------------------------------------------------------------------------------------------
# The control channel
# ---------------------------------------------------------------------------------------------------------------------


def _handshake(server_token, client_token):
    from textsql.cluster.channel import HandshakeFailed, client_handshake, server_handshake

    a, b = socket.socketpair()
    outcome = {}

    def serve():
        try:
            outcome["server"] = server_handshake(a, server_token, timeout=5)[1]
        except HandshakeFailed as error:
            outcome["server"] = error

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        channel = client_handshake(b, client_token, {"address": "10.0.0.2"}, timeout=5)
        channel.send(op="hello")
        outcome["client"] = "ok"
    except HandshakeFailed as error:
        outcome["client"] = error
    thread.join()
    a.close()
    b.close()
    return outcome


def test_only_an_agent_with_the_clusters_token_is_admitted():
    assert _handshake("t" * 64, "t" * 64) == {"server": {"address": "10.0.0.2"}, "client": "ok"}
    refused = _handshake("t" * 64, "u" * 64)
    assert "wrong token" in str(refused["server"]) and "not a node of this cluster" in str(refused["client"])


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


def test_locks_state_records_and_logs_in_the_shared_folder_are_never_opened_through_a_link(tmp_path):
    """A collaborator's symbolic link where textsql writes (issue 23): refused or replaced, its target untouched."""
    from textsql.cluster.node import prepare
    from textsql.cluster.runs import RECORD, FileLock, run_lock
    from textsql.cluster.workers import Cluster

    victim = tmp_path / "victim.txt"  # a file of the owner's that the collaborator wants overwritten
    victim.write_text("precious\n")
    run = tmp_path / "runs" / "r"
    run.parent.mkdir(parents=True)
    (run.parent / ".r.textsql-lock").symlink_to(victim)
    with pytest.raises(TextsqlError, match=r"\.r\.textsql-lock is refused: it is a symbolic link"):
        run_lock(run, "L1")
    cluster = Cluster("local", project_dir=tmp_path / "project")
    cluster.dir.mkdir(parents=True)
    (cluster.dir / "cluster.lock").symlink_to(victim)
    with pytest.raises(TextsqlError, match=r"cluster.lock is refused: it is a symbolic link"):
        FileLock(cluster.dir / "cluster.lock", "Cluster 'default'", "", {})
    cluster.state_file.symlink_to(victim)
    cluster.node0 = None
    cluster._save_state()  # replaces the link with its own file
    assert not cluster.state_file.is_symlink() and json.loads(cluster.state_file.read_text())["workers"] == []
    # The launch record and DeepSpeed's tag in the run folder, a node-local file, a rank's log: likewise.
    (run / "checkpoint-4" / "global_step4").mkdir(parents=True)
    (run / RECORD).symlink_to(victim)
    (run / "checkpoint-4" / "latest").symlink_to(tmp_path / "created-through-the-link")  # dangling: exists() is False
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "hostfile").symlink_to(victim)
    request = {
        "launch_id": "L1",
        "run_dir": str(run),
        "resume": "checkpoint-4",
        "record": {"world_size": 2},
        "mkdirs": [],
        "files": {str(tmp_path / "logs" / "hostfile"): "a slots=1\n"},
    }
    with pytest.raises(TextsqlError, match=r"latest is refused: it is a symbolic link"):
        prepare(request)
    (run / "checkpoint-4" / "latest").unlink()
    prepare(request)
    assert json.loads((run / RECORD).read_text()) == {"world_size": 2} and not (run / RECORD).is_symlink()
    assert (run / "checkpoint-4" / "latest").read_text() == "global_step4" and not (
        tmp_path / "created-through-the-link"
    ).exists()
    assert (tmp_path / "logs" / "hostfile").read_text() == "a slots=1\n"
    from textsql.sharedfiles import (  # what rank.py, launch.py and pdsh.py open their logs with
        open_unlinked,
        replace_file,
    )

    (tmp_path / "logs" / "rank-0.log").symlink_to(victim)
    with pytest.raises(TextsqlError, match=r"rank-0.log is refused: it is a symbolic link"):
        open_unlinked(tmp_path / "logs" / "rank-0.log", "a")
    os.link(victim, tmp_path / "logs" / "launch.log")  # a hard link to the owner's file
    with pytest.raises(TextsqlError, match=r"launch.log is refused: it has 2 names \(a hard link\)"):
        open_unlinked(tmp_path / "logs" / "launch.log", "w")
    os.mkfifo(tmp_path / "logs" / "fifo")  # would block an open for writing forever
    with pytest.raises(TextsqlError, match=r"fifo is refused: it is not a plain file"):
        open_unlinked(tmp_path / "logs" / "fifo", "w")
    replace_file(tmp_path / "logs" / "rank-0.log", "mine\n")
    assert victim.read_text() == "precious\n"


def test_crafted_state_and_launch_records_are_refused_naming_the_file_and_no_foreign_process_is_signalled(
    assets, tmp_path, monkeypatch
):
    from textsql.cluster.launch import NodeFacts, PreflightError, plan_launch
    from textsql.cluster.node import probe
    from textsql.cluster.runs import RECORD, planned_run_dir
    from textsql.cluster.workers import AGENT_MODULE, Cluster, stop_stale_processes
    from textsql.train.arguments import parse_arguments

    cluster = Cluster("local", project_dir=tmp_path / "project")
    cluster.dir.mkdir(parents=True)
    for crafted, problem in (
        ("[]", "not an object with a list of workers"),
        ('{"workers": {"id": 1}}', "not an object with a list of workers"),
        ('{"workers": [7]}', "a worker without an id"),
        ('{"workers": [{"id": "w", "pid": "12"}]}', 'worker w: pid "12" is not a process id'),
        ('{"workers": [{"id": "w", "pid": 12, "created": [1]}]}', "worker w: created [1] is not a time"),
        ("{not json", "Expecting"),
    ):
        cluster.state_file.write_text(crafted)
        with pytest.raises(
            TextsqlError, match=re.escape(f"{cluster.state_file} is not a cluster state textsql wrote: {problem}")
        ):
            cluster._stop_stale()

    # A record naming a process that is not that agent (no worker id of it in its environment; another user's) is never signalled.
    import psutil

    like_an_agent = [
        "/bin/sh",
        "-c",
        "sleep 120; true",
        AGENT_MODULE,
        "agent",
    ]  # its command line names the agent's module
    others = [subprocess.Popen(like_an_agent, start_new_session=True, env=dict(os.environ, TEXTSQL_WORKER_ID="else"))]
    if os.geteuid() == 0:  # only root can start another user's process here
        others.append(
            subprocess.Popen(
                like_an_agent, start_new_session=True, user=65534, cwd="/", env={"TEXTSQL_WORKER_ID": "w-foreign"}
            )
        )
    try:
        records = [
            {"id": "w-" + str(i), "pid": p.pid, "created": psutil.Process(p.pid).create_time()}
            for i, p in enumerate(others)
        ]
        if len(records) > 1:
            records[1]["id"] = "w-foreign"
        assert stop_stale_processes(records) == [] and all(p.poll() is None for p in others)
    finally:
        for p in others:
            p.kill()
            p.wait()

    # A launch record in the run folder that textsql did not write: the plan refuses it, naming the file.
    argv = tiny_train_argv(assets, tmp_path / "runs", report_to="none")
    model, _, training = parse_arguments(argv)
    run = planned_run_dir(model, training, 2, tmp_path, "none")
    run.mkdir(parents=True)
    nodes = [NodeFacts(a, facts(a)) for a in ("127.0.0.1", "127.0.0.2")]
    ask = lambda op, payloads: {address: probe(request) for address, request in payloads.items()}  # noqa: E731 (each node's own probe)
    for crafted, problem in (
        ("[1, 2]", "no world size in it ([1, 2])"),
        ('{"world_size": "2"}', 'no world size in it ({"world_size": "2"})'),
        ('{"world_size": true}', "no world size in it"),
        ("{", "unreadable (Expecting"),
    ):
        (run / RECORD).write_text(crafted)
        with pytest.raises(
            PreflightError, match=re.escape(f"{run / RECORD} is not a launch record textsql wrote: {problem}")
        ):
            plan_launch(nodes, argv, ask, workdir=tmp_path, log_root=tmp_path / "launches")


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
    from textsql.cluster.runs import missing_parts

    assert missing_parts(ddp(10), 10, [0, 1], 2, None, True) == []
    assert missing_parts(ddp(10, ranks=(0,)), 10, [0, 1], 2, None, True) == [
        "rank 1's RNG state (rng_state_1.pth) is missing"
    ]
    assert missing_parts(ddp(10, cut=("optimizer.pt",)), 10, [0, 1], 2, None, True) == [
        "the optimizer state (optimizer.pt) is cut short"
    ]
    assert (
        missing_parts(zero(10, 2), 10, [0, 1], 2, 2, True) == []
        and missing_parts(zero(10, 3), 10, [0, 1], 2, 3, True) == []
    )
    assert missing_parts(
        zero(10, 3, cut=("global_step10/zero_pp_rank_1_mp_rank_00_model_states.pt",)), 10, [0, 1], 2, 3, True
    ) == ["rank 1's model states (global_step10/zero_pp_rank_1_mp_rank_00_model_states.pt) is cut short"]
    assert missing_parts(zero(10, 2, trainer_state=False), 10, [0, 1], 2, 2, True) == [
        "the trainer state (trainer_state.json) is missing"
    ]
    bf16 = {k.replace("zero_pp", "bf16_zero_pp"): v for k, v in zero(10, 2).items()}
    assert missing_parts(bf16, 10, [0, 1], 2, 2, True) == []  # the bf16 optimizer's shard names


def test_resume_picks_the_newest_checkpoint_complete_everywhere_and_says_so():
    from textsql.cluster.runs import choose_checkpoint

    shared = {
        "n0": {"checkpoint-5": zero(5, 2), "checkpoint-10": zero(10, 2), "checkpoint-15": zero(15, 2, ranks=(0,))}
    }
    plan = choose_checkpoint(shared, {"n0": [0, 1]}, 2, 2)
    assert plan.checkpoint == "checkpoint-10" and list(plan.set_aside) == ["checkpoint-15"]
    assert plan.sentence() == (
        "resumes from checkpoint-10 (the newest checkpoint complete on every node; checkpoint-15 is incomplete: rank 1's RNG "
        "state (rng_state_1.pth) is missing, rank 1's optimizer shard (global_step15/zero_pp_rank_1_mp_rank_00_optim_states.pt) is missing)"
    )
    nothing = choose_checkpoint({"n0": {"checkpoint-5": ddp(5, cut=("model.safetensors",))}}, {"n0": [0, 1]}, 2, None)
    assert nothing.checkpoint is None and nothing.sentence().startswith(
        "starts from step 0 (no checkpoint is complete on every node; checkpoint-5 is incomplete"
    )
    assert (
        choose_checkpoint({"n0": {}}, {"n0": [0, 1]}, 2, None).sentence()
        == "starts from step 0 (no checkpoint is complete on every node)"
    )

    # Without a shared folder every node keeps its own ranks' files; node 1 lost its newest shard: both resume from 5.
    node0 = {"checkpoint-5": zero(5, 2, ranks=(0,)), "checkpoint-10": zero(10, 2, ranks=(0,))}
    node1 = {
        "checkpoint-5": zero(5, 2, ranks=(1,)),
        "checkpoint-10": zero(10, 2, ranks=(1,), cut=("global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt",)),
    }
    plan = choose_checkpoint({"n0": node0, "n1": node1}, {"n0": [0], "n1": [1]}, 2, 2)
    assert plan.checkpoint == "checkpoint-5" and "on n1" in plan.sentence()
    with pytest.raises(
        TextsqlError, match=r"no checkpoint is complete on all of them \(n0: checkpoint-10, checkpoint-5; n1: none\)"
    ):
        choose_checkpoint({"n0": node0, "n1": {}}, {"n0": [0], "n1": [1]}, 2, 2)


def test_resume_with_another_world_size_is_refused_naming_both_sizes():
    from textsql.cluster.runs import choose_checkpoint

    two = {"n0": {"checkpoint-5": zero(5, 2)}}
    for world, recorded in ((3, 2), (1, None), (4, 2)):
        with pytest.raises(
            TextsqlError,
            match=rf"checkpoints of a run with world size 2 \(checkpoint-5\), but this launch has world size {world}",
        ):
            choose_checkpoint(two, {"n0": list(range(world))}, world, 2, recorded_world_size=recorded)
    one = {
        "n0": {
            "checkpoint-5": files(
                "trainer_state.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"
            )
        }
    }
    with pytest.raises(TextsqlError, match="world size 1 .* this launch has world size 2"):
        choose_checkpoint(one, {"n0": [0, 1]}, 2, None)
    assert choose_checkpoint(one, {"n0": [0]}, 1, None).checkpoint == "checkpoint-5"


def test_preparing_a_node_sets_partial_checkpoints_aside_tags_latest_and_clears_dead_build_locks(tmp_path):
    from textsql.cluster.node import prepare
    from textsql.cluster.runs import RECORD

    run = tmp_path / "run"
    (run / "checkpoint-4" / "global_step4").mkdir(parents=True)
    (run / "checkpoint-8").mkdir()
    extensions = tmp_path / "ext"
    (extensions / "cpu_adam").mkdir(parents=True)
    (extensions / "cpu_adam" / "lock").write_text(
        ""
    )  # a build killed mid-way: every later rank would wait on it forever
    done = prepare(
        {
            "launch_id": "L7",
            "run_dir": str(run),
            "set_aside": ["checkpoint-8"],
            "resume": "checkpoint-4",
            "record": {"world_size": 2},
            "mkdirs": [str(tmp_path / "logs")],
            "files": {str(tmp_path / "logs" / "hostfile"): "a slots=1\n"},
            "clear_stale_locks_in": str(extensions),
        }
    )
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoint-4",
        "incomplete-checkpoint-8-L7",
        RECORD,
    ]  # renamed, never deleted
    assert (run / "checkpoint-4" / "latest").read_text() == "global_step4" and done["tagged"] == "global_step4"
    assert (
        json.loads((run / RECORD).read_text()) == {"world_size": 2}
        and (tmp_path / "logs" / "hostfile").read_text() == "a slots=1\n"
    )
    assert not (extensions / "cpu_adam" / "lock").exists() and (extensions / "cpu_adam").is_dir()


def test_the_planned_run_folder_is_the_one_train_writes(tmp_path):
    from textsql.cluster.runs import interrupted_siblings, planned_run_dir
    from textsql.train.arguments import parse_arguments

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
# Failures: who failed first, and the report
# ---------------------------------------------------------------------------------------------------------------------


def record(rank, how, tail, ended, told=False, node="10.0.0.2"):
    return {
        "rank": rank,
        "host": f"pod-{rank}",
        "node_address": node,
        "how": how,
        "log": f"/x/rank-{rank}.log",
        "tail": tail,
        "ended_at": ended,
        "told_to_stop": told,
    }


def test_the_rank_that_failed_first_is_named_not_a_peer_that_lost_its_connection():
    from textsql.cluster.launch import first_failure

    killed = record(1, "killed by SIGKILL", ["step 7"], ended=105.0)
    gloo = record(
        0,
        "exited with status 1",
        ["RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:6379: Connection reset by peer"],
        101.0,
        node="10.0.0.1",
    )
    nccl = record(
        2,
        "exited with status 1",
        [
            "torch.distributed.DistBackendError: NCCL error: remote process exited or there was a network error",
            "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
        ],
        100.0,
    )
    stopped = record(3, "killed by SIGTERM", ["step 7"], 99.0, told=True)
    assert first_failure([gloo, nccl, stopped, killed]) is killed  # the peers' reports are older, and still secondary
    oom = record(4, "exited with status 1", ["torch.OutOfMemoryError: CUDA out of memory."], 103.0)
    assert first_failure([killed, oom]) is oom  # two real failures: the earlier one
    assert first_failure([gloo, nccl]) is nccl  # only secondary ones: the earliest


def test_failure_reports():
    from textsql.cluster.launch import LaunchMonitor, failure_message

    hosts = [Host("10.0.0.1", 1), Host("10.0.0.2", 2)]
    monitor = LaunchMonitor()
    monitor.feed("10.0.0.2: [rank 1] step 7")
    monitor.node_ended("10.0.0.2", 1)
    message, _ = failure_message(monitor, hosts, Path("/l"), "resumes from checkpoint-5 (...)")
    assert message.startswith(
        "Node 1 (10.0.0.2, rank(s) 1, 2): its launcher ended with exit status 1 without a rank report."
    )
    assert "rank 1 | step 7" in message and message.endswith(
        "Launch again with the same arguments: the next launch resumes from checkpoint-5 (...)."
    )
    monitor = LaunchMonitor()
    for r in (
        record(0, "exited with status 1", ["Connection closed by peer"], 5.0, node="10.0.0.1"),
        record(1, "killed by SIGKILL", ["last words"], 9.0),
    ):
        monitor.feed(
            f"{r['node_address']}: [rank {r['rank']}] textsql-rank-exit: "
            + json.dumps({k: v for k, v in r.items() if k != "node_address"})
        )
    message, failures = failure_message(monitor, hosts, Path("/l"), None)
    assert (
        message.startswith("Rank 1 on node 1 (10.0.0.2, host pod-1) failed first: killed by SIGKILL.")
        and "  | last words" in message
    )
    assert "Then rank 0 on 10.0.0.1: exited with status 1 (stopped because of it)" in message and [
        f["rank"] for f in failures
    ] == [1, 0]


def test_the_monitor_reads_rank_reports_summaries_and_node_exits():
    from textsql.cluster.launch import LaunchMonitor

    monitor = LaunchMonitor()
    monitor.feed("127.0.0.2: [rank 1] step 3")
    monitor.feed('127.0.0.2: [rank 1] textsql-rank-summary: {"rank": 1, "final_loss": 2.5}')
    monitor.feed("127.0.0.1: [rank 0] textsql-run-summary: /runs/x/run_summary.json")
    monitor.node_ended("127.0.0.1", 0)
    assert monitor.failed_at is None and monitor.summary_path == "/runs/x/run_summary.json"
    assert (
        monitor.ranks == {1: {"rank": 1, "final_loss": 2.5, "node_address": "127.0.0.2"}}
        and monitor.tails[1][0] == "step 3"
    )
    monitor.node_ended("127.0.0.2", 1)
    assert monitor.failed_at is not None


# ---------------------------------------------------------------------------------------------------------------------
# The command every node runs, and what its ranks receive
# ---------------------------------------------------------------------------------------------------------------------

NASTY = {
    "run_name": "a b;$(touch pwned) `id` * ~ $HOME \"q\" 'q' \\ é\nnewline",
    "runs_root": "runs dir/$USER;*",
    "output_dir": "x y&&z",
    "report_to": ["tensorboard"],
    "learning_rate": 0.001,
}


def test_training_arguments_and_environment_reach_the_rank_exactly(tmp_path, monkeypatch):
    import stat
    import tempfile

    from textsql.cluster.launch import Decision, LaunchPlan, NodeFacts
    from textsql.cluster.node import prepare
    from textsql.cluster.rank import SPEC_FLAG, rank_environment, read_spec
    from textsql.cluster.runs import ResumePlan
    from textsql.strategy.devices import PrecisionChoice

    nodes = [NodeFacts("127.0.0.1", facts("127.0.0.1")), NodeFacts("127.0.0.2", facts("127.0.0.2"))]
    decision = Decision(
        [Host("127.0.0.1", 1), Host("127.0.0.2", 1)],
        "cpu",
        PrecisionChoice("fp32", False),
        {"127.0.0.1": 1, "127.0.0.2": 1},
        {"127.0.0.1": None, "127.0.0.2": None},
    )
    plan = LaunchPlan(
        "L1",
        nodes,
        decision,
        tmp_path,
        tmp_path / "logs",
        tmp_path / "runs" / "r",
        True,
        ResumePlan(None),
        2,
        NASTY,
        {"DS_ACCELERATOR": "cpu"},
        {"0": {"OMP_NUM_THREADS": "1"}, "1": {"OMP_NUM_THREADS": "2", "X": "a b;$(y)"}},
        29500,
    )
    command = plan.deepspeed_command("/venv/bin/python", ["--no_ssh", "--node_rank", "1"])
    assert command[:12] == [
        "/venv/bin/python",
        "-u",
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        str(tmp_path / "logs" / "hostfile"),
        "--no_ssh",
        "--node_rank",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
    ]
    assert command[-4:-1] == ["--module", "textsql.cluster.rank", "--textsql_launch=L1"]
    spec_word = command[-1].removeprefix(SPEC_FLAG)
    assert re.fullmatch(r"[A-Za-z0-9_=-]+", spec_word)  # nothing a shell (pdsh's remote one included) could expand
    spec = read_spec(["--local_rank=0", "--textsql_launch=L1", command[-1]])
    assert spec == {"arguments": NASTY, "log_dir": str(tmp_path / "logs")}  # no variable's value in any argv
    assert "a b;$(y)" not in json.dumps(command)
    # Each node's prepare leaves its ranks' environment in the user's private folder there (0600); the rank reads it.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    requests = plan.prepare_requests()
    for request in requests.values():
        prepare(dict(request, files={}, mkdirs=[]))
    env = rank_environment("L1", {"CROSS_RANK": "1", "RANK": "1", "PATH": "/bin"})
    assert (
        env["X"] == "a b;$(y)"
        and env["OMP_NUM_THREADS"] == "2"
        and env["DS_ACCELERATOR"] == "cpu"
        and env["RANK"] == "1"
    )
    assert rank_environment("L1", {"CROSS_RANK": "0"})["OMP_NUM_THREADS"] == "1"
    private = tmp_path / f"textsql-{os.getuid()}" / "launches" / "L1-node1.json"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    with pytest.raises(TextsqlError, match="L2-node0.json is missing"):
        rank_environment("L2", {"CROSS_RANK": "0"})
    assert (
        requests["127.0.0.1"]["files"][str(tmp_path / "logs" / "hostfile")] == "127.0.0.1 slots=1\n127.0.0.2 slots=1\n"
    )
    assert (
        "run_dir" in requests["127.0.0.1"] and "run_dir" not in requests["127.0.0.2"]
    )  # shared: node 0 prepares the run folder


# ---------------------------------------------------------------------------------------------------------------------
# Interrupts, the CLI, and no ssh keys anywhere
# ---------------------------------------------------------------------------------------------------------------------


def test_a_second_ctrl_c_waits_until_clean_up_is_done():
    from textsql.cluster.interrupts import interrupts_deferred

    said, done = [], []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred(said.append):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            done.append("clean-up finished")
    assert done == ["clean-up finished"] and "still stopping the cluster" in said[0]
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
