"""A real TCP proxy that misbehaves like a network: for the harness (in front of
PostgreSQL and the S3 server, faults at seeded random moments) and for regression
tests (the same faults, one at a time, on command).

Faults:
    delay      a request is forwarded late
    drop       a request is forwarded, then the connection is killed before its answer
               (for a COMMIT: it landed, the client never hears so)
    hold       a COMMIT is kept back, the client's connection killed; released later,
               it is forwarded on the server session that sent it (it lands then)
    orphan     a ref move's COMMIT is swallowed and the client's connection killed, while
               the server's side is kept open and silent: the server session stays idle
               in its transaction, holding the ref row's lock, with its client gone (a
               partition after the COMMIT left); it ends only when the server ends it
               (idle_in_transaction_session_timeout) or at end_orphans()
    blackout   every connection is killed and new ones are black-holed (accepted, held
               without a byte) until it ends; then the held ones go through
    outage     every connection is reset and new ones are reset as soon as accepted
               until it ends (a server that went away), then it forwards again

Threads, plain sockets; nothing here knows a protocol beyond spotting b"COMMIT" (a
PostgreSQL simple query) and, to pick the transactions whose COMMIT is interesting, a
marker in one of their requests: REF_MOVE (a ref move) or WRITE (any write of the
ref table: the idempotency token's insert).
"""

from __future__ import annotations

import random
import socket
import threading
import time

__all__ = ["NetProxy", "Chaos"]

REF_MOVE = b"reflog_seq"  # only a ref move (compare_and_swap) touches this key
WRITE = b"int8send"  # every write transaction stamps its token with the server's clock


def _close(*socks) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            s.close()
        except OSError:
            pass


def _reset(*socks) -> None:
    """Close with a reset (RST), as a peer that went away does, not a FIN."""
    for s in socks:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except OSError:
            pass
        _close(s)


class Chaos:
    """Rates for NetProxy's random faults (per request forwarded; a blackout lasts up to
    `blackout_s`, a held COMMIT up to `hold_s`)."""

    def __init__(self, seed: int, *, delay: float = 0.02, delay_s: float = 0.2, drop: float = 0.003,
                 drop_commit: float = 0.08, hold_commit: float = 0.04, hold_s: float = 3.0,
                 blackout: float = 0.002, blackout_s: float = 2.5, dark_after: float = 0.7,
                 dark_s: tuple = (0.5, 2.5), orphan_commit: float = 0.0):
        self.rng = random.Random(seed)
        self.delay, self.delay_s, self.drop, self.drop_commit = delay, delay_s, drop, drop_commit
        self.hold_commit, self.hold_s, self.blackout, self.blackout_s = hold_commit, hold_s, blackout, blackout_s
        self.dark_after = dark_after  # how often a dropped or held request is followed by a blackout ...
        self.dark_s = dark_s  # ... lasting this long (s, uniform)
        self.orphan_commit = orphan_commit  # a ref move's COMMIT swallowed, its server session left open


class _Conn:
    def __init__(self, c, u):
        self.c, self.u = c, u
        self.commit_seen = False  # a request of this transaction carried the marker
        self.drop_reply = False
        self.dark_after = False  # a blackout once this answer is through
        self.held = False  # a COMMIT kept back: the client side is gone, the server side kept
        self.ref_move = False  # a request of this transaction moved a ref (REF_MOVE)
        self.orphan = False  # its COMMIT swallowed: the client side gone, the server side open, silent
        self.heard = b""  # what the server said on an orphan's session (its last words)
        self.u_reset = False  # end_orphans() reset the server's side (not the server's own doing)
        self.answered = threading.Event()


class NetProxy:
    """127.0.0.1:<port> -> host:upstream. Manual faults: arm_drop(), arm_hold(),
    arm_orphan(), blackout()/restore(), release(), end_orphans(). With chaos=Chaos(seed):
    random ones too. outage() (a server gone: connections reset, not held).
    Counters: drops, holds, orphans, blackouts, delays, refused (what happened, for
    reports); orphans_ended: orphans whose session the server ended itself."""

    def __init__(self, upstream: int, host: str = "127.0.0.1", *, chaos: Chaos | None = None,
                 marker: bytes | None = REF_MOVE):
        self.host, self.upstream = host, upstream
        self.chaos = chaos
        self.marker = marker  # a COMMIT is faulted only in a transaction that sent it (None: any)
        self.armed_drop = self.armed_hold = self.armed_dark = self.armed_orphan = 0
        self.drops = self.holds = self.blackouts = self.delays = self.orphans = 0
        self.orphans_ended = 0  # orphan sessions the server closed (not end_orphans())
        self.orphan_words: list[bytes] = []  # what the server sent on each orphan it closed
        self._orphan_cv = threading.Condition()  # notified as the server ends an orphan
        self.refused = 0  # connections reset at accept during an outage()
        self._gone_until = 0.0  # monotonic: outage() resets what connects before then
        self.blackout_after_fault = 0.0  # manual: seconds of blackout started by an armed fault (0: none)
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._waiting: list = []  # client sockets accepted during a blackout
        self._held: list[tuple[_Conn, bytes]] = []
        self._dark_until = 0.0  # monotonic; inf: until restore()
        self._stop = False
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.port = self.lsock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="netproxy-accept").start()
        threading.Thread(target=self._timer, daemon=True, name="netproxy-timer").start()

    # -- manual control -----------------------------------------------------------------
    def arm_drop(self, n: int = 1) -> None:
        """The next n ref-move COMMITs land and their answers are lost."""
        with self._lock:
            self.armed_drop += n

    def arm_dark_after_answer(self, n: int = 1) -> None:
        """The next n marked COMMITs are answered, then a blackout starts (blackout_after_fault
        long): the write is done and the client told, its next request cannot get through."""
        with self._lock:
            self.armed_dark += n

    def arm_hold(self, n: int = 1) -> None:
        """The next n ref-move COMMITs are kept back (client connection killed) until release()."""
        with self._lock:
            self.armed_hold += n

    def arm_orphan(self, n: int = 1) -> None:
        """The next n ref-move COMMITs are swallowed: the client's connection is killed, the
        server's kept open and silent (its session idle in its transaction, holding the
        ref's lock) until the server ends it or end_orphans()."""
        with self._lock:
            self.armed_orphan += n

    def wait_orphans(self, n: int, timeout: float) -> list[int]:
        """Wait until n orphans were made; -> the local ports of the server sides still
        open (the server's pg_stat_activity.client_port of each orphan session)."""
        with self._orphan_cv:
            self._orphan_cv.wait_for(lambda: self.orphans >= n, timeout)
        with self._lock:
            ks = [k for k in self._conns if k.orphan]
        ports = []
        for k in ks:
            try:
                ports.append(k.u.getsockname()[1])
            except OSError:  # ended meanwhile
                pass
        return ports

    def wait_orphans_ended(self, n: int, timeout: float) -> bool:
        """Wait until the server has ended n orphan sessions itself; -> whether it did."""
        with self._orphan_cv:
            return self._orphan_cv.wait_for(lambda: self.orphans_ended >= n, timeout)

    def end_orphans(self) -> int:
        """The partition heals with the clients gone: each orphan's server side is reset
        (its session ends, its transaction rolls back). -> how many were still open."""
        with self._lock:
            ks = [k for k in self._conns if k.orphan]
        for k in ks:
            k.u_reset = True
            _reset(k.u)
        return len(ks)

    def blackout(self, seconds: float = float("inf")) -> None:
        """Kill every connection (a held COMMIT's server session excepted) and black-hole
        new ones for `seconds` (until restore() by default)."""
        with self._lock:
            self.blackouts += 1
            self._dark_until = max(self._dark_until, time.monotonic() + seconds)
            conns = [k for k in self._conns if not k.held and not k.orphan]
        for k in conns:
            _close(k.c, k.u)

    def outage(self, seconds: float) -> None:
        """Reset every connection, and each new one as soon as it is accepted, for
        `seconds` (0 ends an outage now): a server that went away, where blackout() is
        one that stopped answering."""
        with self._lock:
            self._gone_until = time.monotonic() + seconds
            conns = [k for k in self._conns if not k.held and not k.orphan]
        for k in conns:
            _reset(k.c, k.u)

    def down(self) -> bool:
        """Whether an outage() is under way."""
        return time.monotonic() < self._gone_until

    def restore(self) -> None:
        """End a blackout: the connections held meanwhile go through."""
        with self._lock:
            self._dark_until = 0.0
            waiting, self._waiting = self._waiting, []
        for c in waiting:
            self._splice(c)

    def release(self, wait: float = 30.0) -> int:
        """Forward the COMMITs kept back (each lands or fails on its own session); waits
        (up to `wait` s each) for the server's answer, which nobody hears. -> how many."""
        with self._lock:
            held, self._held = self._held, []
        for k, data in held:
            self._forward_held(k, data, wait)
        return len(held)

    def close(self) -> None:
        self._stop = True
        self.release(wait=5.0)
        _close(self.lsock)
        with self._lock:
            conns, self._conns = list(self._conns), set()
            waiting, self._waiting = self._waiting, []
        for k in conns:
            _close(k.c, k.u)
        _close(*waiting)

    # -- the plumbing -------------------------------------------------------------------
    def _dark(self) -> bool:
        return time.monotonic() < self._dark_until

    def _timer(self) -> None:  # ends timed blackouts (restore() ends the others)
        while not self._stop:
            time.sleep(0.05)
            with self._lock:
                due = self._waiting and not self._dark()
            if due:
                self.restore()

    def _accept(self) -> None:
        while not self._stop:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            with self._lock:
                if self.down():
                    self.refused += 1
                    _reset(c)
                    continue
                if self._dark():  # black-holed: the client waits for a first byte that is late
                    self._waiting.append(c)
                    continue
            self._splice(c)

    def _splice(self, c) -> None:
        try:
            u = socket.create_connection((self.host, self.upstream), timeout=10)
            u.settimeout(None)
        except OSError:
            _close(c)
            return
        k = _Conn(c, u)
        with self._lock:
            self._conns.add(k)
        threading.Thread(target=self._up, args=(k,), daemon=True, name="netproxy-up").start()
        threading.Thread(target=self._down, args=(k,), daemon=True, name="netproxy-down").start()

    def _fault_for(self, k: _Conn, data: bytes) -> str | None:
        """What to do with this request: None, 'delay', 'drop', 'hold', 'orphan' (and maybe
        a blackout)."""
        is_commit = b"COMMIT" in data and (k.commit_seen or self.marker is None)
        with self._lock:
            if is_commit and k.ref_move and self.armed_orphan:
                self.armed_orphan -= 1
                return "orphan"
            if is_commit and self.armed_hold:
                self.armed_hold -= 1
                return "hold"
            if is_commit and self.armed_drop:
                self.armed_drop -= 1
                return "drop"
            if is_commit and self.armed_dark:
                self.armed_dark -= 1
                return "dark_after"
            ch = self.chaos
            if ch is None:
                return None
            r = ch.rng.random()
            if is_commit:
                if r < ch.hold_commit:
                    return "hold"
                if r < ch.hold_commit + ch.drop_commit:
                    return "drop"
                if k.ref_move and r < ch.hold_commit + ch.drop_commit + ch.orphan_commit:
                    return "orphan"
            elif r < ch.drop:
                return "drop"
            if ch.rng.random() < ch.blackout:
                return "blackout"
            if ch.rng.random() < ch.delay:
                return "delay"
        return None

    def _after_fault(self) -> None:
        """A random fault may leave the server unreachable for a while (the case where a
        client's retries run out); an armed one does when blackout_after_fault is set."""
        ch = self.chaos
        if ch is not None:
            with self._lock:
                dark = ch.rng.random() < ch.dark_after
                secs = ch.rng.uniform(*ch.dark_s)
            if dark:
                self.blackout(secs)
        elif self.blackout_after_fault:
            self.blackout(self.blackout_after_fault)

    def _up(self, k: _Conn) -> None:
        try:
            while data := k.c.recv(65536):
                if self.marker is not None and self.marker in data:
                    k.commit_seen = True
                if REF_MOVE in data:
                    k.ref_move = True
                fault = self._fault_for(k, data)
                if b"COMMIT" in data:
                    k.commit_seen = k.ref_move = False
                if fault == "orphan":
                    with self._lock:
                        k.orphan = True
                        self.orphans += 1
                    # The client's side dies; the COMMIT never reaches the server, whose side
                    # stays open and hears nothing more (so keepalives cannot help either).
                    _reset(k.c)
                    with self._orphan_cv:
                        self._orphan_cv.notify_all()
                    return
                if fault == "hold":
                    k.held = True
                    with self._lock:
                        self.holds += 1
                        self._held.append((k, data))
                        hold_s = self.chaos.rng.uniform(1.0, self.chaos.hold_s) if self.chaos else None
                    _close(k.c)  # the client's connection dies mid-COMMIT; the server session waits
                    self._after_fault()
                    if hold_s is not None:
                        threading.Timer(hold_s, self._release_one, args=(k,)).start()
                    return
                if fault == "delay":
                    with self._lock:
                        self.delays += 1
                        secs = self.chaos.rng.uniform(0, self.chaos.delay_s)
                    time.sleep(secs)
                elif fault == "drop":
                    k.drop_reply = True
                elif fault == "dark_after":
                    k.dark_after = True
                elif fault == "blackout":
                    with self._lock:
                        secs = self.chaos.rng.uniform(0.2, self.chaos.blackout_s)
                    self.blackout(secs)
                    return
                k.u.sendall(data)
        except OSError:
            pass
        if not k.held:
            self._forget(k)

    def _release_one(self, k: _Conn) -> None:
        with self._lock:
            mine = [(x, d) for x, d in self._held if x is k]
            self._held = [(x, d) for x, d in self._held if x is not k]
        for _, data in mine:
            self._forward_held(k, data, 10.0)

    def _forward_held(self, k: _Conn, data: bytes, wait: float) -> None:
        try:
            k.u.sendall(data)
            k.answered.wait(wait)
        except OSError:
            pass
        self._forget(k)

    def _down(self, k: _Conn) -> None:
        try:
            while data := k.u.recv(65536):
                if k.orphan:  # the server speaks to a client that is gone (a FATAL as it ends it)
                    k.heard = (k.heard + data)[-4096:]
                    continue
                if k.held:  # the answer to a held COMMIT: nobody is there to hear it
                    k.answered.set()
                    continue
                if k.drop_reply:  # the server answered: the request landed. Say nothing.
                    with self._lock:
                        self.drops += 1
                    self._after_fault()
                    break
                # Read before forwarding: once this answer is through, the client may send
                # its COMMIT (which arms dark_after) before the check below runs, and the
                # blackout would then cut the COMMIT instead of following its answer.
                dark = k.dark_after
                k.c.sendall(data)
                # The blackout starts once the whole answer is through: it ends with
                # PostgreSQL's ReadyForQuery ('Z', length 5, status); a reply the server
                # sent in pieces would otherwise be cut after its first one.
                if dark and data[-6:-1] == b"Z\x00\x00\x00\x05":
                    k.dark_after = False
                    self._after_fault()
        except OSError:
            pass
        k.answered.set()
        if k.orphan:
            with self._orphan_cv:
                if not self._stop and k in self._conns and not k.u_reset:
                    self.orphans_ended += 1  # the server closed the session itself
                    self.orphan_words.append(k.heard)
                self._orphan_cv.notify_all()
        if not k.held:
            self._forget(k)

    def _forget(self, k: _Conn) -> None:
        with self._lock:
            self._conns.discard(k)
        _close(k.c, k.u)


class NetFaults:
    """The harness's network: a NetProxy in front of the PostgreSQL ref table (pg, s3) and
    one in front of the S3 server (s3). Workers reach both through them (spec()); the
    driver's own checks go direct. Each round draws its rates (or none) from the round's
    seed; at the round's end the faults stop and held COMMITs are let through (a COMMIT
    delayed in the network lands after its client gave up: what the checks must survive).
    On the ref table some ref moves' COMMITs are orphaned (NetProxy "orphan"): the session
    keeps the ref's lock with its client gone until the server ends it; puts behind it
    must end all the same (faults.py bounds each ref-table transaction of a worker). The
    orphans left at the round's end are reset, as a partition that heals."""

    CONNECT_TIMEOUT = 1  # s: the workers' ref-table connect timeout, shorter than most blackouts
    # Of ref moves' COMMITs, the share orphaned: one stalls every ref move of the store
    # (they all write the reflog sequence) until the server ends it (5 s at this connect
    # timeout), so a few per run, not per round.
    ORPHAN, ORPHAN_HEAVY = 0.02, 0.2

    def __init__(self, loc):
        self.loc = loc
        self.pg = self.s3 = None
        self.rounds_on = 0
        if loc.refs:
            from psycopg.conninfo import conninfo_to_dict, make_conninfo
            d = conninfo_to_dict(loc.refs)
            self.pg = NetProxy(int(d.get("port") or 5432), d.get("host") or "127.0.0.1", marker=WRITE)
            self._dsn = make_conninfo(loc.refs, host="127.0.0.1", port=str(self.pg.port),
                                      connect_timeout=str(self.CONNECT_TIMEOUT))
        if loc.kind == "s3":
            from urllib.parse import urlsplit
            ep = urlsplit(loc.storage_options["endpoint_url"])
            self.s3 = NetProxy(ep.port or 80, ep.hostname or "127.0.0.1", marker=None)
            self._endpoint = f"{ep.scheme}://127.0.0.1:{self.s3.port}"

    def proxies(self) -> list[NetProxy]:
        return [p for p in (self.pg, self.s3) if p is not None]

    def spec(self) -> dict:
        st = self.loc.spec()
        if self.pg is not None:
            st["refs"] = self._dsn
        if self.s3 is not None:
            st["storage_options"] = dict(st["storage_options"], endpoint_url=self._endpoint)
        return st

    def start_round(self, rng: random.Random, p_on: float = 0.7, heavy: bool = False) -> bool:
        """Draw this round's faults; False: a quiet network this round. heavy: every
        round, and most ref-table COMMITs faulted (the "net" flavor)."""
        if not self.proxies() or (not heavy and rng.random() >= p_on):
            return False
        self.rounds_on += 1
        if self.pg is not None and heavy:
            # blackouts of 1.1-2.5 s: past the 1 s connect timeout (the write gives up), and
            # often short enough for its clean-up's read to get through while a COMMIT is
            # still held (released after 1-5 s)
            self.pg.chaos = Chaos(rng.getrandbits(32), drop_commit=0.25, hold_commit=0.2, dark_after=0.9,
                                  dark_s=(1.1, 2.5), hold_s=5.0, orphan_commit=self.ORPHAN_HEAVY)
        elif self.pg is not None:
            self.pg.chaos = Chaos(rng.getrandbits(32), drop_commit=rng.choice([0.05, 0.12]),
                                  hold_commit=rng.choice([0.03, 0.08]), dark_s=(0.5, rng.choice([2.0, 3.0])),
                                  orphan_commit=self.ORPHAN)
        if self.s3 is not None:
            self.s3.chaos = Chaos(rng.getrandbits(32), drop=0.01, drop_commit=0.0, hold_commit=0.0,
                                  blackout=0.001, blackout_s=2.0)
        return True

    def end_round(self) -> dict:
        """Stop the faults, let held COMMITs through; -> the round's counts."""
        out = {}
        for name, p in (("pg", self.pg), ("s3", self.s3)):
            if p is None:
                continue
            p.chaos = None
            p.restore()
            p.end_orphans()
            p.release(wait=10.0)
            out[name] = {"drops": p.drops, "holds": p.holds, "orphans": p.orphans, "blackouts": p.blackouts}
            p.drops = p.holds = p.blackouts = p.delays = p.orphans = 0
        return out

    def close(self) -> None:
        for p in self.proxies():
            p.chaos = None
            p.close()
