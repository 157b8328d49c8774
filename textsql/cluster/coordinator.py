"""Node 0's control server: accepts the node agents of one cluster start (those that prove the token), keeps them
alive with pings, carries requests to them and brings their answers, output lines and exits back as events."""

from __future__ import annotations

import itertools
import queue
import socket
import threading
import time

from textsql.cluster.channel import ChannelClosed, HandshakeFailed, server_handshake
from textsql.errors import TextsqlError

PING_SECONDS = 5


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
        self._answers: dict[int, dict] = {}
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        threading.Thread(target=self._read, daemon=True, name=f"textsql-node-{self.address}").start()

    def _read(self) -> None:
        try:
            while True:
                message = self.channel.receive()
                if message.get("op") == "answer":
                    with self._cond:
                        self._answers[message["id"]] = message
                        self._cond.notify_all()
                else:
                    self.events.put((self, message))
        except ChannelClosed as error:
            with self._cond:
                self.alive = False
                self.lost_reason = str(error)
                self._cond.notify_all()
            self.events.put((self, {"op": "lost", "reason": str(error)}))

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


class Coordinator:
    """Listens on node 0's address (an ephemeral port) for the agents of this cluster start."""

    def __init__(self, address: str, token: str, echo=print):
        self.token, self.echo = token, echo
        self.events: queue.Queue = queue.Queue()
        self.links: list[NodeLink] = []
        self._joined = threading.Condition()
        self._closed = threading.Event()
        self.server = socket.create_server((address, 0))
        self.address, self.port = address, self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="textsql-coordinator").start()
        threading.Thread(target=self._ping, daemon=True, name="textsql-pings").start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock, peer), daemon=True).start()

    def _admit(self, sock, peer) -> None:
        try:
            channel, facts = server_handshake(sock, self.token)
        except HandshakeFailed as error:
            self.echo(f"textsql: refused a connection from {peer[0]}: {error}")
            sock.close()
            return
        if self._closed.is_set():
            channel.close()
            return
        with self._joined:
            self.links.append(NodeLink(channel, facts, self.events))
            self._joined.notify_all()

    def _ping(self) -> None:
        while not self._closed.wait(PING_SECONDS):
            for link in list(self.links):
                if link.alive:
                    link.send(op="ping")

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
        for link in self.links:
            link.close()
