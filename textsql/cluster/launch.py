"""Multi-node training: preflight every host, then `deepspeed --hostfile H --launcher pdsh --ssh_port 2222 ...`.

- The environment the remote ranks need goes into a `.deepspeed_env` file (pdsh forwards only PYTHON*, MLFLOW*, MV2*
  and UCX* variables by itself): PATH, the virtual environment, DS_ACCELERATOR, OMP_NUM_THREADS, the gloo/NCCL
  network interface, caches and offline switches.
- ssh takes its key, port and known_hosts from the cluster's ssh config (`PDSH_SSH_ARGS_APPEND='-F config'`); the
  launcher's own check (a bare `ssh host hostname`, which would read ~/.ssh) is replaced by the preflight
  (`--no_ssh_check`).
- Every rank runs `textsql.cluster.rank`, which keeps the rank's log and reports how a rank ended. When one rank dies,
  the launch stops every other rank of the run on every node within seconds and raises an error naming the host, the
  rank and the tail of its log. The next launch with the same arguments resumes from the last checkpoint
  (textsql.train does that by itself when the run folder has checkpoints but no run summary).
- Checkpoints without a shared filesystem: the preflight checks whether every node sees node 0's output folder; if
  not, training saves on each node (`--save_on_each_node True`, DeepSpeed `checkpoint.use_node_local_storage`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from textsql.cluster.hostfile import Host, read_hostfile, write_hostfile
from textsql.cluster.rank import LAUNCH_FLAG, LOG_DIR_ENV, RANK_EXIT_MARKER, RANK_SUMMARY_MARKER
from textsql.cluster.ssh import explain_ssh_failure, find_program, remote_command, run_ssh
from textsql.cluster.worker import DEFAULT_PORT
from textsql.errors import TextsqlError
from textsql.launch import SUMMARY_MARKER

# Variables passed to every rank when they are set here (besides the ones computed below).
FORWARDED_ENV = ("VIRTUAL_ENV", "LD_LIBRARY_PATH", "CUDA_HOME", "TORCH_EXTENSIONS_DIR", "HF_HOME", "HF_HUB_OFFLINE",
                 "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "TOKENIZERS_PARALLELISM")
FORWARDED_PREFIXES = ("NCCL_", "GLOO_", "TEXTSQL_")
PDSH_EXIT = re.compile(r"^pdsh@[^:]*: (?P<host>[^:\s]+): ssh exited with exit code (?P<code>\d+)")
RANK_LINE = re.compile(r"^(?P<host>[^:\s]+): \[rank (?P<rank>\d+)\] (?P<text>.*)$")
# How a rank fails when another one died first: its collective or socket broke (the cause is elsewhere).
AFTERMATH = re.compile(r"Connection (?:closed|reset) by peer|gloo::|Broken pipe|NCCL communicator was aborted|timed out", re.IGNORECASE)


class PreflightError(TextsqlError):
    """One or more hosts are not ready; the message says what is wrong where."""


class LaunchFailed(TextsqlError):
    """A multi-node launch ended badly; `failures` holds the rank records (host, rank, how, log, tail)."""

    def __init__(self, message: str, failures: list[dict], launch_dir: Path):
        super().__init__(message)
        self.failures = failures
        self.launch_dir = launch_dir


# ---------------------------------------------------------------------------------------------------------------------
# Environment of the ranks
# ---------------------------------------------------------------------------------------------------------------------


def interface_of(address: str) -> str | None:
    """The network interface whose subnet holds `address` (lo for 127.x), for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME."""
    target = struct.unpack("!I", socket.inet_aton(socket.gethostbyname(address)))[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                ip = struct.unpack("!I", fcntl.ioctl(s.fileno(), 0x8915, request)[20:24])[0]  # SIOCGIFADDR
                mask = struct.unpack("!I", fcntl.ioctl(s.fileno(), 0x891B, request)[20:24])[0]  # SIOCGIFNETMASK
            except OSError:
                continue
            if ip & mask == target & mask:
                return name
    return None


def cpu_only() -> bool:
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return True
    import torch

    return not torch.cuda.is_available()


def rank_environment(master_addr: str, log_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """What every rank needs, whatever its node's ssh login environment has."""
    env = {"PATH": os.pathsep.join(dict.fromkeys([str(Path(sys.executable).parent), *os.environ.get("PATH", "").split(os.pathsep)]))}
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    for name, value in os.environ.items():
        if name in FORWARDED_ENV or name.startswith(FORWARDED_PREFIXES):
            env.setdefault(name, value)
    if cpu_only():
        env["DS_ACCELERATOR"] = "cpu"
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")  # n ranks x all cores each thrash a node
    interface = interface_of(master_addr)
    if interface:
        env.setdefault("GLOO_SOCKET_IFNAME", interface)
        env.setdefault("NCCL_SOCKET_IFNAME", interface)
    env["PYTHONUNBUFFERED"] = "1"
    env[LOG_DIR_ENV] = str(log_dir)
    env.update(extra or {})
    return env


def write_deepspeed_env(path: Path, env: dict[str, str]) -> Path:
    """The DeepSpeed runner reads KEY=VALUE lines (no blanks, no comments) and exports them on every node."""
    lines = []
    for key, value in env.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) or re.search(r'["$`\\\n]', value):
            raise TextsqlError(f"Cannot pass {key}={value!r} to the ranks: the DeepSpeed launcher's .deepspeed_env takes no quotes, $, "
                               "backquotes, backslashes or newlines in values.")
        lines.append(f"{key}={value}\n")
    path.write_text("".join(lines))
    return path


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------------
# Preflight
# ---------------------------------------------------------------------------------------------------------------------

PROBE = r"""
import hashlib, importlib.metadata as md, json, os, socket, sys
args = json.loads(sys.argv[1])
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
def digest(path):
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None
out = {"hostname": socket.gethostname(), "python": sys.version.split()[0], "executable": sys.executable,
       "versions": {name: version(name) for name in ("textsql", "deepspeed", "torch", "transformers")},
       "files": {p: digest(p) for p in args["files"]}, "dirs": {p: os.path.isdir(p) for p in args["dirs"]},
       "shared_output": digest(args["probe"]) == args["probe_digest"]}
try:
    import textsql
    out["textsql_path"] = os.path.dirname(textsql.__file__)
except Exception as error:
    out["textsql_error"] = repr(error)
if args["gpus"]:
    try:
        import torch
        out["gpus"] = torch.cuda.device_count()
        out["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(out["gpus"])]
    except Exception as error:
        out["gpu_error"] = repr(error)
print("textsql-probe: " + json.dumps(out))
"""


@dataclass
class PreflightReport:
    hosts: list[Host]
    probes: dict[str, dict]
    shared_output: bool
    output_root: Path
    dsconfig: Path | None
    cpu: bool
    problems: list[str] = field(default_factory=list)

    def table(self) -> str:
        rows = [f"{'node':<5}{'address':<17}{'slots':<6}{'python':<9}{'textsql':<9}{'deepspeed':<11}{'torch':<16}{'devices':<9}output folder"]
        for i, host in enumerate(self.hosts):
            p = self.probes.get(host.address) or {}
            v = p.get("versions", {})
            devices = "cpu" if self.cpu else str(p.get("gpus", "?")) + " GPU"
            shared = "-" if not p else ("shared" if p.get("shared_output") else "own")
            rows.append(f"{i:<5}{host.address:<17}{host.slots:<6}{p.get('python', '?'):<9}{v.get('textsql') or '?':<9}"
                        f"{v.get('deepspeed') or '?':<11}{v.get('torch') or '?':<16}{devices:<9}{shared}")
        return "\n".join(rows)


def _train_flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    from textsql.train import flag_value, normalize_argv

    return flag_value(normalize_argv(argv), name) or default


def _resolve(workdir: Path, path: str) -> Path:
    return (workdir / path).absolute() if not Path(path).is_absolute() else Path(path)


def _dsconfig_file(train_argv: list[str], workdir: Path) -> Path | None:
    """The DeepSpeed config the ranks will read (a path relative to workdir, or a shipped name), checked here first."""
    from textsql.dsconfig import load_dsconfig, resolve_dsconfig_path

    name = _train_flag(train_argv, "deepspeed")
    if not name:
        return None
    candidate = _resolve(workdir, name)
    path = _resolve(workdir, resolve_dsconfig_path(str(candidate) if candidate.exists() else name))
    load_dsconfig(path)  # raises with every problem of the file
    return path


def preflight(hosts: list[Host], ssh_config: Path, train_argv: list[str], *, workdir=None, echo=print, timeout: float = 120) -> PreflightReport:
    """Check every host before launching: ssh (host key included), same Python / textsql / DeepSpeed / torch /
    transformers as node 0, GPUs for its slots, the working folder, dataset, model and DeepSpeed config present and
    identical, and whether node 0's output folder is shared. Raises PreflightError listing every problem by host."""
    workdir = Path(workdir or os.getcwd()).absolute()
    cpu = cpu_only()
    dsconfig = _dsconfig_file(train_argv, workdir)
    dataset = _resolve(workdir, _train_flag(train_argv, "dataset_dir", "data/wikisql"))
    model_id = _train_flag(train_argv, "model_id", "t5-small")
    model = _resolve(workdir, model_id) if _resolve(workdir, model_id).exists() else None
    output_dir = _train_flag(train_argv, "output_dir")
    output_root = _resolve(workdir, output_dir if output_dir else _train_flag(train_argv, "runs_root", "runs"))
    output_root.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    probe_file = output_root / f".textsql-shared-probe-{token[:8]}"
    probe_file.write_text(token)
    files = [str(p) for p in (dsconfig,) if p] + ([str(model / "config.json")] if model else [])
    dirs = [str(workdir), str(dataset)] + ([str(model)] if model else [])
    args = json.dumps({"files": files, "dirs": dirs, "probe": str(probe_file), "probe_digest": hashlib.sha256(token.encode()).hexdigest(), "gpus": not cpu})
    env = {"PATH": rank_environment(hosts[0].address, workdir)["PATH"], "PYTHONNOUSERSITE": "1"}
    command = remote_command([sys.executable, "-", args], env=env, cwd="/")
    port = _ssh_port(ssh_config)

    def probe(host: Host):
        done = run_ssh(ssh_config, host.address, command, timeout=timeout, stdin=PROBE)
        found = [line for line in done.stdout.splitlines() if line.startswith("textsql-probe: ")]
        if done.returncode == 255 or (not found and "ssh" in done.stderr.lower()):
            return None, explain_ssh_failure(host.address, port, done.stderr)
        if not found:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return None, f"{sys.executable} does not run there (exit status {done.returncode}): {tail}"
        return json.loads(found[-1].removeprefix("textsql-probe: ")), None

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as pool:
            results = list(pool.map(probe, hosts))
    finally:
        probe_file.unlink(missing_ok=True)
    probes, problems = {}, []
    for host, (result, problem) in zip(hosts, results):
        if problem:
            problems.append(f"{host.address}: {problem}")
        else:
            probes[host.address] = result
    problems += probe_problems(hosts, probes, cpu=cpu, workdir=workdir, dataset=dataset)
    shared = bool(probes) and all(p.get("shared_output") for p in probes.values())
    report = PreflightReport(hosts, probes, shared, output_root, dsconfig, cpu, problems)
    echo(report.table())
    if problems:
        raise PreflightError(f"Preflight found {len(problems)} problem(s):\n" + "\n".join(f"  {p}" for p in problems))
    echo(f"preflight OK: {len(hosts)} nodes, {sum(h.slots for h in hosts)} ranks, {'CPU (gloo)' if cpu else 'GPU (NCCL)'}, "
         f"output folder {output_root} {'shared by all nodes' if shared else 'NOT shared: checkpoints are saved on each node'}")
    return report


def probe_problems(hosts: list[Host], probes: dict[str, dict], *, cpu: bool, workdir: Path, dataset: Path) -> list[str]:
    """What is wrong where, from each host's probe, compared with node 0's (hosts[0]). Missing probes are skipped."""
    problems = []
    reference = probes.get(hosts[0].address)
    for i, host in enumerate(hosts):
        p = probes.get(host.address)
        if p is None:
            continue
        where = f"{host.address}" + (" (node 0)" if i == 0 else "")
        if "textsql_error" in p:
            problems.append(f"{where}: textsql does not import with {p['executable']}: {p['textsql_error']}")
        if reference and i > 0:
            if p["python"] != reference["python"]:
                problems.append(f"{where}: Python {p['python']}, but node 0 ({hosts[0].address}) has {reference['python']}")
            for name, have in p["versions"].items():
                want = reference["versions"].get(name)
                if have != want:
                    problems.append(f"{where}: {name} {have or 'is not installed'}, but node 0 ({hosts[0].address}) has {want}")
        if not cpu:
            if "gpu_error" in p:
                problems.append(f"{where}: torch cannot see the GPUs: {p['gpu_error']}")
            elif p.get("gpus", 0) < host.slots:
                problems.append(f"{where}: the hostfile gives it {host.slots} slot(s) but torch sees {p.get('gpus', 0)} GPU(s)")
        for path, is_dir in p["dirs"].items():
            if not is_dir:
                what = "working folder" if path == str(workdir) else "dataset folder" if path == str(dataset) else "model folder"
                problems.append(f"{where}: the {what} {path} does not exist there")
        for path, digest in p["files"].items():
            want = reference["files"].get(path) if reference else None
            if digest is None:
                problems.append(f"{where}: {path} does not exist there")
            elif reference and digest != want:
                problems.append(f"{where}: {path} differs from node 0's copy")
    return problems


def _ssh_port(ssh_config: Path) -> int:
    for line in Path(ssh_config).read_text().splitlines():
        if line.strip().startswith("Port "):
            return int(line.split()[1])
    return 22


# ---------------------------------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------------------------------


def deepspeed_command(hostfile: Path, hosts: list[Host], *, master_addr: str, master_port: int, ssh_port: int, launch_id: str, train_argv: list[str]) -> list[str]:
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    if launcher is None:
        raise TextsqlError("The `deepspeed` launcher is not on PATH. Install the project's requirements (bash scripts/bootstrap.sh setup).")
    command = [launcher, "--hostfile", str(hostfile), "--launcher", "pdsh", "--ssh_port", str(ssh_port), "--no_ssh_check",
               "--num_nodes", str(len(hosts))]
    if len({h.slots for h in hosts}) == 1:
        command += ["--num_gpus", str(hosts[0].slots)]
    command += ["--master_addr", master_addr, "--master_port", str(master_port), "--module", "textsql.cluster.rank",
                f"{LAUNCH_FLAG}{launch_id}", *train_argv]
    return command


def _replace_or_add(argv: list[str], name: str, value: str) -> list[str]:
    from textsql.train import replace_flag, given

    return replace_flag(argv, name, value) if given(argv, name) else argv + [f"--{name}", value]


def node_local_argv(train_argv: list[str], report: PreflightReport, launch_dir: Path, ssh_config: Path) -> list[str]:
    """Without a shared output folder: save on each node, and DeepSpeed checkpoints by local rank (a copy of the
    config with `checkpoint.use_node_local_storage`, put at the same path on every node). DeepSpeed writes the
    `latest` tag of a checkpoint on global rank 0 only, so each node's checkpoints get theirs before a resume."""
    from textsql.train import given

    argv = list(train_argv)
    if not given(argv, "save_on_each_node"):
        argv += ["--save_on_each_node", "True"]
    root = shlex.quote(str(report.output_root))
    tag_latest = (f"for d in {root}/checkpoint-*/ {root}/*/checkpoint-*/; do for g in \"$d\"global_step*; do "
                  f"[ -d \"$g\" ] && [ ! -e \"$d\"latest ] && basename \"$g\" > \"$d\"latest; done; done; true")
    text = None
    if report.dsconfig is not None:
        config = json.loads(report.dsconfig.read_text())
        config.setdefault("checkpoint", {})["use_node_local_storage"] = True
        local = launch_dir / f"node-local-{report.dsconfig.name}"
        text = json.dumps(config, indent=2) + "\n"
        local.write_text(text)
        argv = _replace_or_add(argv, "deepspeed", str(local))

    def prepare(host: Host) -> str | None:
        command = tag_latest
        if text is not None:
            command = f"mkdir -p {shlex.quote(str(launch_dir))} && cat > {shlex.quote(str(local))} && {tag_latest}"
        done = run_ssh(ssh_config, host.address, command, stdin=text or "")
        return None if done.returncode == 0 else f"{host.address}: {done.stderr.strip() or f'exit status {done.returncode}'}"

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(report.hosts)))) as pool:
        failed = [f for f in pool.map(prepare, report.hosts[1:]) if f]
    if failed:
        raise TextsqlError("Could not prepare node-local checkpoints on " + "; ".join(failed))
    return argv


def stop_remote(hosts: list[Host], ssh_config: Path, launch_id: str, sig: str = "TERM") -> None:
    """Signal this launch's processes on every node (they carry the launch id on their command line)."""
    pattern = shlex.quote("[-]" + LAUNCH_FLAG[1:] + launch_id)  # [-] keeps the pattern from matching this very command
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as pool:
        list(pool.map(lambda h: run_ssh(ssh_config, h.address, f"pkill -{sig} -f -- {pattern}", timeout=20), hosts))


def remaining_remote(hosts: list[Host], ssh_config: Path, launch_id: str) -> list[str]:
    """Nodes where a process of this launch still runs (an unreachable node counts as having none left)."""
    pattern = shlex.quote("[-]" + LAUNCH_FLAG[1:] + launch_id)
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as pool:
        codes = list(pool.map(lambda h: run_ssh(ssh_config, h.address, f"pgrep -f -- {pattern}", timeout=20).returncode, hosts))
    return [h.address for h, code in zip(hosts, codes) if code == 0]


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def launch_training(hosts: list[Host] | Path | str, ssh_config: Path, train_argv: list[str], *, hostfile: Path | None = None,
                    ssh_port: int = DEFAULT_PORT, launch_root: Path | None = None, workdir=None, echo=print, report: PreflightReport | None = None,
                    grace_seconds: float = 10, extra_env: dict[str, str] | None = None) -> dict:
    """Preflight, then run the multi-node launch, streaming every rank's output through `echo`.

    Returns {"summary": rank 0's run_summary.json, "ranks": each rank's own summary (rank order), "launch_dir",
    "command"}. Raises LaunchFailed naming the host, rank and log tail of the first rank that failed; by then every
    process of the launch has been stopped on every node.
    """
    if isinstance(hosts, (str, Path)):
        hostfile = Path(hosts)
        hosts = read_hostfile(hostfile)
    workdir = Path(workdir or os.getcwd()).absolute()
    ssh_config = Path(ssh_config).absolute()
    find_program("pdsh", "pdsh")
    launch_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    launch_dir = Path(launch_root or workdir / ".textsql" / "launches").absolute() / launch_id
    launch_dir.mkdir(parents=True)
    if hostfile is None:
        hostfile = write_hostfile(launch_dir / "hostfile", hosts)
    report = report or preflight(hosts, ssh_config, train_argv, workdir=workdir, echo=echo)
    argv = list(train_argv) if report.shared_output else node_local_argv(train_argv, report, launch_dir, ssh_config)
    master = hosts[0].address
    rank_env = rank_environment(master, launch_dir, extra_env)
    ds_env = write_deepspeed_env(launch_dir / ".deepspeed_env", rank_env)
    command = deepspeed_command(hostfile, hosts, master_addr=master, master_port=free_port(master), ssh_port=ssh_port, launch_id=launch_id, train_argv=argv)
    env = dict(os.environ, DS_ENV_FILE=str(ds_env), PDSH_SSH_ARGS_APPEND=f"-F {ssh_config}", PYTHONUNBUFFERED="1", PATH=rank_env["PATH"])
    if report.cpu:
        env["DS_ACCELERATOR"] = "cpu"
    echo("$ " + " ".join(shlex.quote(a) for a in command))
    echo(f"launch folder {launch_dir} (launch.log, rank-N.log on each node)")
    monitor = LaunchMonitor()
    lines: queue.Queue = queue.Queue()
    process = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, errors="replace", start_new_session=True)
    threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True).start()
    stopped = False
    try:
        with open(launch_dir / "launch.log", "w", buffering=1) as log:
            while (line := _next_line(lines)) is not None:
                if line:
                    log.write(line + "\n")
                    echo(line)
                    monitor.feed(line)
                if not stopped and monitor.failed_at is not None and time.monotonic() - monitor.failed_at > grace_seconds:
                    echo(f"textsql: a rank failed; stopping the rest of launch {launch_id} on every node")
                    _stop(process, reachable(hosts, monitor.node_exits), ssh_config, launch_id)
                    stopped = True
            process.wait()
    except BaseException:
        echo(f"textsql: interrupted; stopping launch {launch_id} on every node")
        _stop(process, hosts, ssh_config, launch_id)
        raise
    if monitor.failed_at is not None or process.returncode != 0 or monitor.summary_path is None:
        if not stopped:
            _stop(process, reachable(hosts, monitor.node_exits), ssh_config, launch_id)
        message = _failure_message(monitor.failures, monitor.node_exits, process.returncode, hosts, monitor.tails, launch_dir)
        raise LaunchFailed(message, monitor.failures, launch_dir)
    summary = json.loads(Path(monitor.summary_path).read_text())
    return {"summary": summary, "ranks": [monitor.ranks[r] for r in sorted(monitor.ranks)], "launch_dir": launch_dir, "command": command,
            "shared_output": report.shared_output}


def _next_line(lines: queue.Queue) -> str | None:
    """The next output line, "" when none came for half a second (to check the clock), None at the end."""
    try:
        return lines.get(timeout=0.5)
    except queue.Empty:
        return ""


@dataclass
class LaunchMonitor:
    """What the streamed output of a launch says: rank failures, lost nodes, each rank's summary and log tail."""

    failures: list[dict] = field(default_factory=list)
    node_exits: dict[str, int] = field(default_factory=dict)
    ranks: dict[int, dict] = field(default_factory=dict)
    tails: dict[int, list[str]] = field(default_factory=dict)
    summary_path: str | None = None
    failed_at: float | None = None

    def feed(self, line: str) -> None:
        match = RANK_LINE.match(line)
        text = match["text"] if match else line
        if match:
            tail = self.tails.setdefault(int(match["rank"]), [])
            tail.append(text)
            del tail[:-40]
        if RANK_EXIT_MARKER in text:
            self.failures.append(dict(json.loads(text.split(RANK_EXIT_MARKER, 1)[1]), node_address=match and match["host"]))
        elif RANK_SUMMARY_MARKER in text:
            record = dict(json.loads(text.split(RANK_SUMMARY_MARKER, 1)[1]), node_address=match and match["host"])
            self.ranks[record["rank"]] = record
        elif SUMMARY_MARKER in text:
            self.summary_path = text.split(SUMMARY_MARKER, 1)[1].strip()
        elif (lost := PDSH_EXIT.match(line)) and lost["code"] != "0":
            self.node_exits[lost["host"]] = int(lost["code"])
        if (self.failures or self.node_exits) and self.failed_at is None:
            self.failed_at = time.monotonic()


def reachable(hosts: list[Host], node_exits: dict[str, int]) -> list[Host]:
    """Hosts whose ssh session did not break (pdsh exit code 255): a lost node has nothing left to stop."""
    return [h for h in hosts if node_exits.get(h.address) != 255]


def _stop(process: subprocess.Popen, hosts: list[Host], ssh_config: Path, launch_id: str) -> None:
    """TERM this launch's processes on every node, then make sure none is left and the local pdsh/ssh are gone."""
    stop_remote(hosts, ssh_config, launch_id, "TERM")
    deadline = time.monotonic() + 15
    while (left := remaining_remote(hosts, ssh_config, launch_id)) and time.monotonic() < deadline:
        time.sleep(1)
    if left:
        stop_remote(hosts, ssh_config, launch_id, "KILL")
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the runner, pdsh and ssh clients: never SIGTERM the runner, whose
    except ProcessLookupError:                  # handler would `pkill -f deepspeed.launcher.launch` on every node
        pass
    process.wait()


def _failure_message(failures, node_exits, returncode, hosts, tails, launch_dir) -> str:
    from textsql.cluster.hostfile import rank_layout

    if failures:
        # Reports arrive through one ssh stream per node, so not always in the order the ranks died: the rank that
        # failed first is the one whose log does not merely show a broken connection to the others.
        first = next((f for f in failures if not AFTERMATH.search("\n".join(f["tail"]))), failures[0])
        lines = [f"Rank {first['rank']} on {first.get('node_address') or first['host']} (host {first['host']}) failed first: {first['how']}.",
                 f"Its log: {first['log']} (on that node). Last lines:"]
        lines += [f"  | {t}" for t in first["tail"]]
        for other in failures:
            if other is not first:
                lines.append(f"Then rank {other['rank']} on {other.get('node_address') or other['host']}: {other['how']} (log {other['log']}).")
    elif node_exits:
        layout = rank_layout(hosts)
        host, code = next(iter(node_exits.items()))
        on_host = [r for r, (h, _) in layout.items() if h == host]
        lines = [f"The launcher on {host} (rank(s) {', '.join(map(str, on_host))}) ended with exit code {code} without a rank report "
                 "(the node was lost, ssh broke, or the launcher itself failed)."]
        for rank in on_host:
            lines += [f"  rank {rank} | {t}" for t in tails.get(rank, [])[-10:]]
    else:
        lines = [f"The DeepSpeed launcher exited with status {returncode} and no run summary."]
    lines.append(f"Every process of the launch was stopped. Whole output: {launch_dir / 'launch.log'}. "
                 "Launch again with the same arguments to resume from the last checkpoint.")
    return "\n".join(lines)
