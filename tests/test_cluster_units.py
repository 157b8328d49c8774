"""The parts of textsql.cluster that need no running node: hostfiles, the ranks' environment, the deepspeed command,
the preflight's verdicts and the failure report, and the ssh config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from textsql.cluster.hostfile import Host, HostfileError, format_hostfile, parse_hostfile, rank_layout, read_hostfile, write_hostfile
from textsql.cluster.launch import (
    _failure_message,
    deepspeed_command,
    interface_of,
    probe_problems,
    rank_environment,
    write_deepspeed_env,
)
from textsql.cluster.ssh import explain_ssh_failure, host_key_line, write_ssh_config
from textsql.errors import TextsqlError

REPO = Path(__file__).resolve().parent.parent


def test_hostfile_round_trip_and_the_shipped_example(tmp_path):
    hosts = parse_hostfile("# comment\n\n10.0.0.11 slots=1\n  worker-2.example slots=4  \n")
    assert hosts == [Host("10.0.0.11", 1), Host("worker-2.example", 4)]
    path = write_hostfile(tmp_path / "hostfile", hosts)
    assert path.read_text() == "10.0.0.11 slots=1\nworker-2.example slots=4\n" and read_hostfile(path) == hosts
    assert rank_layout(hosts) == {0: ("10.0.0.11", 0), 1: ("worker-2.example", 0), 2: ("worker-2.example", 1),
                                  3: ("worker-2.example", 2), 4: ("worker-2.example", 3)}
    assert len(read_hostfile(REPO / "hostfile.example")) >= 2


def test_hostfile_errors_name_every_bad_line(tmp_path):
    text = "10.0.0.1 slots=1\n10.0.0.2\n10.0.0.3 slots=0\n10.0.0.1 slots=2\n10.0.0.4 slots=two\n10.0.0.5 slots=1 # gpu box\nbad/host slots=1\n"
    with pytest.raises(HostfileError) as error:
        parse_hostfile(text, "my-hostfile")
    message = str(error.value)
    assert message.startswith("Hostfile my-hostfile has 6 problems:")
    for expected in ("line 2 ('10.0.0.2'): expected '<address> slots=<N>'", "line 3 ('10.0.0.3 slots=0'): slots must be at least 1",
                     "line 4 ('10.0.0.1 slots=2'): duplicate host 10.0.0.1, already on line 1", "line 5 ('10.0.0.4 slots=two'): slots must be a whole number",
                     "line 6 ('10.0.0.5 slots=1 # gpu box'): a comment after an entry", "line 7 ('bad/host slots=1'): 'bad/host' is not a host name"):
        assert expected in message, expected
    with pytest.raises(HostfileError, match="no hosts"):
        parse_hostfile("# nothing\n")
    with pytest.raises(HostfileError, match="does not exist"):
        read_hostfile(tmp_path / "missing")
    with pytest.raises(HostfileError):
        format_hostfile([Host("a", 1), Host("a", 1)])


def test_rank_environment_and_deepspeed_env_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/cache/ext")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    env = rank_environment("127.0.0.1", tmp_path / "launch", {"EXTRA": "yes"})
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert env["DS_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo" == interface_of("127.0.0.2")
    assert env["TORCH_EXTENSIONS_DIR"] == "/cache/ext" and env["NCCL_DEBUG"] == "INFO" and env["EXTRA"] == "yes"
    assert env["TEXTSQL_RANK_LOG_DIR"] == str(tmp_path / "launch")
    path = write_deepspeed_env(tmp_path / ".deepspeed_env", env)
    # The way DeepSpeed's runner reads it: every line KEY=VALUE, no blank or comment lines.
    assert dict(line.split("=", 1) for line in path.read_text().splitlines()) == env
    with pytest.raises(TextsqlError, match=r"HOME_OF=.*no quotes, \$"):
        write_deepspeed_env(tmp_path / "bad", {"HOME_OF": "$HOME"})


def test_deepspeed_command(tmp_path):
    hosts = [Host("10.0.0.1", 2), Host("10.0.0.2", 2)]
    command = deepspeed_command(tmp_path / "hostfile", hosts, master_addr="10.0.0.1", master_port=29600, ssh_port=2222, launch_id="L1",
                                train_argv=["--model_id", "t5-small", "--deepspeed", "zero2"])
    assert Path(command[0]).name == "deepspeed"
    assert command[1:] == ["--hostfile", str(tmp_path / "hostfile"), "--launcher", "pdsh", "--ssh_port", "2222", "--no_ssh_check",
                           "--num_nodes", "2", "--num_gpus", "2", "--master_addr", "10.0.0.1", "--master_port", "29600",
                           "--module", "textsql.cluster.rank", "--textsql_launch=L1", "--model_id", "t5-small", "--deepspeed", "zero2"]
    uneven = deepspeed_command(tmp_path / "h", [Host("a", 1), Host("b", 2)], master_addr="a", master_port=1, ssh_port=22, launch_id="x", train_argv=[])
    assert "--num_gpus" not in uneven


def probe(**changes):
    result = {"hostname": "h", "python": "3.11.7", "executable": "/venv/bin/python", "gpus": 1,
              "versions": {"textsql": "0.1.0", "deepspeed": "0.19.8", "torch": "2.13.0", "transformers": "5.23.0"},
              "files": {"/p/dsconfig/zero2.json": "abc"}, "dirs": {"/p": True, "/p/data": True}}
    for key, value in changes.items():
        if key in ("versions", "files", "dirs"):
            result[key] = dict(result[key], **value)
        else:
            result[key] = value
    return result


def test_preflight_says_what_is_wrong_where():
    hosts = [Host("10.0.0.1", 1), Host("10.0.0.2", 1), Host("10.0.0.3", 2)]
    probes = {"10.0.0.1": probe(), "10.0.0.2": probe(python="3.10.12", versions={"deepspeed": "0.18.0"}, dirs={"/p/data": False}),
              "10.0.0.3": probe(gpus=1, files={"/p/dsconfig/zero2.json": "def"}, textsql_error="ModuleNotFoundError('textsql')")}
    problems = probe_problems(hosts, probes, cpu=False, workdir=Path("/p"), dataset=Path("/p/data"))
    assert problems == [
        "10.0.0.2: Python 3.10.12, but node 0 (10.0.0.1) has 3.11.7",
        "10.0.0.2: deepspeed 0.18.0, but node 0 (10.0.0.1) has 0.19.8",
        "10.0.0.2: the dataset folder /p/data does not exist there",
        "10.0.0.3: textsql does not import with /venv/bin/python: ModuleNotFoundError('textsql')",
        "10.0.0.3: the hostfile gives it 2 slot(s) but torch sees 1 GPU(s)",
        "10.0.0.3: /p/dsconfig/zero2.json differs from node 0's copy",
    ]
    assert probe_problems(hosts[:2], {"10.0.0.1": probe(gpus=0), "10.0.0.2": probe(gpus=0)}, cpu=True, workdir=Path("/p"), dataset=Path("/p/data")) == []


def test_ssh_failures_are_explained():
    assert "host key is not the one it published" in explain_ssh_failure("h", 2222, "@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\nHost key verification failed.")
    assert "connection refused" in explain_ssh_failure("h", 2222, "ssh: connect to host h port 2222: Connection refused")
    assert "permission denied" in explain_ssh_failure("h", 2222, "root@h: Permission denied (publickey).")
    assert "timed out" in explain_ssh_failure("h", 2222, "ssh: connect to host h port 2222: Connection timed out")


def test_ssh_config_checks_host_keys(tmp_path):
    config = write_ssh_config(tmp_path / "ssh_config", hosts=["127.0.0.1", "127.0.0.2"], port=2222, key=tmp_path / "id_ed25519",
                              known_hosts=tmp_path / "known_hosts", user="cdsw").read_text()
    assert "Host 127.0.0.1 127.0.0.2\n  Port 2222\n  User cdsw\n" in config
    assert "StrictHostKeyChecking yes" in config and "StrictHostKeyChecking no" not in config and "/dev/null\n" in config
    assert f"UserKnownHostsFile {tmp_path / 'known_hosts'}" in config
    assert host_key_line("127.0.0.2", 2222, "ssh-ed25519 AAAAC3Nz textsql-host") == "[127.0.0.2]:2222 ssh-ed25519 AAAAC3Nz\n"
    with pytest.raises(TextsqlError, match="not an OpenSSH public key"):
        host_key_line("127.0.0.2", 2222, "garbage")


def test_failure_report_without_a_rank_report_names_the_ranks_of_the_lost_node(tmp_path):
    hosts = [Host("10.0.0.1", 1), Host("10.0.0.2", 2)]
    message = _failure_message([], {"10.0.0.2": 255}, 255, hosts, {1: ["step 7"], 2: ["step 7"]}, tmp_path)
    assert message.startswith("The launcher on 10.0.0.2 (rank(s) 1, 2) ended with exit code 255")
    assert "rank 2 | step 7" in message and "resume from the last checkpoint" in message
    record = {"rank": 1, "host": "pod-2", "node_address": "10.0.0.2", "how": "killed by SIGKILL", "log": "/x/rank-1.log", "tail": ["last words"]}
    aftermath = {"rank": 0, "host": "pod-1", "node_address": "10.0.0.1", "how": "exited with status 1", "log": "/x/rank-0.log",
                 "tail": ["RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:6379: Connection reset by peer."]}
    message = _failure_message([aftermath, record], {}, 1, hosts, {}, tmp_path)  # rank 0's report came in first
    assert message.startswith("Rank 1 on 10.0.0.2 (host pod-2) failed first: killed by SIGKILL.") and "  | last words" in message
    assert "Then rank 0 on 10.0.0.1: exited with status 1 (log /x/rank-0.log)." in message


def test_the_monitor_reads_rank_reports_and_lost_nodes_from_the_pdsh_stream():
    from textsql.cluster.launch import LaunchMonitor

    monitor = LaunchMonitor()
    monitor.feed("127.0.0.2: [rank 1] step 3")
    monitor.feed('127.0.0.2: [rank 1] textsql-rank-summary: {"rank": 1, "final_loss": 2.5}')
    monitor.feed("127.0.0.1: [rank 0] textsql-run-summary: /runs/x/run_summary.json")
    assert monitor.failed_at is None and monitor.summary_path == "/runs/x/run_summary.json"
    assert monitor.ranks == {1: {"rank": 1, "final_loss": 2.5, "node_address": "127.0.0.2"}} and monitor.tails[1][0] == "step 3"
    monitor.feed("pdsh@session: 127.0.0.1: ssh exited with exit code 0")
    assert monitor.failed_at is None
    monitor.feed("pdsh@session: 127.0.0.2: ssh exited with exit code 255")
    assert monitor.node_exits == {"127.0.0.2": 255} and monitor.failed_at is not None
    monitor.feed('127.0.0.2: [rank 1] textsql-rank-exit: {"rank": 1, "how": "killed by SIGKILL"}')
    assert monitor.failures == [{"rank": 1, "how": "killed by SIGKILL", "node_address": "127.0.0.2"}]


def test_cluster_cli_checks_a_hostfile(tmp_path, capsys):
    from textsql.cluster.cli import cluster_cli

    assert cluster_cli(["check-hostfile", str(REPO / "hostfile.example")]) == 0
    assert "OK, 3 nodes, 3 ranks (rank 0 on 10.0.0.11)" in capsys.readouterr().out
    (tmp_path / "h").write_text("a slots=0\n")
    with pytest.raises(HostfileError, match="slots must be at least 1"):
        cluster_cli(["check-hostfile", str(tmp_path / "h")])
    assert cluster_cli(["--help"]) == 0 and cluster_cli([]) == 2
