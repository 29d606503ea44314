"""Optional shared-secret authentication of a connection, before any other message.

Control port (master) and data port (node), when the server has a secret::

    server -> client   b"KVPA" + nonce (32 random bytes)
    client -> server   HMAC-SHA256(secret, b"kvpool-auth-1" + nonce)   (32 bytes)

The server reads nothing else until the answer matches (:func:`hmac.compare_digest`);
a wrong or late answer (``timeout_s``) closes the connection. A fresh nonce per
connection means a recorded answer cannot be replayed. Admin HTTP servers take
``Authorization: Bearer <token>`` with ``token = HMAC-SHA256(secret, b"kvpool-http-1")``
in hex (:func:`http_token`), so the HTTP token, which travels in clear text, never
lets anyone answer a challenge. What this stops and what it does not (no encryption,
no server authentication): docs/store.md, "Authentication".

The secret: the servers' ``--secret`` option (flag, ``KVPOOL_SECRET``, config file);
clients and nodes connecting out take ``KVPOOL_SECRET`` (:func:`secret_from_env`)
unless given one. An empty secret means no authentication.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import socket
import time

from kvpool.errors import RpcFailed

CHALLENGE_MAGIC = b"KVPA"
NONCE_BYTES = 32
ANSWER_BYTES = 32
CHALLENGE_BYTES = len(CHALLENGE_MAGIC) + NONCE_BYTES
_CONTEXT = b"kvpool-auth-1"
_HTTP_CONTEXT = b"kvpool-http-1"
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)


def secret_bytes(secret: str | bytes | None) -> bytes | None:
    """The secret as bytes, or None for no authentication (None or empty)."""
    if not secret:
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def secret_from_env() -> bytes | None:
    """``KVPOOL_SECRET`` as bytes, None when unset or empty."""
    return secret_bytes(os.environ.get("KVPOOL_SECRET"))


def secret_or_env(secret: str | bytes | None) -> bytes | None:
    """An explicit ``secret`` (b"" or "": none), else (None) ``KVPOOL_SECRET``."""
    return secret_from_env() if secret is None else secret_bytes(secret)


def challenge() -> tuple[bytes, bytes]:
    """(the bytes a server sends first, the nonce to check the answer against)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return CHALLENGE_MAGIC + nonce, nonce


def answer(secret: bytes, nonce: bytes) -> bytes:
    """The client's 32-byte answer to ``nonce``."""
    return hmac.new(secret, _CONTEXT + nonce, hashlib.sha256).digest()


def verify(secret: bytes, nonce: bytes, reply: bytes) -> bool:
    """True when ``reply`` is the answer to ``nonce`` (constant-time comparison)."""
    return hmac.compare_digest(answer(secret, nonce), bytes(reply))


def http_token(secret: bytes) -> str:
    """The bearer token of the admin HTTP servers for ``secret`` (64 hex digits)."""
    return hmac.new(secret, _HTTP_CONTEXT, hashlib.sha256).hexdigest()


def _recv_exact(sock: socket.socket, n: int, deadline: float, peer: str) -> bytes:
    """``n`` bytes from a blocking socket (with or without a kernel timeout) by
    ``deadline``. Raises RpcFailed on EOF or past the deadline."""
    buf, got = bytearray(n), 0
    while got < n:
        try:
            k = sock.recv_into(memoryview(buf)[got:], n - got)
        except TimeoutError:
            k = -1
        except OSError as exc:
            if exc.errno not in _AGAIN:
                raise RpcFailed(f"{peer}: connection failed during authentication: {exc}") from None
            k = -1
        if k == 0:
            raise RpcFailed(f"{peer} closed the connection during authentication")
        got += max(k, 0)
        if got < n and time.monotonic() > deadline:
            raise RpcFailed(f"{peer} sent no authentication challenge in time: it is not "
                            "answering, runs without a secret (then unset KVPOOL_SECRET, or give "
                            "it the same --secret), or is not kvpool")
    return bytes(buf)


def asks_for_secret(exc: BaseException) -> bool:
    """True when ``exc`` (a FrameError) came from reading a challenge as a reply frame:
    the server wants a secret this client does not have."""
    return repr(CHALLENGE_MAGIC) in str(exc)


def client_handshake(sock: socket.socket, secret: bytes, timeout_s: float, peer: str) -> None:
    """Answer the server's challenge on a new connection. Raises RpcFailed when the
    server sends no challenge (it runs without a secret, or is not kvpool)."""
    head = _recv_exact(sock, CHALLENGE_BYTES, time.monotonic() + timeout_s, peer)
    if not head.startswith(CHALLENGE_MAGIC):
        raise RpcFailed(f"{peer} did not ask for authentication (is it run with the same secret?)")
    sock.sendall(answer(secret, head[len(CHALLENGE_MAGIC):]))
