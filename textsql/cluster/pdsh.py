"""User-managed nodes (bare metal, VMs): the same launch over DeepSpeed's pdsh launcher and the user's own ssh setup.

textsql writes no key, no known_hosts and no ssh config for this path: ssh reads the user's own (~/.ssh/config, or
the file passed as `ssh_config`), and every ssh call — textsql's and pdsh's — gets `BatchMode=yes` and
`StrictHostKeyChecking=yes` on its command line, which win over any config file: an unknown or changed host key is
refused, never accepted. The nodes are asked their facts and prepared over ssh (`python -m textsql.cluster.node`),
then `deepspeed --launcher pdsh` starts the same rank program as the agents do, its spec in one base64 word.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from textsql.cluster.hostfile import Host, HostSelection, read_hostfile, select_hosts
from textsql.cluster.launch import (
    LaunchFailed,
    LaunchMonitor,
    NodeFacts,
    PreflightError,
    failure_message,
    launch_result,
    plan_launch,
    resume_sentence,
)
from textsql.cluster.node import ANSWER, encode
from textsql.cluster.rank import LAUNCH_FLAG
from textsql.errors import TextsqlError
from textsql.sharedfiles import open_unlinked

SSH_OPTIONS = (
    "-o",
    "BatchMode=yes",
    "-o",
    "StrictHostKeyChecking=yes",
    "-o",
    "ConnectTimeout=10",
    "-o",
    "ServerAliveInterval=5",
    "-o",
    "ServerAliveCountMax=3",
)
# What DeepSpeed's pdsh runner leaves unquoted in the remote shell command (it wraps anything else in double quotes,
# inside which a shell still expands $(...) and `...`; the working folder and the interpreter it does not quote at all).
SHELL_SAFE = re.compile(r"[\w@%+=:,./-]+")
PDSH_EXIT = re.compile(r"^pdsh@[^:]*: (?P<host>[^:\s]+): ssh exited with exit code (?P<code>\d+)")


def find_program(name: str, package: str) -> str:
    for candidate in (shutil.which(name), f"/usr/sbin/{name}", f"/usr/bin/{name}"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise TextsqlError(
        f"`{name}` is not installed on this machine. Install the {package} package (Debian/Ubuntu: apt-get install {package})."
    )


def ssh_options(ssh_config: Path | None) -> list[str]:
    return (["-F", str(ssh_config)] if ssh_config else []) + list(SSH_OPTIONS)


def run_ssh(
    host: str, command: str, ssh_config: Path | None, *, timeout: float = 120, stdin: str | None = None
) -> subprocess.CompletedProcess:
    """`command` on `host` over ssh; `stdin`: what the command reads (requests travel there, not in argv)."""
    argv = [find_program("ssh", "openssh-client"), *ssh_options(ssh_config), host, command]
    try:
        if stdin is not None:
            return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=stdin, check=False)
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 255, "", f"ssh timed out after {timeout:.0f} s")


def explain_ssh_failure(host: str, stderr: str) -> str:
    """Turn ssh's stderr into what is wrong and what to do."""
    text = stderr.strip()
    last = text.splitlines()[-1] if text else "no message"
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in text or "Host key verification failed" in text:
        return (
            f"ssh refused {host}: its host key is not the one in your known_hosts (host key verification failed). If the machine "
            "was reinstalled, check its new key out of band and update known_hosts; otherwise another machine answers at that address."
        )
    if "Connection refused" in text:
        return f"nothing accepts ssh on {host} (connection refused): is its sshd running, on the port your ssh config names?"
    if "timed out" in text or "No route to host" in text:
        return f"ssh to {host} timed out: the address is unreachable or a firewall drops the ssh port."
    if "Permission denied" in text:
        return f"{host} refused your key (permission denied): add your public key to the authorized keys of your account there, or name the key in your ssh config."
    return f"ssh to {host} failed: {last}"


def ask_over_ssh(op: str, payloads: dict[str, dict], ssh_config: Path | None, workdir: Path) -> dict[str, dict]:
    """`python -m textsql.cluster.node OP <request>` on every host at once; raises PreflightError naming each failure."""
    env = {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}
    prefix = f"cd {shlex.quote(str(workdir))} && " + (
        f"env PYTHONPATH={shlex.quote(env['PYTHONPATH'])} " if env else ""
    )

    def one(item):
        host, request = item
        # the request on stdin: it holds the ranks' environment, which must not be in any argv on the node
        done = run_ssh(
            host,
            prefix + " ".join(shlex.quote(a) for a in (sys.executable, "-m", "textsql.cluster.node", op, "-")),
            ssh_config,
            stdin=encode(request) + "\n",
        )
        found = [line for line in done.stdout.splitlines() if line.startswith(ANSWER)]
        if found:
            return host, json.loads(found[-1].removeprefix(ANSWER)), None
        if done.returncode == 255:
            return host, None, explain_ssh_failure(host, done.stderr)
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return (
            host,
            None,
            f"{sys.executable} -m textsql.cluster.node does not run there (exit status {done.returncode}): {tail}",
        )

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(payloads)))) as pool:
        results = list(pool.map(one, payloads.items()))
    problems = [f"{host}: {problem}" for host, _, problem in results if problem]
    if problems:
        raise PreflightError(f"{op} failed on {len(problems)} node(s):\n" + "\n".join(f"  {p}" for p in problems))
    return {host: answer for host, answer, _ in results}


def plan_user_managed(
    hosts: list[Host],
    arguments,
    *,
    ssh_config: Path | None = None,
    workdir=None,
    log_root=None,
    selection: HostSelection | None = None,
):
    """Choose the hosts (`selection`: --include/--exclude/--num_nodes, checked against the hostfile before any ssh),
    ask each its facts over ssh and plan the launch (textsql.cluster.launch.plan_launch); returns (plan, ask)."""
    selection = selection or HostSelection()
    chosen = select_hosts(hosts, selection)
    workdir = Path(workdir or os.getcwd()).absolute()
    ask = lambda op, payloads: ask_over_ssh(op, payloads, ssh_config, workdir)  # noqa: E731
    facts = ask("describe", {h.address: {"address": h.address} for h, _ in chosen})
    nodes = [NodeFacts(h.address, facts[h.address], h.slots, slots) for h, slots in chosen]
    plan = plan_launch(
        nodes,
        arguments,
        ask,
        workdir=workdir,
        log_root=Path(log_root or workdir / ".textsql" / "launches"),
        master_port=selection.master_port,
    )
    return plan, ask


def preflight(
    hostfile,
    arguments,
    *,
    ssh_config: Path | None = None,
    workdir=None,
    echo=print,
    selection: HostSelection | None = None,
):
    """`arguments`: textsql.train's three argument dataclasses, or one command line; `selection`: which hosts."""
    plan, _ = plan_user_managed(
        read_hostfile(hostfile), arguments, ssh_config=ssh_config, workdir=workdir, selection=selection
    )
    echo(plan.describe())
    echo(f"preflight OK: {len(plan.hosts)} nodes, world size {plan.decision.world_size}")
    return plan


def check_shell_safe(what: str, value: str) -> None:
    """Refuse what DeepSpeed's pdsh runner would put into the remote shell command unquoted or merely double-quoted."""
    if not SHELL_SAFE.fullmatch(value):
        bad = "".join(sorted({c for c in value if not SHELL_SAFE.fullmatch(c)}))
        raise TextsqlError(
            f"{what} {value!r} holds characters a shell interprets ({bad!r}). DeepSpeed's pdsh launcher runs every node's "
            "launcher through a remote shell with it in the command, unquoted, so it could run commands on every node. "
            "Use a path of letters, digits and @%+=:,./-_ only (rename or move the folder), or launch from another one."
        )


def runner_environment(
    ssh_config: Path | None, rank_env: dict[str, str], echo=print, workdir: Path | None = None
) -> dict[str, str]:
    """The environment of DeepSpeed's runner for a pdsh launch. The runner copies every variable named MLFLOW*,
    PYTHON* or NCCL*, and each line of a .deepspeed_env file, into the remote shell command: into pdsh's argv (readable by
    every user of the machine) and through a shell on every node. So it gets this machine's basics, the ssh options,
    PYTHONPATH (checked) and the accelerator; the ranks read their allowlisted environment from the private file each
    node's prepare wrote (textsql.cluster.environment.save_rank_env), and no .deepspeed_env is read."""
    from textsql.cluster.environment import system

    env = system(os.environ)
    env.update(PDSH_SSH_ARGS_APPEND=" ".join(ssh_options(ssh_config)), PYTHONUNBUFFERED="1", DS_ENV_FILE=os.devnull)
    if os.environ.get("PYTHONPATH"):
        check_shell_safe("PYTHONPATH", os.environ["PYTHONPATH"])
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    if os.environ.get(
        "SSH_AUTH_SOCK"
    ):  # pdsh's ssh reaches the user's ssh agent (a socket path; the runner exports no SSH_*)
        env["SSH_AUTH_SOCK"] = os.environ["SSH_AUTH_SOCK"]
    if "DS_ACCELERATOR" in rank_env:
        env["DS_ACCELERATOR"] = rank_env["DS_ACCELERATOR"]
    for folder in dict.fromkeys(p for p in (Path.home(), workdir) if p):
        if (folder / ".deepspeed_env").exists():
            echo(
                f"textsql: ignoring {folder / '.deepspeed_env'}: the ranks get the allowlisted variables of this session "
                "(docs/multi-pod.md), never a file's lines through a remote shell"
            )
    return env


def launch_training(
    hostfile,
    arguments,
    *,
    ssh_config: Path | None = None,
    workdir=None,
    log_root=None,
    echo=print,
    grace_seconds: float = 5,
    selection: HostSelection | None = None,
) -> dict:
    """Preflight over ssh, then `deepspeed --launcher pdsh ...`, streaming every rank's output through `echo`.
    `selection`: which hosts of the hostfile, and rank 0's port (textsql.cluster.hostfile.HostSelection).

    Returns {"summary", "ranks", "launch_dir", "command", "shared_output", "plan"}. Raises LaunchFailed naming the rank
    that failed first, with its log tail and what the next launch resumes from; by then every process of the launch
    has been stopped on every node."""
    from textsql.cluster.interrupts import interrupts_deferred
    from textsql.cluster.runs import run_lock

    find_program("pdsh", "pdsh")
    check_shell_safe("The working folder", str(Path(workdir or os.getcwd()).absolute()))
    check_shell_safe("The Python interpreter", sys.executable)
    ssh_config = Path(ssh_config).absolute() if ssh_config else None
    plan, ask = plan_user_managed(
        read_hostfile(hostfile),
        arguments,
        ssh_config=ssh_config,
        workdir=workdir,
        log_root=log_root,
        selection=selection,
    )
    echo(plan.describe())
    with run_lock(plan.run_dir, plan.launch_id):
        plan.log_dir.mkdir(parents=True, exist_ok=True)
        ask("prepare", plan.prepare_requests())
        # --force_multi: with one host (a one-line hostfile, or what --include/--exclude left) DeepSpeed's runner would
        # otherwise start the ranks on this machine, not over pdsh on that host.
        command = plan.deepspeed_command(sys.executable, ["--launcher", "pdsh", "--no_ssh_check", "--force_multi"])
        env = runner_environment(ssh_config, plan.env, echo, plan.workdir)
        echo("training arguments (the same on every rank): " + json.dumps(plan.arguments))
        echo(f"launch folder {plan.log_dir} (launch.log here; rank-N.log on each rank's node)")
        monitor = LaunchMonitor()
        lines: queue.Queue = queue.Queue()
        process = subprocess.Popen(
            command,
            cwd=plan.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True).start()
        stopped = False
        try:
            with open_unlinked(plan.log_dir / "launch.log", "w", buffering=1) as log:
                while (line := _next_line(lines)) is not None:
                    if line:
                        log.write(line + "\n")
                        echo(line)
                        if lost := PDSH_EXIT.match(line):
                            monitor.node_ended(lost["host"], int(lost["code"]))
                        else:
                            monitor.feed(line)
                    if (
                        not stopped
                        and monitor.failed_at is not None
                        and time.monotonic() - monitor.failed_at >= grace_seconds
                    ):
                        echo(f"textsql: a rank failed; stopping launch {plan.launch_id} on every node")
                        _stop(process, plan.hosts, ssh_config, plan.launch_id)
                        stopped = True
                process.wait()
        except BaseException:
            with interrupts_deferred(echo):
                echo(f"textsql: interrupted; stopping launch {plan.launch_id} on every node")
                _stop(process, plan.hosts, ssh_config, plan.launch_id)
            raise
        if monitor.failed_at is not None or process.returncode != 0 or monitor.summary_path is None:
            if not stopped:
                _stop(process, plan.hosts, ssh_config, plan.launch_id)
            if not monitor.failures and not monitor.node_exits:
                monitor.node_ended(plan.hosts[0].address, process.returncode)
            resume = resume_sentence(plan, ask)
            message, failures = failure_message(monitor, plan.hosts, plan.log_dir, resume)
            raise LaunchFailed(message, failures, plan.log_dir, resume)
    return launch_result(plan, monitor, command)


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _next_line(lines: queue.Queue) -> str | None:
    """The next output line, "" when none came for half a second (to check the clock), None at the end."""
    try:
        return lines.get(timeout=0.5)
    except queue.Empty:
        return ""


def _signal_launch(hosts: list[Host], ssh_config: Path | None, launch_id: str, command: str) -> list[int]:
    pattern = shlex.quote("[-]" + LAUNCH_FLAG[1:] + launch_id)  # [-] keeps the pattern from matching this very command
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as pool:
        return list(
            pool.map(
                lambda h: run_ssh(h.address, f"{command} -f -- {pattern}", ssh_config, timeout=20).returncode, hosts
            )
        )


def _stop(process: subprocess.Popen, hosts: list[Host], ssh_config: Path | None, launch_id: str) -> None:
    """TERM this launch's processes on every node (they carry the launch id), KILL what is left, then end the local
    runner, pdsh and ssh clients — with SIGKILL: the runner's SIGTERM handler would `pkill -f deepspeed.launcher.launch`
    on every node, other launches included."""
    _signal_launch(hosts, ssh_config, launch_id, "pkill -TERM")
    deadline = time.monotonic() + 15
    while 0 in _signal_launch(hosts, ssh_config, launch_id, "pgrep") and time.monotonic() < deadline:
        time.sleep(1)
    _signal_launch(hosts, ssh_config, launch_id, "pkill -KILL")
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
