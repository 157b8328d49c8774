"""Node 0's control server: accepts the node agents of one cluster start (those that prove the token), exchanges
heartbeats with them (an agent silent too long is lost), carries requests to them and brings their answers, output
lines and exits back as events. Before authentication a connection gets little: a small hello, a few seconds, one of
a bounded number of handshake slots; refusals are summed up, not printed one by one."""

from __future__ import annotations

import itertools
import queue
import socket
import threading
import time

from textsql.cluster.channel import (
    HANDSHAKE_SECONDS,
    SILENCE_SECONDS,
    ChannelClosed,
    HandshakeFailed,
    heartbeat_seconds,
    server_handshake,
)
from textsql.errors import TextsqlError

MAX_PENDING = 32  # handshakes in progress at once; a new connection beyond them drops the oldest (an idle one, mostly)
REFUSAL_SUMMARY_SECONDS = 10  # refused connections are summed up in one line at most this often
ACCEPT_BACKOFF_SECONDS = (0.05, 1.0)  # after a failed accept(): the first pause, and the longest


class NodeError(TextsqlError):
    """A node could not do what was asked (its agent's error, or the connection broke)."""


class NodeLink:
    """The session's end of one agent's connection. Answers go to whoever asked; anything else becomes an event."""

    def __init__(self, channel, facts: dict, events: queue.Queue):
        self.channel, self.facts, self.events = channel, facts, events
        self.address = facts["address"]
        self.worker_id = facts.get("worker_id")
        self.alive = True
        self.lost_reason = None
        self.last_heard = time.monotonic()
        self.launcher: tuple[int, str] | None = None  # (pid, launch id) of the launcher its agent runs, once asked to
        self._answers: dict[int, dict] = {}
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        threading.Thread(target=self._read, daemon=True, name=f"textsql-node-{self.address}").start()

    def _read(self) -> None:
        try:
            while True:
                message = self.channel.receive()
                self.last_heard = time.monotonic()
                op = message.get("op")
                if op == "ping":
                    continue
                if op == "answer":
                    with self._cond:
                        self._answers[message.get("id")] = message
                        self._cond.notify_all()
                else:
                    self.events.put((self, message))
        except ChannelClosed as error:
            self.lose(str(error))

    def lose(self, reason: str, since: float | None = None) -> None:
        """The agent is gone (its connection broke, or it fell silent `since` that wall-clock time): one `lost` event,
        and the connection closed."""
        with self._cond:
            if not self.alive:
                return
            self.alive = False
            self.lost_reason = reason
            self._cond.notify_all()
        self.events.put((self, {"op": "lost", "reason": reason, "at": time.time() if since is None else since}))
        self.channel.close()

    def send(self, **message) -> bool:
        try:
            self.channel.send(**message)
            return True
        except ChannelClosed:
            return False

    def ask(self, op: str, timeout: float = 300, **payload):
        number = next(self._ids)
        if not self.send(op=op, id=number, **payload):
            raise NodeError(f"{self.address}: the connection to its agent is broken")
        deadline = time.monotonic() + timeout
        with self._cond:
            while number not in self._answers:
                if not self.alive:
                    raise NodeError(f"{self.address}: its agent went away ({self.lost_reason})")
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                    raise NodeError(f"{self.address}: no answer to '{op}' within {timeout:.0f} s")
            answer = self._answers.pop(number)
        if "error" in answer:
            raise NodeError(f"{self.address}: {answer['error']}")
        return answer["result"]

    def close(self) -> None:
        self.send(op="bye")
        self.channel.close()


def ask_all(links: list[NodeLink], op: str, payloads: dict[str, dict], timeout: float = 300) -> dict[str, object]:
    """Ask every link at once; address -> answer. Raises one NodeError naming every node that failed."""
    results, errors = {}, []

    def one(link):
        try:
            results[link.address] = link.ask(op, timeout=timeout, request=payloads[link.address])
        except NodeError as error:
            errors.append(str(error))

    threads = [threading.Thread(target=one, args=(link,), daemon=True) for link in links]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise NodeError(f"{op} failed on {len(errors)} node(s):\n" + "\n".join(f"  {e}" for e in sorted(errors)))
    return results


class Refusals:
    """Connections refused before authentication, counted by reason and summed up in one line per period."""

    def __init__(self, period: float):
        self.period = period
        self._lock = threading.Lock()
        self._reasons: dict[str, int] = {}
        self._peers: set[str] = set()
        self._since: float | None = None

    def note(self, peer: str, reason: str) -> None:
        with self._lock:
            self._reasons[reason] = self._reasons.get(reason, 0) + 1
            self._peers.add(peer)
            if self._since is None:
                self._since = time.monotonic()

    def summary(self, force: bool = False) -> str | None:
        """The line for the refusals since the last one, once `period` seconds have passed since the first of them
        (or now, with `force`); None when there is nothing to say yet."""
        with self._lock:
            if self._since is None or not (force or time.monotonic() - self._since >= self.period):
                return None
            count = sum(self._reasons.values())
            reasons = ", ".join(
                f"{n} {reason}" for reason, n in sorted(self._reasons.items(), key=lambda item: -item[1])
            )
            peers = sorted(self._peers)
            more = f" and {len(peers) - 5} more" if len(peers) > 5 else ""
            line = (
                f"textsql: refused {count} connection(s) to the control port that did not prove this cluster's "
                f"token ({reasons}), from {', '.join(peers[:5])}{more}"
            )
            self._reasons, self._peers, self._since = {}, set(), None
            return line


class Coordinator:
    """Listens on node 0's address (an ephemeral port) for the agents of this cluster start. `silence_seconds`: an
    agent not heard from for this long is lost (it is frozen, or cut off); the agents get the same bound."""

    def __init__(
        self,
        address: str,
        token: str,
        echo=print,
        *,
        silence_seconds: float = SILENCE_SECONDS,
        handshake_seconds: float = HANDSHAKE_SECONDS,
        max_pending: int = MAX_PENDING,
        refusal_summary_seconds: float = REFUSAL_SUMMARY_SECONDS,
    ):
        self.token, self.echo = token, echo
        self.silence_seconds, self.handshake_seconds, self.max_pending = silence_seconds, handshake_seconds, max_pending
        self.refusals = Refusals(refusal_summary_seconds)
        self.events: queue.Queue = queue.Queue()
        self.links: list[NodeLink] = []
        self._joined = threading.Condition()
        self._closed = threading.Event()
        self._pending: dict[
            socket.socket, None
        ] = {}  # handshakes in progress, oldest first (dropped first to make room)
        self._pending_lock = threading.Lock()
        self._handshakes: set[threading.Thread] = set()  # every handshake thread still running (dropped ones too)
        self.server = socket.create_server((address, 0))
        self.address, self.port = address, self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="textsql-coordinator").start()
        threading.Thread(target=self._heartbeat, daemon=True, name="textsql-heartbeat").start()

    def _accept(self) -> None:
        """Accept for as long as the cluster runs: a failed accept() (out of file descriptors, ...) is said once, and
        retried with a growing pause; the connection waiting in the backlog is taken once it works again."""
        failures, pause = 0, ACCEPT_BACKOFF_SECONDS[0]
        while not self._closed.is_set():
            try:
                sock, peer = self.server.accept()
            except OSError as error:
                if self._closed.is_set():
                    return
                failures += 1
                if failures == 1:
                    self.echo(
                        f"textsql: the control port cannot accept connections ({error}); it keeps trying, with a "
                        f"pause of up to {ACCEPT_BACKOFF_SECONDS[1]:.0f} s (out of file descriptors? see `ulimit -n`)"
                    )
                self._closed.wait(pause)
                pause = min(pause * 2, ACCEPT_BACKOFF_SECONDS[1])
                continue
            if failures:
                self.echo(
                    f"textsql: the control port accepts connections again (after {failures} failed accept() calls)"
                )
                failures, pause = 0, ACCEPT_BACKOFF_SECONDS[0]
            with self._pending_lock:
                while len(self._pending) >= self.max_pending:
                    oldest = next(iter(self._pending))
                    del self._pending[oldest]  # no longer pending: its handshake thread refuses it as dropped
                    _shut(oldest)
                self._pending[sock] = None
                thread = threading.Thread(target=self._admit, args=(sock, peer), daemon=True)
                self._handshakes.add(thread)
                thread.start()

    def _admit(self, sock, peer) -> None:
        try:
            self._handshake(sock, peer)
        finally:
            with self._pending_lock:
                self._handshakes.discard(threading.current_thread())

    def _handshake(self, sock, peer) -> None:
        try:
            channel, facts = server_handshake(sock, self.token, self.handshake_seconds)
        except Exception as error:  # HandshakeFailed, or anything a hostile hello provoked: refused, quietly
            with self._pending_lock:
                dropped = sock not in self._pending
                self._pending.pop(sock, None)
            reason = (
                "dropped: too many handshakes at once"
                if dropped
                else "the cluster stopped during the handshake"
                if self._closed.is_set()
                else _reason(error)
            )
            self.refusals.note(str(peer[0]), reason)
            sock.close()
            return
        with self._pending_lock:
            dropped = sock not in self._pending
            self._pending.pop(sock, None)
        if dropped or self._closed.is_set():
            why = "dropped: too many handshakes at once" if dropped else "the cluster stopped during the handshake"
            self.refusals.note(str(peer[0]), why)
            channel.close()
            return
        with self._joined:
            self.links.append(NodeLink(channel, facts, self.events))
            self._joined.notify_all()

    def _heartbeat(self) -> None:
        """Heartbeats to every agent; an agent silent past the bound is lost (named in the launch's error)."""
        while not self._closed.wait(heartbeat_seconds(self.silence_seconds)):
            now = time.monotonic()
            for link in list(self.links):
                if not link.alive:
                    continue
                silent = now - link.last_heard
                if silent > self.silence_seconds:
                    link.lose(
                        f"silent for {silent:.0f} s (no heartbeat: frozen, or cut off from the session)",
                        since=time.time() - silent,
                    )
                else:
                    link.send(op="ping")
            line = self.refusals.summary()
            if line:
                self.echo(line)

    def wait_for(self, count: int, timeout: float, check=lambda: None) -> list[NodeLink]:
        """The links, once `count` agents joined; `check()` runs every second and raises for a worker that died.
        Raises TimeoutError when they did not all join in time."""
        deadline = time.monotonic() + timeout
        with self._joined:
            while len(self.links) < count:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(self.links)} of {count} joined")
                self._joined.wait(timeout=1)
                check()
            return list(self.links)

    def close(self) -> None:
        """Say goodbye to every agent (each stops what it runs and exits) and stop listening."""
        self._closed.set()
        try:
            self.server.close()
        except OSError:
            pass
        with self._pending_lock:
            for sock in list(self._pending):
                _shut(sock)
            handshakes = list(self._handshakes)
        for link in self.links:
            link.close()
        deadline = time.monotonic() + 2
        for thread in handshakes:  # each ends at once (its connection was shut); then the summary counts them all
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        line = self.refusals.summary(force=True)
        if line:
            self.echo(line)


def _shut(sock: socket.socket) -> None:
    """End a connection another thread may be reading: it sees the end at once (closing is left to that thread)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _reason(error: Exception) -> str:
    text = str(error) if isinstance(error, HandshakeFailed) else f"malformed hello ({type(error).__name__})"
    if "too long" in text:
        return "hello too long"
    if text.startswith("garbled message"):
        return "malformed hello"
    if "no answer in time" in text:
        return "no hello in time"
    if text.startswith(("connection closed", "connection broke", "[Errno")):
        return "closed during the handshake"
    return text
