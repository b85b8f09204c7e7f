"""A real HTTP reverse proxy in front of an S3 server that throttles like S3 does.

NetProxy (netproxy.py) breaks the network under a store: connections reset, black-holed,
answers lost. This one breaks nothing below HTTP: every request is read whole and either
forwarded to the real server (moto's or radosgw) with its headers and bytes unchanged (so
signatures still verify), its answer passed back, or, while a throttle window is on,
answered by the proxy itself with S3's own error response:

    503 <Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>...

(or any status and code: 429, 500 InternalError, 503 ServiceUnavailable), with an optional
Retry-After, and no body for a HEAD (S3 sends none: the client sees the status alone).
The connection stays open, as S3 keeps it. What the server never saw is counted, per
request kind (HEAD, GET, PUT, LIST, DELETE), with each request's arrival time, so a test
can tell that throttling happened and how fast the client kept asking while it did.

It can also limit request rates the way S3 does (limit()): S3 serves at least 3,500
PUT/COPY/POST/DELETE and 5,500 GET/HEAD requests per second per partitioned prefix, a
new bucket starts as one partition, and S3 splits a partition only after sustained load
(over minutes; the old partitions answer SlowDown meanwhile). Here each request kind is
a write (PUT, POST, DELETE) or a read (GET, HEAD, LIST); each partition has one token
bucket per class, holding `burst` seconds of its rate; a request finds its partition by
its object key (keys spread evenly: a content-addressed store's keys are hashes) and is
answered 503 SlowDown when its bucket is empty. With split_after= set, once some request
has been refused in each of split_after consecutive seconds, the partitions double (up
to max_partitions), as S3 scales a prefix that stays busy.

Standard library only: threads, http.server on the client side, http.client upstream.
"""

from __future__ import annotations

import collections
import hashlib
import http.client
import random
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

__all__ = ["RateLimits", "ThrottleProxy", "request_kind"]

# Hop-by-hop headers of the answer: the proxy frames what it sends back itself.
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "te", "trailer"}


def request_kind(method: str, path: str) -> str:
    """HEAD, GET, PUT, LIST (a ListObjects GET of a bucket), DELETE (DELETE, or a
    POST ?delete DeleteObjects), else the method."""
    parts = urlsplit(path)
    q = parse_qs(parts.query, keep_blank_values=True)
    if method == "GET" and ("list-type" in q or parts.path.strip("/").count("/") == 0):
        return "LIST"
    if method == "DELETE" or (method == "POST" and "delete" in q):
        return "DELETE"
    return method


def _error_body(code: str, message: str, resource: str, request_id: str) -> bytes:
    return ('<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message><Resource>{resource}</Resource>"
            f"<RequestId>{request_id}</RequestId><HostId>{request_id}</HostId></Error>").encode()


class _Throttle:
    def __init__(self, until: float, share: float, status: int, code: str, message: str,
                 retry_after: int | None, kinds: frozenset | None, seed: int):
        self.until, self.share, self.status, self.code, self.message = until, share, status, code, message
        self.retry_after, self.kinds = retry_after, kinds
        self.rng = random.Random(seed)


_WRITES = frozenset({"PUT", "POST", "DELETE"})


@dataclass(frozen=True)
class RateLimits:
    """S3's documented request rates per partitioned prefix (the defaults), and how a
    prefix that stays throttled is split. A scaled run divides the rates by its scale."""
    write_rate: float = 3500.0  # PUT/COPY/POST/DELETE per second per partition
    read_rate: float = 5500.0   # GET/HEAD (and LIST) per second per partition
    partitions: int = 1         # a new bucket is one partition
    split_after: float | None = None  # seconds of throttling in a row before the partitions double
    max_partitions: int = 1
    burst: float = 1.0          # seconds of its rate a partition's bucket holds

    def __post_init__(self):
        if not (self.write_rate > 0 and self.read_rate > 0 and self.burst > 0
                and 1 <= self.partitions <= self.max_partitions):
            raise ValueError(f"bad RateLimits: {self}")


class _Partitions:
    """The token buckets of RateLimits: tokens[p][cls], refilled by elapsed time."""

    def __init__(self, limits: RateLimits, now: float):
        self.limits, self.count = limits, limits.partitions
        self.rate = {"write": limits.write_rate, "read": limits.read_rate}
        self.tokens = [{c: r * limits.burst for c, r in self.rate.items()} for _ in range(self.count)]
        self.stamp = now
        self.busy_since: float | None = None  # start of the current run of throttled seconds
        self.last_refusal = -1.0
        self.splits: list[tuple[float, int]] = []  # (time, partitions after it)

    def take(self, key: str, cls: str, now: float) -> bool:
        """Whether a request of class `cls` for `key` may reach the server now."""
        dt, self.stamp = now - self.stamp, now
        for t in self.tokens:
            for c, r in self.rate.items():
                t[c] = min(r * self.limits.burst, t[c] + r * dt)
        p = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % self.count
        if self.tokens[p][cls] >= 1:
            self.tokens[p][cls] -= 1
            return True
        self._refused(now)
        return False

    def _refused(self, now: float) -> None:
        lim = self.limits
        if self.busy_since is None or now - self.last_refusal > 1.0:
            self.busy_since = now  # a second without a refusal ends the run
        self.last_refusal = now
        if (lim.split_after is not None and self.count < lim.max_partitions
                and now - self.busy_since >= lim.split_after):
            self.count = min(lim.max_partitions, 2 * self.count)
            full = {c: r * lim.burst for c, r in self.rate.items()}
            self.tokens = self.tokens + [dict(full) for _ in range(self.count - len(self.tokens))]
            self.busy_since = now
            self.splits.append((now, self.count))


class _Server(ThreadingHTTPServer):
    # socketserver's listen backlog is 5: hundreds of clients connecting at once lose
    # their SYNs and wait out TCP's retransmission (1, 3, 7, 15 s): silences that are the
    # proxy's, not the clients' back-off.
    request_queue_size = 4096


class ThrottleProxy:
    """http://127.0.0.1:<port> -> `endpoint` (an S3 server's http:// URL).

    throttle(seconds, share=, status=, code=, retry_after=, kinds=) starts a window in
    which that share of the requests (of those kinds; all by default) is answered with the
    error instead of reaching the server; throttle(0) ends it. Counters: refused (in all),
    refused_by / forwarded_by (per request kind); arrivals: (monotonic time, kind,
    refused) of every request, in order. limit(RateLimits(...)) limits the request rates
    per partition instead (see the module's docstring); limit(None) ends it."""

    def __init__(self, endpoint: str):
        ep = urlsplit(endpoint)
        if ep.scheme != "http":
            raise ValueError(f"ThrottleProxy forwards plain http only, not {endpoint!r}")
        self.host, self.upstream = ep.hostname or "127.0.0.1", ep.port or 80
        self.refused = 0
        self.refused_by: collections.Counter = collections.Counter()
        self.forwarded_by: collections.Counter = collections.Counter()
        self.arrivals: list[tuple[float, str, bool]] = []
        self._throttle: _Throttle | None = None
        self._limits: _Partitions | None = None
        self._slowdown = _Throttle(float("inf"), 1.0, 503, "SlowDown", "Please reduce your request rate.",
                                   None, None, 0)
        self._lock = threading.Lock()
        proxy = self

        class Handler(_Handler):
            owner = proxy
        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name="s3proxy")
        self._thread.start()

    # -- control ----------------------------------------------------------------------
    def throttle(self, seconds: float = float("inf"), *, share: float = 1.0, status: int = 503,
                 code: str = "SlowDown", message: str = "Please reduce your request rate.",
                 retry_after: int | None = None, kinds=None, seed: int = 0) -> None:
        """For `seconds` (0: end the window now), answer `share` of the requests of
        `kinds` (e.g. {"HEAD", "PUT"}; None: every kind) with `status` and S3 error
        `code` (and Retry-After: retry_after seconds where given). share < 1 picks the
        refused ones with a seeded generator."""
        with self._lock:
            self._throttle = None if seconds <= 0 else _Throttle(
                time.monotonic() + seconds, share, status, code, message, retry_after,
                None if kinds is None else frozenset(kinds), seed)

    def limit(self, limits: RateLimits | None) -> None:
        """Limit request rates per partition as S3 does (None: no limit)."""
        with self._lock:
            self._limits = None if limits is None else _Partitions(limits, time.monotonic())

    @property
    def splits(self) -> list[tuple[float, int]]:
        """(monotonic time, partitions after it) of every split the limit made."""
        with self._lock:
            return list(self._limits.splits) if self._limits is not None else []

    def throttling(self) -> bool:
        """Whether a throttle window is on."""
        with self._lock:
            return self._throttle is not None and time.monotonic() < self._throttle.until

    def reset_counts(self) -> None:
        with self._lock:
            self.refused = 0
            self.refused_by.clear()
            self.forwarded_by.clear()
            self.arrivals.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- for the handler ----------------------------------------------------------------
    def _decide(self, kind: str, path: str) -> _Throttle | None:
        """The throttle that refuses this request, or None (forward it); counts it."""
        with self._lock:
            t = self._throttle
            now = time.monotonic()
            hit = (t is not None and now < t.until and (t.kinds is None or kind in t.kinds)
                   and (t.share >= 1 or t.rng.random() < t.share))
            if not hit and self._limits is not None:
                cls = "write" if kind in _WRITES else "read"
                if not self._limits.take(urlsplit(path).path, cls, now):
                    t, hit = self._slowdown, True
            self.arrivals.append((now, kind, hit))
            if hit:
                self.refused += 1
                self.refused_by[kind] += 1
                return t
            self.forwarded_by[kind] += 1
            return None


class _Handler(BaseHTTPRequestHandler):
    owner: ThrottleProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 and the clients use it
    _up: http.client.HTTPConnection | None = None

    def log_message(self, *args) -> None:  # quiet: tests read the counters
        pass

    def _body(self) -> bytes:
        """The request's body, raw: Content-Length bytes, or the chunks as sent."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = bytearray()
            while True:
                line = self.rfile.readline(65537)
                out += line
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers, up to the empty line
                        t = self.rfile.readline(65537)
                        out += t
                        if t in (b"\r\n", b"\n", b""):
                            return bytes(out)
                out += self.rfile.read(size + 2)
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _handle(self) -> None:
        body = self._body()
        kind = request_kind(self.command, self.path)
        t = self.owner._decide(kind, self.path)
        if t is not None:
            self._refuse(t)
            return
        try:
            status, reason, headers, data = self._forward(body)
        except (OSError, http.client.HTTPException):
            self.close_connection = True  # the server went away: so does this connection
            return
        self.send_response_only(status, reason)
        for k, v in headers:
            if k.lower() not in _HOP and not (k.lower() == "content-length" and self.command != "HEAD"):
                self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _forward(self, body: bytes):
        while True:
            fresh = self._up is None
            if fresh:
                self._up = http.client.HTTPConnection(self.owner.host, self.owner.upstream, timeout=120)
            up = self._up
            try:
                up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in ("expect", "connection", "proxy-connection", "keep-alive"):
                        up.putheader(k, v)  # Host included, as signed
                up.endheaders(body if body else None)
                r = up.getresponse()
                data = r.read()
                if r.will_close:
                    up.close()
                    self._up = None
                return r.status, r.reason, r.getheaders(), data
            except (OSError, http.client.HTTPException):
                up.close()
                self._up = None
                if fresh:  # a kept connection the server had closed meanwhile is tried once anew
                    raise

    def _refuse(self, t: _Throttle) -> None:
        rid = uuid.uuid4().hex[:16].upper()
        data = b"" if self.command == "HEAD" else _error_body(t.code, t.message, urlsplit(self.path).path, rid)
        self.send_response_only(t.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("x-amz-request-id", rid)
        self.send_header("Server", "AmazonS3")
        self.send_header("Date", self.date_time_string())
        if t.retry_after is not None:
            self.send_header("Retry-After", str(t.retry_after))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if data:
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    def finish(self) -> None:
        super().finish()
        if self._up is not None:
            self._up.close()
            self._up = None
