"""The control connection between the session and a node agent: JSON lines over TCP, opened by a mutual proof of
the cluster token (HMAC-SHA256 over fresh nonces of both sides; the token itself never crosses the network)."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import select
import socket
import threading
import time

PROTOCOL = "textsql-cluster/1"
MAX_LINE = 64 * 2**20


class ChannelClosed(Exception):
    """The other side closed the connection, or it broke."""


class HandshakeFailed(Exception):
    """The other side does not hold this cluster's token, or does not speak the protocol."""


class Channel:
    """Messages (dicts) in both directions; `send` may be called from several threads."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buffer = bytearray()
        self._send_lock = threading.Lock()

    def send(self, **message) -> None:
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError as error:
                raise ChannelClosed(str(error)) from None

    def receive(self, timeout: float | None = None) -> dict | None:
        """The next message; None when none came within `timeout` seconds. Raises ChannelClosed at the end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[:end + 1]
                try:
                    return json.loads(line)
                except ValueError:
                    raise ChannelClosed("garbled message") from None
            if len(self._buffer) > MAX_LINE:
                raise ChannelClosed("message too long")
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready, _, _ = select.select([self.sock], [], [], wait)
            except (OSError, ValueError) as error:
                raise ChannelClosed(str(error)) from None
            if not ready:
                return None
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError as error:
                raise ChannelClosed(str(error)) from None
            if not chunk:
                raise ChannelClosed("connection closed")
            self._buffer += chunk

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _mac(token: str, *parts: str) -> str:
    return hmac.new(token.encode(), "\x00".join(parts).encode(), hashlib.sha256).hexdigest()


def _expect(channel: Channel, timeout: float) -> dict:
    message = channel.receive(timeout)
    if message is None:
        raise HandshakeFailed("no answer")
    return message


def server_handshake(sock: socket.socket, token: str, timeout: float = 10) -> tuple[Channel, dict]:
    """Session side: challenge the agent, check its proof, prove ourselves. Returns the channel and the agent's hello."""
    channel = Channel(sock)
    nonce = secrets.token_hex(16)
    try:
        channel.send(protocol=PROTOCOL, nonce=nonce)
        hello = _expect(channel, timeout)
        node = hello.get("node")
        their = str(hello.get("nonce", ""))
        proof = _mac(token, "agent", nonce, their, json.dumps(node, sort_keys=True))
        if hello.get("protocol") != PROTOCOL or not isinstance(node, dict) or not hmac.compare_digest(str(hello.get("proof", "")), proof):
            channel.send(error="not a node of this cluster (wrong token): stop")
            raise HandshakeFailed("wrong token or protocol")
        channel.send(proof=_mac(token, "session", their, nonce))
    except ChannelClosed as error:
        raise HandshakeFailed(str(error)) from None
    return channel, node


def client_handshake(sock: socket.socket, token: str, node: dict, timeout: float = 10) -> Channel:
    """Agent side: answer the session's challenge with a proof over our hello, and check the session's proof."""
    channel = Channel(sock)
    try:
        challenge = _expect(channel, timeout)
        if challenge.get("protocol") != PROTOCOL:
            raise HandshakeFailed(f"the other side speaks {challenge.get('protocol')!r}, not {PROTOCOL}")
        nonce = secrets.token_hex(16)
        theirs = str(challenge.get("nonce", ""))
        channel.send(protocol=PROTOCOL, nonce=nonce, node=node, proof=_mac(token, "agent", theirs, nonce, json.dumps(node, sort_keys=True)))
        answer = _expect(channel, timeout)
        if "error" in answer:
            raise HandshakeFailed(answer["error"])
        if not hmac.compare_digest(str(answer.get("proof", "")), _mac(token, "session", nonce, theirs)):
            raise HandshakeFailed("the session did not prove it holds the cluster token")
    except ChannelClosed as error:
        raise HandshakeFailed(str(error)) from None
    return channel
