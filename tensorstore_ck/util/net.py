"""The address other ranks reach this process at (the peer servers' side channel)."""

from __future__ import annotations

import os
import socket

__all__ = ["local_host", "recv_exact"]


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


def recv_exact(sock, n: int) -> bytearray:
    """Exactly n bytes from `sock` (the caller has bounded n before this allocation);
    ConnectionError if the peer closes first."""
    buf = bytearray(n)
    mv, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(mv[got:], min(n - got, 1 << 22))
        if not k:
            raise ConnectionError("the peer closed the connection")
        got += k
    return buf
