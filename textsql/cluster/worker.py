"""A cluster node's sshd: `python -m textsql.cluster.worker --cluster-dir DIR --token T [--address IP] [--port 2222]`.

Runs on every node (CML worker pods, the session as node 0, or local loopback addresses): makes a host key in
node-local temporary storage, starts sshd with the project's sshd_config (plus run-time overrides: port, listen
address, host key, pid file, authorized keys), publishes the host's public key to the shared cluster folder, then
sleeps until sshd ends, the session asks it to stop (a stop file), its parent process ends, or it gets SIGTERM.
It never spins.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from textsql.cluster.ssh import find_program

DEFAULT_PORT = 2222
REPO_SSHD_CONFIG = Path(__file__).resolve().parent.parent.parent / "docker" / "sshd_config"


def default_sshd_config() -> Path:
    """$TEXTSQL_SSHD_CONFIG, else the repository's docker/sshd_config (what the images install)."""
    return Path(os.environ.get("TEXTSQL_SSHD_CONFIG") or REPO_SSHD_CONFIG)


def published_path(cluster_dir: Path, address: str) -> Path:
    return Path(cluster_dir) / "hostkeys" / f"{address}.json"


def stop_path(cluster_dir: Path, token: str) -> Path:
    return Path(cluster_dir) / f"stop-{token}"


def sshd_command(sshd: str, config: Path, *, address: str, port: int, host_key: Path, pid_file: Path, authorized_keys: Path) -> list[str]:
    """sshd in the foreground, logging to stderr; `-p` replaces the config's Port (`-o Port=` would add one)."""
    return [sshd, "-D", "-e", "-f", str(config), "-p", str(port), "-o", f"ListenAddress={address}", "-o", f"HostKey={host_key}",
            "-o", f"PidFile={pid_file}", "-o", f"AuthorizedKeysFile={authorized_keys}"]


def wait_listening(address: str, port: int, process: subprocess.Popen, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with socket.create_connection((address, port), timeout=1) as s:
                return s.recv(4).startswith(b"SSH")
        except OSError:
            time.sleep(0.1)
    return False


def run_worker(cluster_dir: Path, token: str, address: str, port: int, sshd_config: Path, poll_seconds: float = 2.0) -> int:
    cluster_dir = Path(cluster_dir).absolute()
    authorized_keys = cluster_dir / "authorized_keys"
    for needed, what in ((sshd_config, "the sshd configuration"), (authorized_keys, "the project's authorized keys")):
        if not needed.is_file():
            print(f"textsql worker {address}: {what} {needed} does not exist", file=sys.stderr, flush=True)
            return 2
    sshd = find_program("sshd", "openssh-server")
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation folder, needed when root
    state = Path(tempfile.mkdtemp(prefix=f"textsql-sshd-{address}-"))  # node-local: the host's private key never leaves it
    published = published_path(cluster_dir, address)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    signal.signal(signal.SIGINT, lambda *_: stopping.append("SIGINT"))
    process = None
    try:
        host_key = state / "ssh_host_ed25519_key"
        subprocess.run([find_program("ssh-keygen", "openssh-client"), "-q", "-t", "ed25519", "-N", "", "-C", f"textsql-host-{address}", "-f", str(host_key)],
                       check=True, stdin=subprocess.DEVNULL)
        command = sshd_command(sshd, sshd_config, address=address, port=port, host_key=host_key, pid_file=state / "sshd.pid", authorized_keys=authorized_keys)
        print(f"textsql worker {address}: $ {' '.join(command)}", flush=True)
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        if not wait_listening(address, port, process):
            print(f"textsql worker {address}: sshd did not start listening on {address}:{port} (exit status {process.poll()})", file=sys.stderr, flush=True)
            return 1
        record = {"address": address, "port": port, "host_key": Path(f"{host_key}.pub").read_text().strip(), "token": token,
                  "hostname": socket.gethostname(), "user": os.environ.get("USER") or str(os.getuid()), "pid": os.getpid(),
                  "python": sys.executable, "engine_id": os.environ.get("CDSW_ENGINE_ID")}
        published.parent.mkdir(parents=True, exist_ok=True)
        tmp = published.with_name(f".{published.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, published)
        print(f"textsql worker {address}: sshd listening on {address}:{port}; host key published to {published}", flush=True)
        stop_file = stop_path(cluster_dir, token)
        parent = os.getppid()  # the session (local nodes) or the CML worker engine: when it is gone, so is this node
        while not stopping and not stop_file.exists() and os.getppid() == parent:
            try:
                process.wait(timeout=poll_seconds)
                print(f"textsql worker {address}: sshd exited with status {process.returncode}", file=sys.stderr, flush=True)
                return 1
            except subprocess.TimeoutExpired:
                pass
        why = stopping[0] if stopping else "stop requested" if stop_file.exists() else "its parent process ended"
        print(f"textsql worker {address}: stopping ({why})", flush=True)
        return 0
    finally:
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        try:
            if json.loads(published.read_text()).get("pid") == os.getpid():
                published.unlink()
        except (OSError, ValueError):
            pass
        shutil.rmtree(state, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m textsql.cluster.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster-dir", required=True, help="the cluster's folder in the shared project folder")
    parser.add_argument("--token", required=True, help="the cluster's token; the session accepts only host keys published with it")
    parser.add_argument("--address", default=os.environ.get("CDSW_IP_ADDRESS"), help="address sshd listens on (default: $CDSW_IP_ADDRESS)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--sshd-config", type=Path, default=None, help="sshd configuration (default: $TEXTSQL_SSHD_CONFIG or docker/sshd_config)")
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("--address is required outside CML (where $CDSW_IP_ADDRESS gives it)")
    return run_worker(Path(args.cluster_dir), args.token, args.address, args.port, args.sshd_config or default_sshd_config())


if __name__ == "__main__":
    sys.exit(main())
