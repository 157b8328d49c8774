"""SSH for multi-node launches: the per-project key pair, known_hosts built from published host keys, the client config.

Nothing here touches ~/.ssh: every ssh call (preflight, pdsh, the launcher's clean-up) reads the config file written
by `write_ssh_config`, which names the project key, the port, and a known_hosts file holding exactly the host keys
the workers published. Host keys are checked (StrictHostKeyChecking yes), never waved through.
"""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

from textsql.errors import TextsqlError

KEY_NAME = "id_ed25519"
KEY_COMMENT = "textsql project key"


def find_program(name: str, package: str) -> str:
    for candidate in (shutil.which(name), f"/usr/sbin/{name}", f"/usr/bin/{name}"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise TextsqlError(f"`{name}` is not installed on this machine. Install the {package} package (Debian/Ubuntu: apt-get install {package}).")


def ensure_project_key(key_dir) -> Path:
    """The project's ed25519 key pair in key_dir (0700), private key 0600; made on first use, checked afterwards."""
    key_dir = Path(key_dir)
    key = key_dir / KEY_NAME
    key_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(key_dir, 0o700)
    if not key.exists():
        keygen = find_program("ssh-keygen", "openssh-client")
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", KEY_COMMENT, "-f", str(key)], check=True, stdin=subprocess.DEVNULL)
    mode = stat.S_IMODE(key.stat().st_mode)
    if mode & 0o077:
        raise TextsqlError(f"The project's private key {key} has mode {mode:04o}: others can read it, and ssh refuses such a key. Run `chmod 600 {key}`.")
    if key.stat().st_uid != os.getuid():
        raise TextsqlError(f"The project's private key {key} belongs to another user (uid {key.stat().st_uid}); ssh refuses it. Remove {key_dir} to make a new one.")
    if not key.with_suffix(".pub").exists():
        raise TextsqlError(f"{key}.pub is missing. Remove {key_dir} and start again: textsql makes a new key pair.")
    return key


def public_key(key: Path) -> str:
    return Path(f"{key}.pub").read_text().split("\n")[0].strip()


def authorized_keys_line(key: Path, allowed_from: str | None) -> str:
    """The project key, allowed to run commands but nothing else (no forwarding, no pty), from node 0's address only."""
    options = "restrict" + (f',from="{allowed_from}"' if allowed_from else "")
    return f"{options} {public_key(key)}\n"


def host_key_line(address: str, port: int, host_key: str) -> str:
    """A known_hosts line: `[address]:port type base64` (the bracket form is what ssh looks up for a port other than 22)."""
    fields = host_key.split()
    if len(fields) < 2 or not fields[0].startswith("ssh-"):
        raise TextsqlError(f"The host key published for {address} is not an OpenSSH public key: {host_key[:60]!r}")
    name = address if port == 22 else f"[{address}]:{port}"
    return f"{name} {fields[0]} {fields[1]}\n"


def write_ssh_config(path, *, hosts: list[str], port: int, key: Path, known_hosts: Path, user: str | None = None) -> Path:
    """An ssh client config for exactly these hosts; pdsh gets it through PDSH_SSH_ARGS_APPEND='-F path'."""
    path = Path(path)
    lines = [
        "# Written by textsql for one cluster; every ssh call of a launch reads only this file (ssh -F).",
        f"Host {' '.join(hosts)}",
        f"  Port {port}",
        f"  User {user or getpass.getuser()}",
        f"  IdentityFile {key}",
        "  IdentitiesOnly yes",
        f"  UserKnownHostsFile {known_hosts}",
        "  GlobalKnownHostsFile /dev/null",
        "  StrictHostKeyChecking yes",
        "  BatchMode yes",
        "  PasswordAuthentication no",
        "  ConnectTimeout 10",
        "  ServerAliveInterval 5",
        "  ServerAliveCountMax 3",
        "  ForwardAgent no",
        "  ForwardX11 no",
        "  LogLevel ERROR",
        "Host *",
        "  BatchMode yes",
        "  StrictHostKeyChecking yes",
        f"  UserKnownHostsFile {known_hosts}",
        "  GlobalKnownHostsFile /dev/null",
        "",
    ]
    path.write_text("\n".join(lines))
    os.chmod(path, 0o600)
    return path


def ssh_argv(config: Path, host: str, command: str) -> list[str]:
    return [find_program("ssh", "openssh-client"), "-F", str(config), host, command]


def remote_command(argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> str:
    """A shell command line for the remote side: `cd CWD && env K=V ... argv...`, every piece quoted."""
    parts = []
    if cwd:
        parts.append(f"cd {shlex.quote(cwd)} &&")
    if env:
        parts.append("env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
    parts.append(" ".join(shlex.quote(a) for a in argv))
    return " ".join(parts)


def run_ssh(config: Path, host: str, command: str, *, timeout: float = 60, stdin: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(ssh_argv(config, host, command), input=stdin, capture_output=True, text=True, timeout=timeout,
                              stdin=None if stdin is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess([], 255, "", f"ssh timed out after {timeout:.0f} s")


def explain_ssh_failure(host: str, port: int, stderr: str) -> str:
    """Turn ssh's stderr into what is wrong and what to do."""
    text = stderr.strip()
    last = text.splitlines()[-1] if text else "no message"
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in text or "Host key verification failed" in text:
        return (f"ssh refused {host}: its host key is not the one it published to the project folder (host key "
                "verification failed). Another machine may be answering at that address; stop the workers and start new ones.")
    if "Connection refused" in text:
        return f"nothing accepts ssh on {host} port {port} (connection refused): the worker's sshd is not running there."
    if "timed out" in text or "No route to host" in text:
        return f"ssh to {host} port {port} timed out: the address is unreachable or a firewall drops port {port}."
    if "Permission denied" in text:
        return (f"{host} refused the project key (permission denied): its sshd does not have this project's public key in "
                "its authorized keys, or it only accepts connections from node 0.")
    return f"ssh to {host} port {port} failed: {last}"
