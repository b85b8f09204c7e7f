"""The side channels' common ground (peer replicas, shared reads): the address other
ranks reach this process at, exact reads from a socket, and the proof that a connection
comes from a process of the job.

Trust: a side channel's server answers only a connection that proves, first thing, that it
holds the job's secret: the server sends 16 random bytes, the client answers their
HMAC-SHA256 under the secret. The secret is made by the first process of the job to ask
and kept in the process group's c10d Store (every rank of the job reaches it; nothing else
should: the c10d Store is the job's own). A server listens only on the address it
announces to the ranks, never on every interface. What a peer sends is still untrusted
input: every copy is checked against its address before use."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import threading

__all__ = ["local_host", "recv_exact", "recv_into", "listen_on", "serve", "close_all", "job_secret", "prove", "proven",
           "peer_name", "SECRET_KEY", "HANDSHAKE_TIMEOUT"]

SECRET_KEY = "tsck/secret"  # the job's secret, in the c10d Store
HANDSHAKE_TIMEOUT = 10.0  # seconds a server has to send its challenge (one that accepts and says nothing is away)
_NONCE = 16
_MAC = 32
_CONTEXT = b"tsck side channel v1 "


def local_host(kv) -> str:
    """The address the other ranks reach this one at: TSCK_PEER_HOST, else that of the
    interface that reaches the c10d Store's host (every rank reaches it), else the host name's."""
    host = os.environ.get("TSCK_PEER_HOST")
    if host:
        return host
    store = kv
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    target = getattr(store, "host", None)
    if target:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))  # (no packet is sent: it picks the route)
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def listen_on(kv, backlog: int = 128):
    """A listening socket on the address the other ranks reach this process at (not
    every interface) -> (it, "host:port" to announce)."""
    host = local_host(kv)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise OSError(f"this process cannot listen on {host}, the address the other ranks would reach it at "
                      "(TSCK_PEER_HOST names another)") from None
    sock.listen(backlog)
    return sock, f"{host}:{sock.getsockname()[1]}"


def serve(sock, secret: bytes, answer, *, name: str, timeout: float, on_stranger) -> None:
    """A side channel's server on the listening `sock`, on a thread of its own: each
    connection on a thread of its own, asked first to prove it holds `secret` (one that
    does not: on_stranger(its address), then closed, no request read); then answer(conn),
    the connection closed after. The loop ends when `sock` is closed."""
    def one(conn) -> None:
        conn.settimeout(timeout)
        try:
            if not proven(conn, secret):
                on_stranger(peer_name(conn))
                return
            answer(conn)
        finally:
            conn.close()

    def loop() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=one, args=(conn,), name=name, daemon=True).start()
    threading.Thread(target=loop, name=name + "-server", daemon=True).start()


def close_all(sock, idle: dict) -> None:
    """A side channel's end: the connections kept idle for reuse ({peer: [conn]}) closed,
    then its listening socket (None: it never listened)."""
    for conns in idle.values():
        for c in conns:
            c.close()
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass


def job_secret(kv) -> bytes:
    """The job's secret for its side channels: made by the first process to ask (one
    atomic compare_set in the c10d Store), the same for every process of the job."""
    return bytes(kv.compare_set(SECRET_KEY, "", secrets.token_hex(32)))


def _mac(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, _CONTEXT + bytes(nonce), hashlib.sha256).digest()


def prove(sock, secret: bytes) -> None:
    """The client's side: answer the server's challenge (OSError if it hangs up or says
    nothing for HANDSHAKE_TIMEOUT)."""
    before = sock.gettimeout()
    sock.settimeout(HANDSHAKE_TIMEOUT if before is None else min(before, HANDSHAKE_TIMEOUT))
    try:
        nonce = recv_exact(sock, _NONCE)
    finally:
        sock.settimeout(before)
    sock.sendall(_mac(secret, nonce))


def proven(sock, secret: bytes) -> bool:
    """The server's side: whether the connection proved it holds the job's secret."""
    nonce = secrets.token_bytes(_NONCE)
    sock.sendall(nonce)
    try:
        answer = bytes(recv_exact(sock, _MAC))
    except (ConnectionError, OSError):
        return False
    return hmac.compare_digest(answer, _mac(secret, nonce))


def peer_name(conn) -> str:
    """"host:port" of a connection's other end, for a log line."""
    try:
        return "%s:%d" % conn.getpeername()[:2]
    except OSError:
        return "?"


def recv_exact(sock, n: int) -> bytearray:
    """Exactly n bytes from `sock` (the caller has bounded n before this allocation);
    ConnectionError if the peer closes first."""
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return buf


def recv_into(sock, mv: memoryview) -> None:
    """Fill memoryview `mv` (bytes) from `sock`: a caller's buffer, reused (a fresh one
    of many MiB is a page fault per 4 KiB); ConnectionError if the peer closes first."""
    got, n = 0, mv.nbytes
    while got < n:
        k = sock.recv_into(mv[got:], min(n - got, 1 << 22))
        if not k:
            raise ConnectionError("the peer closed the connection")
        got += k
