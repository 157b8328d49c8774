"""User-managed nodes (bare metal, VMs): the same launch over DeepSpeed's pdsh launcher and the user's own ssh setup.

textsql writes no key, known_hosts or ssh config: every ssh call (textsql's and pdsh's) gets `BatchMode=yes` and
`StrictHostKeyChecking=yes` on its command line, which win over any config file. Each host is reached once before
anything starts, then `deepspeed --launcher pdsh` starts textsql.cluster.rank, its spec (no environment value) in one
base64 word; the first failure stops the launch on every host over ssh (docs/multi-pod.md)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from textsql.cluster.hostfile import Host, HostSelection, check_addresses, read_hostfile, select_hosts
from textsql.cluster.launch import PreflightError, encode, finish, new_lines, plan_launch, prepare, read_records
from textsql.errors import TextsqlError
from textsql.paths import PDSH_LAUNCHES_DIR

LAUNCH_FLAG = "--textsql_launch="  # in every rank's argv: how a stop finds this launch's processes on a host

# fmt: off
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=10",
               "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3")
# fmt: on
# What DeepSpeed's pdsh runner leaves unquoted in the remote shell command (it wraps anything else in double quotes,
# inside which a shell still expands $(...) and `...`; the working folder and the interpreter it does not quote at all).
SHELL_SAFE = re.compile(r"[\w@%+=:,./-]+")
PDSH_EXIT = re.compile(r"^pdsh@[^:]*: (?P<host>[^:\s]+): ssh exited with exit code (?P<code>\d+)")


def find_program(name: str, package: str) -> str:
    if found := shutil.which(name):
        return found
    raise TextsqlError(
        f"`{name}` is not installed on this machine. Install the {package} package (Debian/Ubuntu: apt-get install {package})."
    )


def ssh_options(ssh_config: Path | None) -> list[str]:
    return (["-F", str(ssh_config)] if ssh_config else []) + list(SSH_OPTIONS)


def run_ssh(host: str, command: str, ssh_config: Path | None, *, timeout: float = 120) -> subprocess.CompletedProcess:
    """`command` on `host` over ssh, host keys checked."""
    argv = [find_program("ssh", "openssh-client"), *ssh_options(ssh_config), host, command]
    try:
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


def on_every_host(hosts: list[Host], command: str, ssh_config: Path | None, timeout: float):
    """`command` over ssh on every host at once; each host's CompletedProcess, in order."""
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as pool:
        return list(pool.map(lambda h: run_ssh(h.address, command, ssh_config, timeout=timeout), hosts))


def check_hosts(hosts: list[Host], ssh_config: Path | None, workdir: Path) -> None:
    """Reach every host over ssh (host keys checked) and run this Python in the working folder there; raises
    PreflightError naming each host that fails."""
    command = f"cd {shlex.quote(str(workdir))} && {shlex.quote(sys.executable)} -c pass"
    problems = []
    for host, done in zip(hosts, on_every_host(hosts, command, ssh_config, timeout=60)):
        if done.returncode == 255:
            problems.append(f"{host.address}: {explain_ssh_failure(host.address, done.stderr)}")
        elif done.returncode:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            problems.append(
                f"{host.address}: {sys.executable} does not run in {workdir} there (exit status {done.returncode}): {tail}"
            )
    if problems:
        raise PreflightError(f"ssh failed on {len(problems)} host(s):\n" + "\n".join(f"  {p}" for p in problems))


def plan_user_managed(hostfile, arguments, *, ssh_config=None, workdir=None, log_root=None, selection=None):
    """The chosen hosts (checked against the hostfile, then reached over ssh) and the plan of their launch."""
    from textsql.strategy.devices import local_devices

    chosen = select_hosts(read_hostfile(hostfile), selection or HostSelection())
    check_addresses(chosen)  # unresolvable names, two entries that are one machine
    workdir = Path(workdir or os.getcwd()).absolute()
    check_hosts(chosen, ssh_config, workdir)
    plan = plan_launch(
        arguments,
        ranks=[h.slots for h in chosen],
        devices=local_devices(),
        workdir=workdir,
        log_root=Path(log_root or workdir / PDSH_LAUNCHES_DIR),
        env={},  # nothing of this session's environment travels in a command line
    )
    return chosen, plan


def preflight(hostfile, arguments, *, ssh_config=None, workdir=None, echo=print, selection=None):
    """`arguments`: textsql.train's three argument dataclasses, or one command line; `selection`: which hosts."""
    chosen, plan = plan_user_managed(hostfile, arguments, ssh_config=ssh_config, workdir=workdir, selection=selection)
    echo(plan.describe())
    echo(f"preflight OK: {len(chosen)} hosts, world size {plan.world_size}")
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


def runner_environment(ssh_config: Path | None, accelerator: str, echo=print, workdir: Path | None = None) -> dict:
    """The environment of DeepSpeed's runner for a pdsh launch. The runner copies every variable named MLFLOW*,
    PYTHON* or NCCL*, and each line of a .deepspeed_env file, into the remote shell command: into pdsh's argv (readable by
    every user of the machine) and through a shell on every node. So it gets this machine's basics, the ssh options,
    PYTHONPATH (checked) and the accelerator; the ranks get each host's own login environment, and no .deepspeed_env
    is read."""
    from textsql.redaction import system

    env = system(os.environ)
    env.update(PDSH_SSH_ARGS_APPEND=" ".join(ssh_options(ssh_config)), PYTHONUNBUFFERED="1", DS_ENV_FILE=os.devnull)
    if os.environ.get("PYTHONPATH"):
        check_shell_safe("PYTHONPATH", os.environ["PYTHONPATH"])
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    if os.environ.get(
        "SSH_AUTH_SOCK"
    ):  # pdsh's ssh reaches the user's ssh agent (a socket; the runner exports no SSH_*)
        env["SSH_AUTH_SOCK"] = os.environ["SSH_AUTH_SOCK"]
    if accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
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
    grace_seconds: float = 3,
    selection: HostSelection | None = None,
) -> dict:
    """Check the hosts, then `deepspeed --launcher pdsh ...`, echoing its output. Returns {"summary", "ranks",
    "launch_dir", "command", "plan"}; raises LaunchFailed naming the rank that failed first, with what the next
    launch resumes from, once every process of the launch is stopped on every host."""
    from textsql.cluster.runs import run_lock
    from textsql.sharedfiles import open_unlinked, replace_file
    from textsql.train.distributed import free_port

    find_program("pdsh", "pdsh")
    check_shell_safe("The working folder", str(Path(workdir or os.getcwd()).absolute()))
    check_shell_safe("The Python interpreter", sys.executable)
    ssh_config = Path(ssh_config).absolute() if ssh_config else None
    selection = selection or HostSelection()
    chosen, plan = plan_user_managed(
        hostfile, arguments, ssh_config=ssh_config, workdir=workdir, log_root=log_root, selection=selection
    )
    echo(plan.describe())
    with run_lock(plan.run_dir, plan.launch_id):
        prepare(plan)
        hosts = replace_file(
            plan.launch_dir / "hostfile", "".join(f"{h.address} slots={h.slots}\n" for h in read_hostfile(hostfile))
        )
        # --force_multi: with one host left DeepSpeed's runner would otherwise start the ranks on this machine.
        command = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--hostfile", str(hosts)]
        command += ["--launcher", "pdsh", "--no_ssh_check", "--force_multi", "--master_addr", chosen[0].address]
        command += ["--master_port", str(selection.master_port or free_port()), "--log_level", "warning"]
        command += ["--include", selection.include] if selection.include else []  # checked: select_hosts
        command += ["--exclude", selection.exclude] if selection.exclude else []
        command += ["--num_nodes", str(selection.num_nodes)] if selection.num_nodes > 0 else []
        spec = encode(plan.spec(hosts=[h.address for h in chosen]))
        command += ["--module", "textsql.cluster.rank", f"{LAUNCH_FLAG}{plan.launch_id}", f"--textsql_spec={spec}"]
        env = runner_environment(ssh_config, plan.accelerator, echo, plan.workdir)
        echo("training arguments (the same on every rank): " + json.dumps(plan.arguments))
        log, offsets, lost, failing_since = plan.launch_dir / "launch.log", {}, {}, None
        with open_unlinked(log, "w", binary=True) as out:
            process = subprocess.Popen(
                command, cwd=plan.workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        try:
            while True:
                running = process.poll() is None
                for line in new_lines(log, offsets):
                    echo(line)
                    if exited := PDSH_EXIT.match(line):
                        lost[exited["host"]] = f"its ssh exited with exit code {exited['code']}"
                if failing_since is None and (lost or read_records(plan.launch_dir, "failure")):
                    failing_since = time.monotonic()
                if not running or (failing_since is not None and time.monotonic() - failing_since >= grace_seconds):
                    break
                time.sleep(0.5)
        except BaseException:
            echo(f"textsql: interrupted; stopping launch {plan.launch_id} on every host")
            raise
        finally:
            _stop(process, chosen, ssh_config, plan.launch_id)
        if process.returncode and not lost and not read_records(plan.launch_dir, "failure"):
            lost[chosen[0].address] = f"DeepSpeed's runner ended with exit status {process.returncode}"
        return finish(plan, lost, command)


def _stop(process: subprocess.Popen, hosts: list[Host], ssh_config: Path | None, launch_id: str) -> None:
    """TERM this launch's processes on every node (they carry the launch id), KILL what is left, then end the local
    runner, pdsh and ssh clients — with SIGKILL: the runner's SIGTERM handler would `pkill -f deepspeed.launcher.launch`
    on every node, other launches included."""
    pattern = shlex.quote("[-]" + LAUNCH_FLAG[1:] + launch_id)  # [-] keeps the pattern from matching this very command

    def everywhere(command: str) -> list[int]:
        return [done.returncode for done in on_every_host(hosts, f"{command} -f -- {pattern}", ssh_config, timeout=20)]

    everywhere("pkill -TERM")
    deadline = time.monotonic() + 15
    while 0 in everywhere("pgrep") and time.monotonic() < deadline:
        time.sleep(1)
    everywhere("pkill -KILL")
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
