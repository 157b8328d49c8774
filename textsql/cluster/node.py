"""What runs on every node of a launch: `python -m textsql.cluster.node agent|probe B64|prepare B64`.

`agent` (one per node, started by the session: a local process on node 0, `launch_workers(code=...)` on a CML worker
pod, a local process per loopback address in the local backend) connects back to the session at
$TEXTSQL_CLUSTER_ADDRESS, proves it holds $TEXTSQL_CLUSTER_TOKEN, reports what the node has, and then does what the
session asks: probe, prepare (set aside incomplete checkpoints, write node-local files), run the node's DeepSpeed
launcher with its output streamed back, stop it. Agent and session send each other heartbeats; the agent never spins,
and it ends — stopping the launcher first — when the session says so, when its connection to the session breaks or
falls silent, or on SIGTERM/SIGINT/SIGHUP: a notebook kernel that dies takes its workers with it.
`guard` keeps the launcher's process group: killing only the agent stops its launcher and ranks, too.
`probe` and `prepare` do the same for user-managed nodes, over ssh (the request on stdin: `-`), answering with one
`textsql-node: {json}` line.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from textsql.checkpoints import verify_checkpoint
from textsql.cluster.channel import SILENCE_ENV, SILENCE_SECONDS, heartbeat_seconds
from textsql.errors import TextsqlError
from textsql.sharedfiles import read_unlinked, replace_file
from textsql.strategy.devices import local_devices

ADDRESS_ENV, TOKEN_ENV, NODE_ENV, WORKER_ENV = (
    "TEXTSQL_CLUSTER_ADDRESS",
    "TEXTSQL_CLUSTER_TOKEN",
    "TEXTSQL_NODE_ADDRESS",
    "TEXTSQL_WORKER_ID",
)
CONNECT_TIMEOUT_ENV = "TEXTSQL_CLUSTER_CONNECT_TIMEOUT"
ANSWER = "textsql-node: "
STOP_GRACE_SECONDS = 10  # SIGTERM, then SIGKILL for what is left of the launcher's process group
GUARD_DEATH_SIGNAL = signal.SIGUSR1  # what the launcher's guard gets when its agent dies (nothing else sends it)


def encode(data) -> str:
    """JSON as one shell-safe word (base64url): how arguments and environments reach other nodes, unexpanded."""
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode()


def decode(word: str):
    return json.loads(base64.urlsafe_b64decode(word.encode()))


# ---------------------------------------------------------------------------------------------------------------------
# What a node has
# ---------------------------------------------------------------------------------------------------------------------


def describe_node(address: str) -> dict:
    """This node's facts for the session's decisions: devices (textsql.strategy.devices), interface, Python and versions."""
    import importlib.metadata as metadata

    from textsql.cluster.environment import interface_of, node_local_extensions_dir

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    facts = {
        "address": address,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "textsql_path": str(Path(__file__).resolve().parent.parent),
        "versions": {name: version(name) for name in ("textsql", "deepspeed", "torch", "transformers")},
        "interface": interface_of(address),
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    try:
        facts["local_extensions_dir"] = node_local_extensions_dir()
    except TextsqlError as error:  # the session refuses the launch, naming this node, unless the user set a folder
        facts["local_extensions_error"] = str(error)
    try:
        facts["devices"] = local_devices().as_dict()
    except Exception as error:  # a broken driver: the session names this node
        facts["devices_error"] = str(error)
    return facts


def _digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def probe(request: dict) -> dict:
    """Run-specific checks: folders and files present (files by digest), node 0's shared-folder marker visible,
    the run folder's checkpoints and launch record."""
    from textsql.checkpoints import list_checkpoints
    from textsql.cluster.runs import RECORD

    result = {
        "dirs": {p: os.path.isdir(p) for p in request.get("dirs", [])},
        "files": {p: _digest(p) for p in request.get("files", [])},
    }
    marker = request.get("shared_marker")
    if marker:
        result["shared_output"] = _digest(marker["path"]) == marker["digest"]
    if request.get("run_dir"):
        run_dir = Path(request["run_dir"])
        result["checkpoints"] = list_checkpoints(run_dir)
        try:
            result["record"] = json.loads(read_unlinked(run_dir / RECORD))
        except FileNotFoundError:
            result["record"] = None
        except (OSError, ValueError, TextsqlError) as error:  # the session refuses it, naming the file
            result["record"] = f"unreadable ({error})"
        from textsql.run_summary import run_state

        result["finished"] = run_state(run_dir) == "finished"
    return result


def prepare(request: dict) -> dict:
    """Get the node ready for a launch: folders, node-local files, the launch record, incomplete checkpoints set
    aside (renamed, never deleted), DeepSpeed's `latest` tag where only rank 0's node got one, stale JIT locks."""
    from textsql.cluster.environment import save_rank_env
    from textsql.cluster.runs import QUARANTINE_PREFIX, RECORD

    done = {"set_aside": [], "tagged": None}
    if request.get("rank_env") is not None:
        save_rank_env(request["launch_id"], request["node_rank"], request["rank_env"])
    for folder in request.get("mkdirs", []):
        Path(folder).mkdir(parents=True, exist_ok=True)
    for path, text in request.get("files", {}).items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, text)
    run_dir = Path(request["run_dir"]) if request.get("run_dir") else None
    if run_dir is not None:
        for name in request.get("set_aside", []):
            if (run_dir / name).is_dir():
                target = run_dir / f"{QUARANTINE_PREFIX}{name}-{request['launch_id']}"
                (run_dir / name).rename(target)
                done["set_aside"].append(str(target))
        resume = request.get("resume")
        if resume and (run_dir / resume).is_dir():
            verify_checkpoint(run_dir / resume)  # refused here, before any rank starts (each rank checks it again)
        if resume and (run_dir / resume).is_dir() and not os.path.lexists(run_dir / resume / "latest"):
            tags = sorted(p.name for p in (run_dir / resume).glob("global_step*") if p.is_dir())
            if tags:
                replace_file(run_dir / resume / "latest", tags[-1])
                done["tagged"] = tags[-1]
        if request.get("record"):
            run_dir.mkdir(parents=True, exist_ok=True)
            replace_file(run_dir / RECORD, json.dumps(request["record"], indent=2) + "\n")
    extensions = request.get("clear_stale_locks_in")
    if extensions and Path(extensions).is_dir():
        for lock in Path(extensions).glob("*/lock"):  # no rank runs on this node now: a lock is a dead build's
            lock.unlink(missing_ok=True)
    return done


# ---------------------------------------------------------------------------------------------------------------------
# The agent
# ---------------------------------------------------------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"textsql node agent: {message}", flush=True)


class Agent:
    def __init__(
        self,
        session: tuple[str, int],
        token: str,
        address: str,
        worker_id: str,
        silence_seconds: float = SILENCE_SECONDS,
    ):
        self.session, self.token, self.address, self.worker_id = session, token, address, worker_id
        self.silence_seconds = silence_seconds
        self.channel = None
        self.launcher: subprocess.Popen | None = None
        self.stopping_launcher = False
        self.launch_id = None
        self.signalled: str | None = None

    def connect(self, timeout: float) -> None:
        from textsql.cluster.channel import HandshakeDropped, HandshakeFailed, client_handshake

        hello = dict(describe_node(self.address), worker_id=self.worker_id)
        deadline = time.monotonic() + timeout
        complained = False
        while True:
            sock = None
            try:
                sock = socket.create_connection(self.session, timeout=10)
                sock.settimeout(None)
                self.channel = client_handshake(sock, self.token, hello)
                _log(
                    f"connected to the session at {self.session[0]}:{self.session[1]} as {self.address} ({self.worker_id})"
                )
                return
            except HandshakeDropped as error:  # a session busy with other handshakes drops the oldest: try again
                sock.close()
                problem = f"the handshake did not finish: {error}"
            except HandshakeFailed as error:
                raise SystemExit(
                    f"textsql node agent: the session at {self.session[0]}:{self.session[1]} refused this node: {error}"
                ) from None
            except OSError as error:
                if sock is not None:
                    sock.close()
                problem = str(error)
            if self.signalled or time.monotonic() > deadline:
                raise SystemExit(
                    f"textsql node agent: cannot reach the session at {self.session[0]}:{self.session[1]} "
                    f"({problem}); gave up after {timeout:.0f} s"
                ) from None
            if not complained:
                _log(f"cannot reach the session at {self.session[0]}:{self.session[1]} ({problem}); retrying")
                complained = True
            time.sleep(1)

    def serve(self) -> int:
        from textsql.cluster.channel import ChannelClosed

        last = time.monotonic()
        done = threading.Event()
        threading.Thread(target=self._heartbeat, args=(done,), daemon=True, name="textsql-heartbeat").start()
        try:
            while True:
                if self.signalled:
                    _log(f"{self.signalled}: stopping")
                    return 0
                message = self.channel.receive(timeout=1)
                if message is None:
                    if time.monotonic() - last > self.silence_seconds:
                        _log(
                            f"the session has been silent for {self.silence_seconds:.0f} s: it is gone, or cut off; stopping"
                        )
                        return 3
                    continue
                last = time.monotonic()
                if self.handle(message) == "bye":
                    return 0
        except ChannelClosed as error:
            _log(f"the connection to the session broke ({error}): stopping")
            return 3
        finally:
            done.set()
            self.stop_launcher()
            self.channel.close()

    def _heartbeat(self, done: threading.Event) -> None:
        """A heartbeat for the session, from its own thread: a node busy answering a long probe is not silent."""
        from textsql.cluster.channel import ChannelClosed

        while not done.wait(heartbeat_seconds(self.silence_seconds)):
            try:
                self.channel.send(op="ping")
            except ChannelClosed:
                return

    def handle(self, message: dict) -> str | None:
        op = message.get("op")
        try:
            if op == "probe":
                self.channel.send(op="answer", id=message["id"], result=probe(message["request"]))
            elif op == "prepare":
                self.channel.send(op="answer", id=message["id"], result=prepare(message["request"]))
            elif op == "run":
                self.run(message)
                self.channel.send(op="answer", id=message["id"], result={"pid": self.launcher.pid})
            elif op == "stop":
                threading.Thread(target=self.stop_launcher, daemon=True).start()
            elif op == "bye":
                return "bye"
        except Exception as error:  # tell the session what went wrong here instead of dying silently
            if "id" in message:
                self.channel.send(op="answer", id=message["id"], error=f"{type(error).__name__}: {error}")
            else:
                raise
        return None

    def run(self, message: dict) -> None:
        from textsql.cluster.environment import system

        if self.launcher is not None and self.launcher.poll() is None:
            raise RuntimeError("a launch is already running on this node")
        env = dict(system(os.environ), **message["env"])
        self.stopping_launcher = False
        self.launch_id = message.get("launch_id")
        # The guard leads the launcher's own process group; started from this (the main) thread, whose end is the
        # agent's, so that the parent-death signal reaches it when the agent dies.
        command = [sys.executable, "-m", "textsql.cluster.node", "guard", str(os.getpid()), "--", *message["command"]]
        self.launcher = subprocess.Popen(
            command,
            cwd=message["cwd"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        threading.Thread(target=self._pump, args=(self.launcher, self.launch_id), daemon=True).start()

    def _pump(self, launcher: subprocess.Popen, launch_id: str | None) -> None:
        from textsql.cluster.channel import ChannelClosed

        try:
            for line in launcher.stdout:
                self.channel.send(op="line", text=line.rstrip("\n"), launch_id=launch_id)
            code = launcher.wait()
            self.channel.send(op="exit", code=code, stopped=self.stopping_launcher, launch_id=launch_id)
        except ChannelClosed:
            pass

    def stop_launcher(self) -> None:
        """SIGTERM the launcher's whole process group (runner, node launcher, rank supervisors, ranks), then SIGKILL."""
        launcher = self.launcher
        if launcher is None or launcher.poll() is not None:
            return
        self.stopping_launcher = True
        _signal_group(launcher.pid, signal.SIGTERM)
        try:
            launcher.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(launcher.pid, signal.SIGKILL)  # stragglers whose leader already exited, too
        launcher.wait()


def _signal_group(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def set_parent_death_signal(sig) -> bool:
    """Linux: `sig` reaches this process when the thread that started it ends (prctl PR_SET_PDEATHSIG); False where
    that is not available."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig)) == 0
    except (OSError, AttributeError):
        return False


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group: from /proc on Linux, else whether the group exists."""
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for name in entries:
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # state, ppid, pgrp, ... (the name before may hold anything)
        if fields[0] != b"Z" and int(fields[2]) == pgid:
            members.append(int(name))
    return members


def guard(parent: int, command: list[str]) -> int:
    """`node guard <agent pid> -- <launcher command>`: the leader of the launcher's process group. When its agent
    dies (the parent-death signal) or it is told to stop, the whole group is stopped (SIGTERM, SIGKILL after
    STOP_GRACE_SECONDS); when the launcher ends, whatever it left in the group is stopped the same way. It ends as
    the launcher did."""
    group, stopping = os.getpgrp(), []

    def stop(signum, frame):
        if not stopping:
            stopping.append(time.monotonic())
        if signum == GUARD_DEATH_SIGNAL:  # only this process heard that the agent died: tell the group
            _signal_group(group, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, GUARD_DEATH_SIGNAL):
        signal.signal(sig, stop)
    set_parent_death_signal(GUARD_DEATH_SIGNAL)
    if os.getppid() != parent:  # the agent died before the death signal was armed
        return 1
    launcher = subprocess.Popen(command)
    while launcher.poll() is None:
        if stopping and time.monotonic() - stopping[0] > STOP_GRACE_SECONDS:
            _signal_group(group, signal.SIGKILL)
        time.sleep(0.1)
    left = [pid for pid in group_members(group) if pid != os.getpid()]
    if left:
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while [pid for pid in group_members(group) if pid != os.getpid()] and time.monotonic() < deadline:
            time.sleep(0.1)
        _signal_group(group, signal.SIGKILL)  # this process too, if something was still there
    code = launcher.returncode
    if code < 0:  # end as the launcher did, so the agent reports the same signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
    return code if code >= 0 else 128 - code


def run_agent() -> int:
    target, token = os.environ.get(ADDRESS_ENV, ""), os.environ.get(TOKEN_ENV, "")
    address = os.environ.get(NODE_ENV) or os.environ.get("CDSW_IP_ADDRESS")
    if not (target and token and address):
        _log(
            f"{ADDRESS_ENV}, {TOKEN_ENV} and {NODE_ENV} (or CDSW_IP_ADDRESS) must be set: the session sets them when it starts the agent"
        )
        return 2
    host, _, port = target.rpartition(":")
    try:
        silence = float(os.environ.get(SILENCE_ENV) or SILENCE_SECONDS)
    except ValueError:
        silence = SILENCE_SECONDS
    worker_id = os.environ.get(WORKER_ENV) or os.environ.get("CDSW_ENGINE_ID") or socket.gethostname()
    agent = Agent((host, int(port)), token, address, worker_id, silence_seconds=max(1.0, silence))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: setattr(agent, "signalled", signal.Signals(signum).name))
    agent.connect(float(os.environ.get(CONNECT_TIMEOUT_ENV, "60")))
    return agent.serve()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["agent"]:
        return run_agent()
    if argv[:1] == ["guard"] and len(argv) > 3 and argv[2] == "--":
        return guard(int(argv[1]), argv[3:])
    if len(argv) == 2 and argv[0] in ("probe", "prepare", "describe"):
        request = decode(sys.stdin.readline().strip() if argv[1] == "-" else argv[1])  # "-": on stdin, out of argv
        if argv[0] == "describe":
            answer = describe_node(request["address"])
        else:
            answer = (probe if argv[0] == "probe" else prepare)(request)
        print(ANSWER + json.dumps(answer), flush=True)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
