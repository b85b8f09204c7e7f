"""S3BlockStore: the S3 request model and S3's error classification (through s3fs).

One request per object and direction:
- put-if-absent is one conditional PUT (If-None-Match: *, s3fs's mode="create"),
  both the existence check and the write; a 412 means "already there" however
  the server labels it (Ceph's radosgw does not say PreconditionFailed the way
  s3fs expects);
- a read is one GET (s3fs's cat_file would HEAD first to size ranged reads,
  useless for objects of one block);
- exists is one HEAD (s3fs's exists() also lists the key as a "directory");
- deletes are DeleteObjects requests of up to 1000 keys, per-key errors checked;
- a listing is a stream of ListObjectsV2 pages of up to 1000 keys, each asked for
  with StartAfter = the last key of the page before: one page is held at a time
  (s3fs's find() would hold every key of the bucket), and a retried page resumes
  exactly where the listing stood (RetryingStore retries page by page).

Retries live in one layer, RetryingStore: botocore's and s3fs's own loops are
switched off (the three multiplied: a hung server held one request for
minutes), and explicit connect/read timeouts turn a hung connection into a
retryable error. RetryingStore retries by time (retry.py: a budget, 60 s by
default), which is what rides out an outage; botocore's loop retries by count.
botocore's "adaptive" retry mode's rate limiter is used for what only it does: a
client-side limiter shared by every request of the client, which slows the whole
client's send rate (CUBIC) once S3 throttles and raises it again as answers come
back; the hand-written loop can only delay the one request that was throttled
while the other workers keep sending. botocore tells throttling by the parsed error
code alone (SlowDown, Throttling, ...), and a throttled HEAD has no body: its code
is "503", so under botocore's own adaptive mode the HEADs a new process's put
starts with were never slowed (tests/storage/test_s3_throttle.py saw over a hundred in four
seconds from 16 threads). The client is therefore built in "standard" mode and
given the same limiter (aiobotocore's) with a detector that also counts any 429 or
503 (_add_rate_limiter). botocore's total_max_attempts is 1, so the loops never
multiply. A 429 Too Many Requests (S3-compatible servers and gateways send it
instead of SlowDown) is transient like a 503. Transport errors that are not OSErrors (botocore's
EndpointConnectionError, ReadTimeoutError, aiohttp's) become ConnectionError /
TimeoutError here, so callers only ever see OSError (StorageError above); the client's
other refusals (NoCredentialsError and its kin as PermissionError, a bad parameter,
no region) become OSErrors marked not transient: they fail at once, naming the
cause. An OSError carrying an S3 response is marked `transient` (5xx, 408, 429,
throttling) or not (other 4xx: a 403 on one object, NoSuchBucket) for RetryingStore
(retry.py's is_transient, the one rule).
"""

from __future__ import annotations

import errno
import logging
import threading
from typing import Iterator, Sequence

from .base import Deadline, ObjectInfo, check_deadline, paged_list
from .fsspec import FsspecBlockStore, translated

__all__ = ["S3BlockStore"]

_TRANSPORT_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3")

log = logging.getLogger(__name__)


# What says "too many requests, slow down" rather than a fault: S3's SlowDown (503), and
# 429 Too Many Requests, which S3-compatible servers and gateways send instead (a throttled
# HEAD has no body, so its status is all there is to go by).
_SLOW_DOWN = ("SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "TooManyRequestsException",
              "RequestLimitExceeded")
_THROTTLED_STATUS = (429, 503)
# Error codes worth a retry although their status is 4xx.
_THROTTLING = _SLOW_DOWN + ("RequestTimeout", "RequestTimeTooSkewed")


# botocore's names for credentials it has not got or cannot use (NoCredentialsError,
# PartialCredentialsError, CredentialRetrievalError, TokenRetrievalError, SSO and login
# token errors): permanent, as PermissionError.
_CREDENTIAL_WORDS = ("Credential", "Token", "SSO", "Login")


def _transport_failure(e: BaseException) -> bool:
    """A failure of the connection or of the answer's transfer (what botocore's retry
    modes retry: its ConnectionError and HTTPClientError families, a read cut short;
    aiohttp's connection, payload and timeout errors; urllib3's by name)."""
    try:
        from botocore import exceptions as bx
        if isinstance(e, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError)):
            return True
        if isinstance(e, bx.BotoCoreError):
            return False
    except ImportError:
        pass
    try:
        import aiohttp
        if isinstance(e, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)):
            return True
    except ImportError:
        pass
    name = type(e).__name__
    return any(w in name for w in ("Timeout", "Connection", "ServerDisconnected", "Protocol", "ClientPayloadError"))


def _response(e: BaseException) -> dict | None:
    """The S3 response behind an error s3fs raised (botocore's ClientError.response), if any."""
    resp = getattr(e.__cause__ or e.__context__, "response", None)
    return resp if isinstance(resp, dict) else None


def _is_precondition_failed(e: BaseException) -> bool:
    """A conditional PUT refused because the key exists (HTTP 412), however the client reports it."""
    if isinstance(e, FileExistsError):
        return True
    resp = _response(e)
    if resp is not None:
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = resp.get("Error", {}).get("Code")
        return status == 412 or code == "PreconditionFailed"
    return False


class _ThrottlingDetector:
    """botocore's throttling detector (error codes: SlowDown, Throttling, ...), and any
    429 or 503 whatever its code. botocore goes by the parsed error code alone, and a
    throttled HEAD has no body to parse: its code is "503", which botocore's adaptive
    mode does not count, so a put that starts by HEADing its blocks (every new process)
    was never slowed down however much S3 throttled it."""

    def __init__(self):
        from botocore.retries import standard
        self._codes = standard.ThrottlingErrorDetector(retry_event_adapter=standard.RetryEventAdapter())

    def is_throttling_error(self, **kwargs) -> bool:
        resp = kwargs.get("response")
        status = getattr(resp[0], "status_code", None) if isinstance(resp, tuple) and resp else None
        return status in _THROTTLED_STATUS or self._codes.is_throttling_error(**kwargs)


def _add_rate_limiter(client) -> None:
    """botocore's adaptive retry mode's client-side rate limiter (aiobotocore's async
    one; what retries={"mode": "adaptive"} registers) on `client`, with _ThrottlingDetector:
    once S3 throttles, every request of the client waits for a token. Its rate is
    aimd.AimdRate's, not botocore's CUBIC (which a steady share of SlowDown drove to its
    floor: see aimd.py)."""
    from aiobotocore.retries import adaptive, bucket
    from botocore.retries.adaptive import RateClocker

    from .aimd import AimdRate
    clock = bucket.Clock()
    limiter = adaptive.AsyncClientRateLimiter(
        rate_adjustor=AimdRate(clock.current_time()), rate_clocker=RateClocker(clock),
        token_bucket=bucket.AsyncTokenBucket(max_rate=1, clock=clock, min_rate=AimdRate.FLOOR),
        throttling_detector=_ThrottlingDetector(), clock=clock)
    client.meta.events.register("before-send", limiter.on_sending_request)
    client.meta.events.register("needs-retry", limiter.on_receiving_response)
    return limiter


_ONE_GET = [True]  # whether this process's s3fs takes cat_file(max_concurrency=)


class S3BlockStore(FsspecBlockStore):
    """s3:// (and s3a://) through s3fs."""

    pages = True
    PAGE_KEYS = 1000  # S3's largest page

    def __init__(self, url: str, storage_options: dict | None = None):
        self._limiter_lock = threading.Lock()
        super().__init__(url, storage_options)

    def _after_fork(self) -> None:
        self._limiter_lock = threading.Lock()  # a thread of the parent may have held it
        super()._after_fork()

    # The filesystem (FsspecBlockStore sets it, again after a fork): one attempt per call,
    # and its client gets the rate limiter at the first use, not when it is set: in a
    # forked child that may be before fsspec's own at-fork reset (its event loop is the
    # parent's until then), and a child that never uses the store must not pay for it.
    @property
    def fs(self):
        if self._limiter_due:
            with self._limiter_lock:
                if self._limiter_due:
                    self._limiter_due = False
                    try:
                        self._fs.connect()  # the client (no request is sent), to give it the limiter
                        _add_rate_limiter(self._fs.s3)
                    except Exception as e:  # noqa: BLE001 - the request itself meets it again, translated
                        log.warning("S3 storage %s: no client yet (%s: %s); it runs without a rate limiter "
                                    "on throttling", self.url, type(e).__name__, e)
        return self._fs

    @fs.setter
    def fs(self, fs) -> None:
        fs.retries = 1  # s3fs's own retry loop (a class attribute, 5): see the module docstring
        self._fs = fs
        self._limiter_due = self._rate_limited

    def close(self) -> None:
        """Close the S3 client (its HTTP session and connections) on the filesystem's
        event loop, now: a request still in flight (a tier's uploader left in one when
        the remote answers nothing) fails at once, instead of holding the process's exit
        for its read timeout, and the session is not left to s3fs's finalizer at
        interpreter exit (a 0.1 s close, then its connector torn down under whatever
        asyncio still runs there)."""
        fs = getattr(self, "_fs", None)
        client = getattr(fs, "_s3creator", None)
        if client is None:  # never connected: no session
            return
        if self._fs_args is not None and not self._fs_args[1].get("skip_instance_cache"):
            return  # the caller asked for fsspec's shared instance: other users may hold it
        try:
            from fsspec.asyn import sync
            sync(fs.loop, client.__aexit__, None, None, None, timeout=10)
        except Exception as e:  # noqa: BLE001 - closing: s3fs's finalizer tries again at exit
            log.debug("S3 storage %s: closing its client: %s: %s", self.url, type(e).__name__, e)

    # docstring inherited
    def _options(self, opts: dict) -> dict:
        # A hung connection becomes a timeout that RetryingStore retries, not a snapshot
        # that never finishes; the caller's config_kwargs win.
        cfg = dict(opts.get("config_kwargs") or {})
        cfg.setdefault("connect_timeout", 10)
        cfg.setdefault("read_timeout", 60)
        # One attempt: RetryingStore is the one retry loop. (total_max_attempts: botocore's
        # max_attempts counts retries, so max_attempts=1 was two attempts.) "standard", not
        # "adaptive": the client gets botocore's adaptive rate limiter at its first use (fs), with a
        # throttling detector that knows a HEAD's (see _add_rate_limiter). A caller's own
        # "retries" setting is taken as it is, without it.
        self._rate_limited = "retries" not in cfg
        # The body is not signed (SigV4 over plain http hashes every byte with SHA-256:
        # about 1 s of CPU per GB sent here), as botocore does by default over https: S3
        # still checks the request's CRC32 checksum (sent as a signed header), and every
        # object this store writes is verified by its BLAKE3 address when read. The
        # caller's "s3" settings win.
        cfg["s3"] = {"payload_signing_enabled": False, **(cfg.get("s3") or {})}
        cfg.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        # One attempt's bound: connecting, then at most read_timeout between bytes of a
        # response (a DeleteObjects answer is small).
        self.request_timeout = float(cfg["connect_timeout"]) + float(cfg["read_timeout"])
        return {**opts, "config_kwargs": cfg}

    def _translate(self, e: Exception) -> OSError | None:
        mod = type(e).__module__ or ""
        if not mod.startswith(_TRANSPORT_MODULES):
            return None
        name = type(e).__name__
        if _transport_failure(e):
            return (TimeoutError if "Timeout" in name else ConnectionError)(f"{name}: {e}")
        # The client refused before sending anything (no credentials, a bad parameter, no
        # region): asking again cannot cure it, so it fails at once, naming the cause.
        if any(w in name for w in _CREDENTIAL_WORDS):
            err: OSError = PermissionError(errno.EACCES, f"{name}: {e}")
        else:
            err = OSError(errno.EINVAL, f"{name}: {e}")
        err.transient = False
        return err

    def _exists_error(self, e: OSError) -> bool:
        return _is_precondition_failed(e)

    def _classify(self, e: OSError) -> None:
        # What S3 said: 5xx and throttling are worth a retry, other 4xx are not.
        resp = _response(e)
        if resp is not None:
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            code = resp.get("Error", {}).get("Code", "")
            e.transient = status >= 500 or status in (408, 429) or code in _THROTTLING
            # RetryingStore names throttling when the budget runs out under it
            e.throttled = status in _THROTTLED_STATUS or code in _SLOW_DOWN
            e.response_status = f"HTTP {status} {code}" if code and code != str(status) else f"HTTP {status}"

    def _read(self, path: str) -> bytes:
        # One GET, no sizing HEAD: s3fs releases that read a file in concurrent ranges take
        # max_concurrency (and HEAD first to size it); older ones read it in one GET anyway.
        if _ONE_GET[0]:
            try:
                return self.fs.cat_file(path, max_concurrency=1)
            except TypeError as e:  # raised before any request
                if "max_concurrency" not in str(e):
                    raise
                _ONE_GET[0] = False
        return self.fs.cat_file(path)

    def _read_head(self, path: str, n: int) -> bytes:
        # One GET with a Range past the end: S3 sends what there is, except for an empty
        # object, whose every range is unsatisfiable (416 InvalidRange).
        try:
            return self.fs.cat_file(path, start=0, end=max(n, 1))[:n]
        except OSError as e:
            resp = _response(e)
            if resp is not None and (resp.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416
                                     or resp.get("Error", {}).get("Code") == "InvalidRange"):
                return b""
            raise

    @translated
    def exists(self, key: str) -> bool:
        bucket, obj = self._s3_key(key)
        try:
            self.fs.call_s3("head_object", Bucket=bucket, Key=obj)
            return True
        except FileNotFoundError:
            return False

    @translated
    def size_of(self, key: str) -> int | None:
        bucket, obj = self._s3_key(key)
        try:  # the HEAD that exists() sends, its Content-Length read
            return int(self.fs.call_s3("head_object", Bucket=bucket, Key=obj)["ContentLength"])
        except FileNotFoundError:
            return None

    @translated
    def delete_many(self, keys: Sequence[str], *, deadline: Deadline | None = None) -> None:
        keys = list(keys)
        # One DeleteObjects request per 1000 keys (s3fs's rm() would drop per-key errors
        # silently). A key that is already gone is not an error in S3.
        bucket, _ = self._bucket_and_base()
        for i in range(0, len(keys), 1000):
            check_deadline(deadline)
            out = self.fs.call_s3("delete_objects", Bucket=bucket, Delete={
                "Objects": [{"Key": self._s3_key(k)[1]} for k in keys[i:i + 1000]], "Quiet": True})
            errs = [e for e in out.get("Errors") or [] if e.get("Code") != "NoSuchKey"]
            if errs:
                raise OSError(f"delete of {len(errs)} object(s) failed under {self.url}: "
                              f"{errs[0].get('Code')}: {errs[0].get('Message')}")

    def _bucket_and_base(self) -> tuple[str, str]:
        """The bucket, and the key prefix of this store's objects in it ("" or ".../")."""
        bucket, _, base = self.root.partition("/")
        return bucket, f"{base}/" if base else ""

    def _s3_key(self, key: str) -> tuple[str, str]:
        """(bucket, S3 key) of the store key `key`: its fsspec path (FsspecBlockStore._path,
        the URL's path then the key) split at the bucket, so requests made here and through
        s3fs name the same object. Store keys come from assets.py as they are; this backend
        only places them under its URL."""
        bucket, _, obj = self._path(key).partition("/")
        return bucket, obj

    # docstring inherited
    @translated
    def list_page(self, prefix: str, start_after: str | None = None) -> tuple[list[ObjectInfo], str | None]:
        folder = prefix.rstrip("/")  # a folder: "blocks/a" does not list blocks/ab/
        bucket, s3_prefix = self._s3_key(folder + "/" if folder else "")
        _, pre = self._bucket_and_base()  # cut from the listed S3 keys: the store keys
        kw = {"Bucket": bucket, "Prefix": s3_prefix, "MaxKeys": self.PAGE_KEYS}
        if start_after is not None:
            kw["StartAfter"] = self._s3_key(start_after)[1]
        while True:
            try:
                out = self.fs.call_s3("list_objects_v2", **kw)
            except FileNotFoundError:  # no bucket: nothing stored
                return [], None
            contents = out.get("Contents") or []
            more = bool(out.get("IsTruncated"))
            if contents or not more:
                break
            # A server may answer a truncated page with no keys: its token goes on from there.
            kw["ContinuationToken"] = out["NextContinuationToken"]
        # Keys ending in "/" are folder markers (consoles make them), never objects.
        page = [ObjectInfo(c["Key"][len(pre):], int(c.get("Size") or 0), c["LastModified"].timestamp())
                for c in contents if not c["Key"].endswith("/")]
        return page, (contents[-1]["Key"][len(pre):] if more else None)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return paged_list(self.list_page, prefix)
