"""The sockets between the hosts of a multi-host run (backends/jax/distributed.py), open only
to the hosts that hold the operator's key.

The key comes from the operator, never from the hosts' coordinator: JAXSERVE_HOST_LINK_KEY
(the key itself) or JAXSERVE_HOST_LINK_KEY_FILE (a file holding it, e.g. a mounted
Kubernetes Secret), the same on every host, at least MIN_KEY_BYTES long (link_key). A
connection is authenticated both ways before anything else crosses it: the listener sends a
random challenge, the connecting host answers with an HMAC-SHA256 of it under the key and a
challenge of its own, which the listener answers in turn; then the connecting host names
the connection's purpose (a short string). Only then does the connection carry messages,
and those are plain data (backends/wire.py), never pickles. The key authenticates hosts;
it does not encrypt: keep the links on the cluster's own network.

The listener binds the one address it advertises to the other hosts, not every interface.
Each connection it accepts is authenticated on a thread of its own with a deadline
(HANDSHAKE_TIMEOUT_S), so a stray connection (a wrong key, none, garbage, or silence) is
logged and dropped without delaying the hosts' own, and without stopping the listener.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
from multiprocessing.connection import Connection

from jaxserve.backends.wire import Codec, WireError

logger = logging.getLogger(__name__)

KEY_ENV = "JAXSERVE_HOST_LINK_KEY"
KEY_FILE_ENV = "JAXSERVE_HOST_LINK_KEY_FILE"
MIN_KEY_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0  # how long the listener waits for a connecting peer's answers
CONNECT_TIMEOUT_S = 60.0  # how long a connecting host waits for the listener's
MAX_PENDING = 32  # connections being authenticated at once (more are refused)

_MAGIC = b"jaxserve-host-link/1\n"
_NONCE = 32
_MAC = hashlib.sha256().digest_size
_MAX_PURPOSE = 256


class LinkAuthenticationError(ConnectionError):
    """A peer that does not hold the key (or does not speak the host-link handshake)."""


def link_key(environ=None) -> bytes:
    """The operator's host-link key: JAXSERVE_HOST_LINK_KEY, or the contents of the file
    JAXSERVE_HOST_LINK_KEY_FILE names (surrounding whitespace dropped). ValueError, saying
    what to set, when neither is set, both are, or the key is short."""
    environ = os.environ if environ is None else environ
    value, path = environ.get(KEY_ENV), environ.get(KEY_FILE_ENV)
    hint = (f"Generate one (e.g. `openssl rand -hex 32`), give every host the same one as "
            f"{KEY_ENV}=KEY or as a file named by {KEY_FILE_ENV}=PATH (e.g. a mounted "
            "Kubernetes Secret); docs/deployment.md, \"Security\".")
    if value and path:
        raise ValueError(f"Multi-host: both {KEY_ENV} and {KEY_FILE_ENV} are set; set one.")
    if path:
        try:
            with open(path, "rb") as f:
                key = f.read().strip()
        except OSError as err:
            raise ValueError(f"Multi-host: {KEY_FILE_ENV}={path!r:.200} cannot be read "
                             f"({err.strerror or err}). {hint}") from None
        where = f"the file {KEY_FILE_ENV} names"
    elif value:
        key, where = value.strip().encode(), KEY_ENV
    else:
        raise ValueError("Multi-host serving needs a key that authenticates the hosts to "
                         f"each other, and none is set. {hint}")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"Multi-host: the host-link key in {where} is {len(key)} bytes; it "
                         f"must be at least {MIN_KEY_BYTES}. {hint}")
    return key


class Link:
    """One authenticated connection between two hosts: messages of plain data, encoded by
    a Codec (send, recv), or sent pre-encoded (send_encoded: one encoding for many peers)."""

    def __init__(self, connection: Connection, codec: Codec, peer: str = "") -> None:
        self._connection, self.codec, self.peer = connection, codec, peer

    def send(self, message) -> None:
        self._connection.send_bytes(self.codec.encode(message))

    def send_encoded(self, data: bytes) -> None:
        self._connection.send_bytes(data)

    def recv(self):
        """The next message. A message the codec refuses breaks the link: logged, the
        connection closed, and ConnectionError (an OSError) raised, as for a lost peer."""
        data = self._connection.recv_bytes()
        try:
            return self.codec.decode(data)
        except WireError as err:
            logger.error("Host link %s: %s; closing it", self.peer, err)
            self.close()
            raise ConnectionError(f"host link {self.peer}: {err}") from None

    def poll(self, timeout: float = 0.0) -> bool:
        return self._connection.poll(timeout)

    def fileno(self) -> int:
        return self._connection.fileno()

    def close(self) -> None:
        self._connection.close()


class LinkListener:
    """This host's listening socket, on `ip` (the address the other hosts are told), and
    the connections that authenticated on it, by purpose, until accept() takes them."""

    def __init__(self, ip: str, key: bytes, port: int = 0) -> None:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        self._socket = socket.create_server((ip, port), family=family, backlog=64)
        self.address: tuple[str, int] = (ip, self._socket.getsockname()[1])
        self._key = key
        self._ready: dict[str, tuple[Connection, str]] = {}
        self._changed = threading.Condition()
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="jaxserve-host-links",
                                        daemon=True)
        self._thread.start()

    def accept(self, purpose: str, timeout: float | None = None) -> Connection:
        """The connection that names `purpose` (waiting for it; TimeoutError after
        `timeout` seconds when given)."""
        with self._changed:
            if not self._changed.wait_for(lambda: purpose in self._ready or self._closed,
                                          timeout):
                raise TimeoutError(f"no host connected for {purpose!r} within {timeout} s")
            if purpose not in self._ready:
                raise OSError("the host-link listener is closed")
            return self._ready.pop(purpose)[0]

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            waiting, self._ready = self._ready, {}
        self._socket.close()
        for connection, _ in waiting.values():
            connection.close()

    def _serve(self) -> None:
        while True:
            try:
                sock, peer = self._socket.accept()
            except OSError:
                if self._closed:
                    return
                logger.warning("Host link listener: accept failed", exc_info=True)
                continue
            where = _peer_name(peer)
            if not self._pending.acquire(blocking=False):
                logger.warning("Host link: refused a connection from %s (%d others are "
                               "authenticating)", where, MAX_PENDING)
                sock.close()
                continue
            threading.Thread(target=self._authenticate, args=(sock, where), daemon=True,
                             name="jaxserve-host-link-auth").start()

    def _authenticate(self, sock: socket.socket, where: str) -> None:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            _answer_as_listener(sock, self._key)
            (size,) = struct.unpack("!H", _read_exact(sock, 2))
            if not 0 < size <= _MAX_PURPOSE:
                raise LinkAuthenticationError(f"a purpose of {size} bytes")
            purpose = _read_exact(sock, size).decode()
            sock.settimeout(None)
        except (OSError, EOFError, UnicodeDecodeError) as err:
            sock.close()
            self._pending.release()
            logger.warning("Host link: dropped a connection from %s: %s", where,
                           _why(err))
            return
        self._pending.release()
        connection = Connection(sock.detach())
        with self._changed:
            if self._closed or purpose in self._ready:
                duplicate = not self._closed
            else:
                self._ready[purpose] = (connection, where)
                self._changed.notify_all()
                duplicate = None
        if duplicate is not None:
            connection.close()
            if duplicate:
                logger.warning("Host link: dropped a second connection for %r from %s",
                               purpose, where)
        else:
            logger.debug("Host link: %s connected for %r", where, purpose)


def connect(address: tuple[str, int], key: bytes, purpose: str,
            timeout: float = CONNECT_TIMEOUT_S) -> Connection:
    """A connection to the listener at `address`, authenticated both ways and named
    `purpose`. LinkAuthenticationError when the listener does not hold the key."""
    encoded = purpose.encode()
    if not 0 < len(encoded) <= _MAX_PURPOSE:
        raise ValueError(f"a host link's purpose is 1 to {_MAX_PURPOSE} bytes: {purpose!r}")
    sock = socket.create_connection(address, timeout=timeout)
    try:
        _answer_as_connector(sock, key)
        sock.sendall(struct.pack("!H", len(encoded)) + encoded)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return Connection(sock.detach())


# ---- the handshake ------------------------------------------------------------------------

def _mac(key: bytes, role: bytes, *nonces: bytes) -> bytes:
    return hmac.new(key, b"".join((_MAGIC, role, *nonces)), hashlib.sha256).digest()


def _answer_as_listener(sock: socket.socket, key: bytes) -> None:
    challenge = secrets.token_bytes(_NONCE)
    sock.sendall(_MAGIC + challenge)
    answer = _read_exact(sock, _MAC + _NONCE)
    theirs = answer[_MAC:]
    if not hmac.compare_digest(answer[:_MAC], _mac(key, b"connector", challenge, theirs)):
        raise LinkAuthenticationError("it does not hold the host-link key")
    sock.sendall(_mac(key, b"listener", theirs, challenge))


def _answer_as_connector(sock: socket.socket, key: bytes) -> None:
    hello = _read_exact(sock, len(_MAGIC) + _NONCE)
    if not hello.startswith(_MAGIC):
        raise LinkAuthenticationError("the peer is not a jaxserve host-link listener")
    challenge, mine = hello[len(_MAGIC):], secrets.token_bytes(_NONCE)
    sock.sendall(_mac(key, b"connector", challenge, mine) + mine)
    if not hmac.compare_digest(_read_exact(sock, _MAC), _mac(key, b"listener", mine,
                                                              challenge)):
        raise LinkAuthenticationError("the listener does not hold the host-link key (the "
                                      "hosts were given different keys?)")


def _read_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the peer closed the connection")
        data += chunk
    return data


def _peer_name(peer) -> str:
    return f"[{peer[0]}]:{peer[1]}" if ":" in str(peer[0]) else f"{peer[0]}:{peer[1]}"


def _why(err: BaseException) -> str:
    if isinstance(err, socket.timeout):
        return f"it sent nothing within {HANDSHAKE_TIMEOUT_S:g} s"
    if isinstance(err, EOFError):
        return "it closed the connection during the handshake"
    if isinstance(err, LinkAuthenticationError):
        return str(err)
    return f"{type(err).__name__}: {err}"
