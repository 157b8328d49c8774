"""The control port and connection of textsql.cluster under attack and faults, with real sockets on 127.0.0.1 and
real processes: an on-path relay that injects, replays, reorders and alters messages after a genuine handshake;
oversized, slow and malformed hellos; more handshakes than the session takes at once; accept() out of file
descriptors; silent agents both ways; a rank report that is not JSON; a lost node named before the peers that only
followed it; the launcher's guard that stops the launch when only its agent is killed."""

from __future__ import annotations

import json
import os
import queue
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from textsql.cluster.channel import PROTOCOL, ChannelClosed, HandshakeFailed, client_handshake, server_handshake
from textsql.cluster.coordinator import Coordinator
from textsql.cluster.hostfile import Host
from textsql.cluster.launch import LaunchMonitor, failure_message
from textsql.cluster.node import Agent, group_members
from textsql.cluster.workers import stop_launch_groups

TOKEN = "c" * 64
HOST = "127.0.0.1"


@pytest.fixture
def coordinators():
    """Coordinators on 127.0.0.1 that are closed at the end of the test; each one's echoed lines in `.said`."""
    made = []

    def make(**kwargs) -> Coordinator:
        said: list[str] = []
        coordinator = Coordinator(HOST, TOKEN, echo=said.append, **kwargs)
        coordinator.said = said
        made.append(coordinator)
        return coordinator

    yield make
    for coordinator in made:
        coordinator.close()


@pytest.fixture
def thread_errors():
    """Exceptions that escaped any thread during the test (a traceback in the notebook)."""
    caught, previous = [], threading.excepthook
    threading.excepthook = lambda args: caught.append(f"{args.exc_type.__name__}: {args.exc_value}")
    yield caught
    threading.excepthook = previous


def join(coordinator: Coordinator, node: dict | None = None, token: str = TOKEN, target=None):
    """A genuine agent's end of the control connection (the handshake done), and the session's link for it."""
    before = len(coordinator.links)
    sock = socket.create_connection(target or (HOST, coordinator.port), timeout=10)
    sock.settimeout(None)
    channel = client_handshake(sock, token, node or {"address": "127.0.0.9", "worker_id": "w"}, timeout=10)
    links = coordinator.wait_for(before + 1, timeout=10)
    return channel, links[-1]


def challenge(sock: socket.socket) -> dict:
    """The session's first line on a new connection."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        assert chunk, "closed before the challenge"
        data += chunk
    return json.loads(data)


def closed_by_the_session(sock: socket.socket, within: float = 20) -> bool:
    """Whether the session ends this connection (EOF or reset) within `within` seconds; what it says first is read."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def event(coordinator: Coordinator, op: str, timeout: float = 10) -> tuple[object, dict]:
    deadline = time.monotonic() + timeout
    while True:
        link, message = coordinator.events.get(timeout=max(0.01, deadline - time.monotonic()))
        if message.get("op") == op:
            return link, message


# ---------------------------------------------------------------------------------------------------------------------
# Integrity after the handshake
# ---------------------------------------------------------------------------------------------------------------------


class Relay:
    """An on-path relay between one agent and the session: it passes every line on (the handshake included, so both
    proofs pass), and a test can add, drop or change lines in either direction ("to_session", "to_agent")."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.listener = socket.create_server((HOST, 0))
        self.address = self.listener.getsockname()
        self.hooks = {"to_session": None, "to_agent": None}
        self.ends: dict[str, socket.socket] = {}
        self.seen: dict[str, list[bytes]] = {"to_session": [], "to_agent": []}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        agent, _ = self.listener.accept()
        session = socket.create_connection(self.target)
        self.ends = {"to_session": session, "to_agent": agent}
        self._ready.set()
        threading.Thread(target=self._pump, args=(agent, "to_session"), daemon=True).start()
        self._pump(session, "to_agent")

    def _pump(self, source: socket.socket, direction: str) -> None:
        try:
            for line in source.makefile("rb"):
                self.seen[direction].append(line)
                hook = self.hooks[direction]
                for out in hook(line) if hook else [line]:
                    self.write(direction, out)
        except OSError:
            pass

    def write(self, direction: str, data: bytes) -> None:
        self._ready.wait(10)
        with self._lock:
            try:
                self.ends[direction].sendall(data)
            except OSError:
                pass


def through_relay(coordinator: Coordinator):
    relay = Relay((HOST, coordinator.port))
    channel, link = join(coordinator, target=relay.address)
    return relay, channel, link


def test_a_relay_on_the_path_cannot_inject_replay_reorder_or_alter_messages(coordinators, tmp_path):
    coordinator = coordinators()
    marker = tmp_path / "pwned"

    # The relay passes genuine traffic both ways.
    relay, agent, link = through_relay(coordinator)
    link.send(op="probe", id=1, request={})
    assert agent.receive(timeout=10) == {"op": "probe", "id": 1, "request": {}}
    agent.send(op="line", text="step 1")
    assert event(coordinator, "line")[1]["text"] == "step 1"

    # A `run` order injected toward the agent, as a plain line or in the framed form with a made-up MAC: refused.
    forged = {"op": "run", "id": 99, "command": ["touch", str(marker)], "env": {}, "cwd": str(tmp_path)}
    for line in (json.dumps(forged).encode() + b"\n", b"0" * 64 + b" " + json.dumps(forged).encode() + b"\n"):
        relay, agent, link = through_relay(coordinator)
        relay.write("to_agent", line)
        with pytest.raises(ChannelClosed, match="failed authentication"):
            agent.receive(timeout=10)

    # Toward the session: an injected exit, a replayed line, two lines swapped, a line altered, a line dropped (noticed
    # at the next one): each ends the link.
    def inject(relay, agent):
        relay.write("to_session", json.dumps({"op": "exit", "code": 0, "launch_id": "L"}).encode() + b"\n")

    def replay(relay, agent):
        relay.hooks["to_session"] = lambda line: [line, line] if b"step 2" in line else [line]
        agent.send(op="line", text="step 2")

    def reorder(relay, agent):
        held = []
        relay.hooks["to_session"] = lambda line: (held.append(line), [])[1] if b"first" in line else [line, *held]
        agent.send(op="line", text="first")
        agent.send(op="line", text="second")

    def alter(relay, agent):
        relay.hooks["to_session"] = lambda line: [line.replace(b"step 3", b"step 4")]
        agent.send(op="line", text="step 3")

    def drop(relay, agent):
        relay.hooks["to_session"] = lambda line: [] if b"step 5" in line else [line]
        agent.send(op="line", text="step 5")
        agent.send(op="line", text="step 6")

    for tamper in (inject, replay, reorder, alter, drop):
        while not coordinator.events.empty():
            coordinator.events.get()
        relay, agent, link = through_relay(coordinator)
        tamper(relay, agent)
        got = []
        while True:
            source, message = coordinator.events.get(timeout=10)
            if source is not link:
                continue
            if message["op"] == "lost":
                break
            got.append(message)
        assert "failed authentication" in message["reason"], tamper.__name__
        assert got == ([{"op": "line", "text": "step 2"}] if tamper is replay else []), tamper.__name__
        assert not link.alive
    assert not marker.exists()


def test_another_connections_or_directions_messages_do_not_verify(coordinators):
    """A frame recorded on one connection, replayed on another (or reflected back), is refused."""
    coordinator = coordinators()
    relay, agent, _ = through_relay(coordinator)
    agent.send(op="line", text="recorded")
    event(coordinator, "line")
    recorded = relay.seen["to_session"][-1]
    relay2, agent2, _ = through_relay(coordinator)
    relay2.write("to_agent", recorded)  # reflected toward an agent
    with pytest.raises(ChannelClosed, match="failed authentication"):
        agent2.receive(timeout=10)
    relay3, _, link3 = through_relay(coordinator)
    relay3.write("to_session", recorded)  # replayed into another connection
    assert "failed authentication" in event(coordinator, "lost")[1]["reason"] and not link3.alive


# ---------------------------------------------------------------------------------------------------------------------
# Before authentication: small hellos, bounded time, bounded handshakes, quiet refusals
# ---------------------------------------------------------------------------------------------------------------------


def test_a_hello_is_small_and_the_handshake_ends_in_time_even_while_bytes_keep_arriving(coordinators):
    coordinator = coordinators(handshake_seconds=2, refusal_summary_seconds=3600)

    big = socket.create_connection((HOST, coordinator.port), timeout=10)
    challenge(big)
    with pytest.raises((BrokenPipeError, ConnectionResetError)):  # the session stops reading long before 32 MiB
        big.sendall(
            b"x" * 32 * 2**20
        )  # no newline: one "hello" of 32 MiB, more than every socket buffer on the way holds
    assert closed_by_the_session(big)

    slow = socket.create_connection((HOST, coordinator.port), timeout=10)
    challenge(slow)
    ended = False
    deadline = time.monotonic() + 30
    while not ended and time.monotonic() < deadline:  # a byte every 50 ms: never silent, never a whole line
        try:
            slow.send(b" ")
            time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            ended = True
    assert ended, "the session still read a hello after 30 s of drip-fed bytes"
    coordinator.close()
    (summary,) = coordinator.said
    assert "refused 2 connection(s)" in summary and "1 hello too long" in summary and "1 no hello in time" in summary


def test_handshakes_at_once_are_bounded_and_a_genuine_agent_still_gets_in(coordinators):
    coordinator = coordinators(max_pending=4, handshake_seconds=60, refusal_summary_seconds=3600)
    idle = []
    for _ in range(10):
        sock = socket.create_connection((HOST, coordinator.port), timeout=10)
        challenge(sock)  # its handshake started
        idle.append(sock)
    assert all(closed_by_the_session(sock) for sock in idle[:6])  # the oldest were dropped to make room
    join(coordinator)  # admitted at once, beside 4 idle handshakes
    assert closed_by_the_session(idle[6])
    for sock in idle[7:]:  # the newest are still waiting for their hello
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(1)
    coordinator.close()
    assert (
        "dropped: too many handshakes at once" in coordinator.said[-1]
        and "refused 10 connection(s)" in coordinator.said[-1]
    )


MALFORMED = [
    b"[1, 2, 3]\n",
    b'"a string"\n',
    b"[" * 20000 + b"]" * 20000 + b"\n",
    json.dumps(
        {
            "protocol": PROTOCOL,
            "nonce": "0" * 32,
            "node": {"deep": json.loads("[" * 900 + "]" * 900)},
            "proof": "0" * 64,
        }
    ).encode()
    + b"\n",
    json.dumps(
        {"protocol": PROTOCOL, "nonce": "0" * 32, "node": {"address": "x"}, "proof": "é" * 64}, ensure_ascii=False
    ).encode()
    + b"\n",
    json.dumps({"protocol": PROTOCOL, "nonce": 5, "node": [], "proof": None}).encode() + b"\n",
    json.dumps({"protocol": PROTOCOL, "nonce": "0" * 32, "node": {"address": "x"}, "proof": ["0" * 64]}).encode()
    + b"\n",
    b"\xff\xfe\xfd\n",
    b"{}\n",
    json.dumps(
        {"protocol": "textsql-cluster/1", "nonce": "0" * 32, "node": {"address": "x"}, "proof": "0" * 64}
    ).encode()
    + b"\n",
]


def test_malformed_hellos_are_refused_quietly_and_summed_up_in_one_line(coordinators, thread_errors):
    coordinator = coordinators(refusal_summary_seconds=3600)
    for hello in MALFORMED:
        sock = socket.create_connection((HOST, coordinator.port), timeout=10)
        challenge(sock)
        sock.sendall(hello)
        assert closed_by_the_session(sock), hello[:60]
        sock.close()
    for _ in range(200):
        with socket.create_connection((HOST, coordinator.port), timeout=10) as sock:
            challenge(sock)
            sock.sendall(b"[]\n")
            assert closed_by_the_session(sock)
    # A hello with the right proof but facts without an address is refused too; the port still admits a genuine agent.
    with pytest.raises(HandshakeFailed):
        join(coordinator, node={"worker_id": "no address"})
    join(coordinator)
    assert coordinator.said == [] and thread_errors == []
    coordinator.close()
    (summary,) = coordinator.said
    assert (
        summary.startswith(f"textsql: refused {len(MALFORMED) + 201} connection(s) to the control port")
        and "from 127.0.0.1" in summary
    )
    assert "malformed hello" in summary and "Traceback" not in summary


def test_the_accept_loop_survives_running_out_of_file_descriptors(coordinators):
    coordinator = coordinators()
    first, second = socket.socket(), socket.socket()  # their descriptors are taken before there are none left
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
        while True:
            try:
                fillers.append(os.dup(first.fileno()))
            except OSError:
                break
        # A blocked accept() holds the descriptor it will return: the first connection gets it, then accept() fails
        # with EMFILE until descriptors are free again; the second connection waits in the backlog meanwhile.
        first.connect((HOST, coordinator.port))
        deadline = time.monotonic() + 10
        while not coordinator.said and time.monotonic() < deadline:
            time.sleep(0.05)
        second.connect((HOST, coordinator.port))
        time.sleep(0.5)  # accept() keeps failing meanwhile
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for client in (first, second):
        client.settimeout(None)
        client_handshake(client, TOKEN, {"address": "127.0.0.9"}, timeout=10)
    coordinator.wait_for(2, timeout=10)
    assert len(coordinator.said) == 2, (
        coordinator.said
    )  # said once, however often it failed, and once that it works again
    assert "cannot accept connections ([Errno 24] Too many open files)" in coordinator.said[0]
    assert "accepts connections again" in coordinator.said[1]


# ---------------------------------------------------------------------------------------------------------------------
# Heartbeats both ways
# ---------------------------------------------------------------------------------------------------------------------


def test_heartbeats_both_ways_a_silent_agent_is_lost_and_an_agent_leaves_a_silent_session(coordinators):
    coordinator = coordinators(silence_seconds=2)
    _, link = join(coordinator)  # an agent that says nothing after its handshake (SIGSTOPped, cut off)
    _, lost = event(coordinator, "lost", timeout=30)
    assert lost["reason"].startswith("silent for") and "no heartbeat" in lost["reason"] and not link.alive

    channel, link = join(coordinator)  # a real agent: its heartbeats keep it
    agent = Agent((HOST, coordinator.port), TOKEN, "127.0.0.9", "w", silence_seconds=2)
    agent.channel = channel
    ended: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: ended.put(agent.serve()), daemon=True).start()
    time.sleep(5)
    assert link.alive and coordinator.events.empty()

    # A session that falls silent: the agent stops (and would stop its launcher), it does not wait forever.
    server = socket.create_server((HOST, 0))
    accepted = {}
    threading.Thread(
        target=lambda: accepted.update(channel=server_handshake(server.accept()[0], TOKEN)[0]), daemon=True
    ).start()
    lonely = Agent(server.getsockname(), TOKEN, "127.0.0.8", "w2", silence_seconds=2)
    lonely.channel = client_handshake(socket.create_connection(server.getsockname()), TOKEN, {"address": "127.0.0.8"})
    assert lonely.serve() == 3
    coordinator.close()
    assert ended.get(timeout=10) == 0  # told `bye`
    server.close()


# ---------------------------------------------------------------------------------------------------------------------
# What the launch makes of rank reports and lost nodes
# ---------------------------------------------------------------------------------------------------------------------


def test_a_rank_report_that_is_not_json_does_not_tear_the_launch_down():
    monitor = LaunchMonitor()
    for text in (
        "textsql-rank-exit: <not JSON>",
        "textsql-rank-exit: [1, 2]",
        'textsql-rank-exit: {"rank": "one"}',
        "textsql-rank-exit: " + "[" * 5000,
        'textsql-rank-summary: {"no": "rank"}',
        "textsql-rank-summary: {",
    ):
        monitor.feed(f"127.0.0.2: [rank 1] {text}")
    assert monitor.failures == [] and monitor.ranks == {} and monitor.failed_at is None
    assert monitor.tails[1][0] == "textsql-rank-exit: <not JSON>"  # kept as output
    monitor.feed(
        '127.0.0.2: [rank 1] textsql-rank-exit: {"rank": 1, "tail": "x", "ended_at": "soon"}'
    )  # a report with odd fields
    monitor.node_ended("127.0.0.2", 1)
    message, failures = failure_message(monitor, [Host("127.0.0.1", 1), Host("127.0.0.2", 1)], Path("/l"), None)
    assert (
        message.startswith("Rank 1 on node 1 (127.0.0.2, host ?) failed first: failed.") and failures[0]["tail"] == []
    )


def rank_exit(rank, how, tail, ended, node, told=False):
    record = {
        "rank": rank,
        "host": f"pod-{rank}",
        "how": how,
        "log": f"/x/rank-{rank}.log",
        "tail": tail,
        "ended_at": ended,
        "told_to_stop": told,
    }
    return f"{node}: [rank {rank}] textsql-rank-exit: {json.dumps(record)}"


def test_a_node_whose_agent_vanished_is_named_not_the_peer_that_only_lost_its_connection():
    hosts = [Host("10.0.0.1", 1), Host("10.0.0.2", 1)]
    monitor = LaunchMonitor()
    monitor.feed("10.0.0.2: [rank 1] step 7")
    monitor.node_ended("10.0.0.2", "lost: connection closed", at=100.0)
    monitor.feed(
        rank_exit(
            0,
            "exited with status 1",
            ["RuntimeError: [gloo] Connection closed by peer [10.0.0.2]:41237"],
            100.5,
            "10.0.0.1",
        )
    )
    message, failures = failure_message(monitor, hosts, Path("/l"), "resumes from checkpoint-5 (...)")
    print(message)
    assert message.startswith(
        "Node 1 (10.0.0.2, rank(s) 1) was lost first: its agent vanished (connection closed: the agent, or its pod, died)."
    )
    assert (
        "  rank 1 | step 7" in message
        and "Then rank 0 on 10.0.0.1: exited with status 1 (stopped because of it)" in message
    )
    assert "Rank 0 on node 0" not in message and [f["rank"] for f in failures] == [0]
    assert "those of node 1 end with its agent" in message and message.endswith(
        "the next launch resumes from checkpoint-5 (...)."
    )

    frozen = LaunchMonitor()
    frozen.node_ended("10.0.0.2", "lost: silent for 40 s (no heartbeat: frozen, or cut off from the session)", at=50.0)
    frozen.feed(rank_exit(0, "killed by SIGTERM", ["step 9"], 95.0, "10.0.0.1", told=True))
    assert failure_message(frozen, hosts, Path("/l"), None)[0].startswith(
        "Node 1 (10.0.0.2, rank(s) 1) was lost first: its agent went silent for 40 s (no heartbeat: frozen, or cut off from the session)."
    )

    oom = LaunchMonitor()  # a rank that failed on its own before its node was lost is still the one named
    oom.feed(rank_exit(1, "exited with status 1", ["torch.OutOfMemoryError: CUDA out of memory."], 99.0, "10.0.0.2"))
    oom.node_ended("10.0.0.2", "lost: connection closed", at=100.0)
    assert failure_message(oom, hosts, Path("/l"), None)[0].startswith(
        "Rank 1 on node 1 (10.0.0.2, host pod-1) failed first"
    )


# ---------------------------------------------------------------------------------------------------------------------
# The launcher's guard: killing only the agent stops its launcher and ranks
# ---------------------------------------------------------------------------------------------------------------------

# A stand-in agent: starts the guard over a "launcher" that starts a "rank" (both sleep), prints the guard's pid.
FAKE_AGENT = """
import os, subprocess, sys, time
rank = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
guard = subprocess.Popen([sys.executable, "-m", "textsql.cluster.node", "guard", str(os.getpid()), "--", sys.executable, "-c", rank,
                          "--textsql_launch=" + sys.argv[1]], start_new_session=True)
print(guard.pid, flush=True)
time.sleep(600)
"""


def fake_agent(launch_id: str) -> tuple[subprocess.Popen, int]:
    agent = subprocess.Popen([sys.executable, "-c", FAKE_AGENT, launch_id], stdout=subprocess.PIPE, text=True)
    group = int(agent.stdout.readline())
    deadline = time.monotonic() + 30
    while len(group_members(group)) < 3:  # guard, launcher, rank
        assert time.monotonic() < deadline, f"the launch did not start: {group_members(group)}"
        time.sleep(0.05)
    return agent, group


def test_killing_only_the_agent_stops_its_launcher_and_ranks():
    agent, group = fake_agent("L1")
    try:
        agent.kill()  # SIGKILL: no clean-up code of the agent runs
        agent.wait()
        deadline = time.monotonic() + 30
        while group_members(group) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group_members(group) == []
    finally:
        os.killpg(group, signal.SIGKILL) if group_members(group) else None

    # The session makes sure of it before it says that everything stopped: a group of its launch, and only of its launch.
    agent, group = fake_agent("L2")
    try:
        assert stop_launch_groups([(group, "another-launch")], timeout=0.5) == [] and group_members(group)
        assert stop_launch_groups([(group, "L2")], timeout=0.5) == [group] and group_members(group) == []
    finally:
        agent.kill()
        agent.wait()
        os.killpg(group, signal.SIGKILL) if group_members(group) else None
