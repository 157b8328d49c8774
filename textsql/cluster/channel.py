"""The control connection between the session and a node agent: JSON lines over TCP, opened by a mutual proof of
the cluster token (HMAC-SHA256 over fresh nonces of both sides; the token itself never crosses the network), after
which every message carries an HMAC under a key of that connection and direction over its sequence number, so a
message injected, replayed, reordered, dropped or altered on the way ends the connection."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import select
import socket
import threading
import time

PROTOCOL = "textsql-cluster/2"
MAX_LINE = 64 * 2**20  # one message of an authenticated peer
MAX_HELLO = 64 * 2**10  # one message before authentication: a challenge or a hello (a node's facts) is a few KiB
HANDSHAKE_SECONDS = 10  # the whole handshake, however the other side paces its bytes
SILENCE_SECONDS = 40  # both sides send a heartbeat several times within this; a side silent this long is gone
SILENCE_ENV = "TEXTSQL_CLUSTER_SILENCE"  # the session's bound, passed to its agents so that both sides use one
NONCE = re.compile(r"[0-9a-f]{32}")
MAC = re.compile(r"[0-9a-f]{64}")


class ChannelClosed(Exception):
    """The other side closed the connection, or it broke, or sent something that is not a message of this channel."""


class HandshakeFailed(Exception):
    """The other side does not hold this cluster's token, or does not speak the protocol."""


class HandshakeDropped(HandshakeFailed):
    """The connection ended or stalled during the handshake without a refusal (a session busy with other handshakes
    drops the oldest): worth another try."""


class Channel:
    """Messages (dicts) in both directions; `send` may be called from several threads. Until `authenticate`, lines
    are plain JSON of at most MAX_HELLO bytes; after it, `<hex HMAC> <JSON>` with per-direction keys and sequence
    numbers."""

    def __init__(self, sock: socket.socket, max_line: int = MAX_HELLO):
        self.sock = sock
        self.max_line = max_line
        self._buffer = bytearray()
        self._send_lock = threading.Lock()
        self._send_key: bytes | None = None
        self._receive_key: bytes | None = None
        self._sent = self._received = 0

    def authenticate(self, send_key: bytes, receive_key: bytes) -> None:
        """From now on every message is signed and checked (the handshake derived the keys)."""
        with self._send_lock:
            self._send_key, self._receive_key, self.max_line = send_key, receive_key, MAX_LINE

    def send(self, **message) -> None:
        body = json.dumps(message, separators=(",", ":")).encode()
        with self._send_lock:
            if self._send_key is not None:
                body = _frame_mac(self._send_key, self._sent, body) + b" " + body
                self._sent += 1
            try:
                self.sock.sendall(body + b"\n")
            except OSError as error:
                raise ChannelClosed(str(error)) from None

    def receive(self, timeout: float | None = None, deadline: float | None = None) -> dict | None:
        """The next message; None when none came within `timeout` seconds (or by the monotonic `deadline`, even while
        bytes keep arriving). Raises ChannelClosed at the end, or for anything that is not a message."""
        if timeout is not None:
            deadline = time.monotonic() + timeout if deadline is None else min(deadline, time.monotonic() + timeout)
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                if end > self.max_line:
                    raise ChannelClosed("message too long")
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return self._open(line)
            if len(self._buffer) > self.max_line:
                raise ChannelClosed("message too long")
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                return None
            try:
                ready, _, _ = select.select([self.sock], [], [], wait)
            except (OSError, ValueError) as error:
                raise ChannelClosed(str(error)) from None
            if not ready:
                return None
            try:
                chunk = self.sock.recv(min(1 << 16, self.max_line + 2 - len(self._buffer)))
            except OSError as error:
                raise ChannelClosed(str(error)) from None
            if not chunk:
                raise ChannelClosed("connection closed")
            self._buffer += chunk

    def _open(self, line: bytes) -> dict:
        if self._receive_key is not None:
            mac, _, line = line.partition(b" ")
            if not hmac.compare_digest(mac, _frame_mac(self._receive_key, self._received, line)):
                raise ChannelClosed(
                    "a message failed authentication (injected, replayed, reordered or altered on the way)"
                )
            self._received += 1
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            raise ChannelClosed("garbled message") from None
        if not isinstance(message, dict):
            raise ChannelClosed("garbled message (not an object)")
        return message

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def heartbeat_seconds(silence: float) -> float:
    """How often a side sends a heartbeat when `silence` seconds without one mean it is gone."""
    return min(5.0, silence / 4)


def _mac(token: str, *parts: str) -> str:
    return hmac.new(token.encode(), "\x00".join(parts).encode(), hashlib.sha256).hexdigest()


def _frame_mac(key: bytes, number: int, body: bytes) -> bytes:
    return hmac.new(key, number.to_bytes(8, "big") + body, hashlib.sha256).hexdigest().encode()


def _keys(token: str, session_nonce: str, agent_nonce: str) -> tuple[bytes, bytes]:
    """(the session's sending key, the agent's sending key) of one connection: both nonces are fresh, so a message
    of another connection, or of the other direction, never verifies."""
    return tuple(
        bytes.fromhex(_mac(token, PROTOCOL, "key", sender, session_nonce, agent_nonce))
        for sender in ("session", "agent")
    )


def _field(message: dict, name: str, pattern: re.Pattern) -> str | None:
    value = message.get(name)
    return value if isinstance(value, str) and pattern.fullmatch(value) else None


def _expect(channel: Channel, deadline: float) -> dict:
    message = channel.receive(deadline=deadline)
    if message is None:
        raise HandshakeDropped("no answer in time")
    return message


def server_handshake(sock: socket.socket, token: str, timeout: float = HANDSHAKE_SECONDS) -> tuple[Channel, dict]:
    """Session side: challenge the agent, check its proof, prove ourselves. Returns the channel (authenticated from
    here on) and the agent's hello. Raises HandshakeFailed for anything else, within `timeout` seconds in all."""
    deadline = time.monotonic() + timeout
    channel = Channel(sock)
    nonce = secrets.token_hex(16)
    try:
        sock.settimeout(timeout)  # a peer that reads nothing cannot hold a send either
        channel.send(protocol=PROTOCOL, nonce=nonce)
        hello = _expect(channel, deadline)
        node, theirs, proof = hello.get("node"), _field(hello, "nonce", NONCE), _field(hello, "proof", MAC)
        if (
            hello.get("protocol") != PROTOCOL
            or not isinstance(node, dict)
            or not isinstance(node.get("address"), str)
            or theirs is None
            or proof is None
        ):
            raise HandshakeFailed("malformed hello")
        if not hmac.compare_digest(proof, _mac(token, "agent", nonce, theirs, json.dumps(node, sort_keys=True))):
            channel.send(error="not a node of this cluster (wrong token): stop")
            raise HandshakeFailed("wrong token")
        channel.send(proof=_mac(token, "session", theirs, nonce))
        sock.settimeout(None)
    except ChannelClosed as error:
        raise HandshakeFailed(str(error)) from None
    except OSError as error:  # the send timed out or the connection broke
        raise HandshakeFailed(f"connection broke ({error})") from None
    except (ValueError, TypeError, RecursionError) as error:  # a node that JSON cannot write back as it came
        raise HandshakeFailed(f"malformed hello ({type(error).__name__})") from None
    session_key, agent_key = _keys(token, nonce, theirs)
    channel.authenticate(session_key, agent_key)
    return channel, node


def client_handshake(sock: socket.socket, token: str, node: dict, timeout: float = HANDSHAKE_SECONDS) -> Channel:
    """Agent side: answer the session's challenge with a proof over our hello, and check the session's proof.
    Raises HandshakeDropped when the connection ends or stalls without a refusal (try again), HandshakeFailed when
    the other side refuses us or does not prove it holds the token."""
    deadline = time.monotonic() + timeout
    channel = Channel(sock)
    try:
        challenge = _expect(channel, deadline)
        if challenge.get("protocol") != PROTOCOL:
            raise HandshakeFailed(f"the other side speaks {str(challenge.get('protocol'))[:40]!r}, not {PROTOCOL}")
        theirs = _field(challenge, "nonce", NONCE)
        if theirs is None:
            raise HandshakeFailed("the other side sent a malformed challenge")
        nonce = secrets.token_hex(16)
        channel.send(
            protocol=PROTOCOL,
            nonce=nonce,
            node=node,
            proof=_mac(token, "agent", theirs, nonce, json.dumps(node, sort_keys=True)),
        )
        answer = _expect(channel, deadline)
        if "error" in answer:
            raise HandshakeFailed(str(answer["error"])[:200])
        proof = _field(answer, "proof", MAC)
        if proof is None or not hmac.compare_digest(proof, _mac(token, "session", nonce, theirs)):
            raise HandshakeFailed("the session did not prove it holds the cluster token")
    except ChannelClosed as error:
        raise HandshakeDropped(str(error)) from None
    session_key, agent_key = _keys(token, theirs, nonce)
    channel.authenticate(agent_key, session_key)
    return channel
