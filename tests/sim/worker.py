"""One harness worker: a real process that opens the store itself and runs seeded
random operations, journaling each one before and after the call.

    python -m tests.sim.worker CONFIG.json

CONFIG (written by the driver): id, seed, role ("ops" | "recover"), store (url, refs,
storage_options), journal path, ops (how many), seconds (after it is ready), weights (op ->
weight), refs/jobs to use, gc_lease (open_store's: the lease of this process's own gcs; it must not decide
another gc is dead), gc_stale / gc_leases (the leases its gc runs declare), faults (faults.py profile; kill_at may be "auto" for recover:
a random ref-table write of the run, so that a kill lands in its ref moves); tier (a
local tier's directory: the store is opened through it, ops put/read/durable, and rot
where cfg["rot"]: it damages a block on that tier's disk) and
tier_end ("close" | "wait" | "kill" | "down": how such a writer ends); catalog (a tier writer with a
job of its own: {"job", "keep_last", "keep_best"}: it sets the job's retention, prunes the job
after puts, tags, pins, untags and unpins the job's snapshots in its tier), budget (the tier's
local_budget in bytes), sharing (how many processes of the round open that tier), saver (a tier
writer whose uploads run in a saver process, killed or stopped at random as it uploads); meet
({"path", "n"}: the round's workers start their operations together).

Journal: one JSON line per event, fsync'd, in CONFIG["journal"]:
    {"w", "i", "op", "args", "start"}                      before the call
    {"w", "i", "result": "ok" | <error type>, "end", ...}   after it (root, step, time,
                                                           findings, expired, error text)
    {"w", "kill": point, "op", "key"}                       a self-kill, just before it
A "start" with no result is an operation whose outcome is unknown (killed).
"""

from __future__ import annotations

import faulthandler
import functools
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings

import numpy as np
import torch

import tensorstore_ck as tsck
import tensorstore_ck.maintain.gc as tsck_gc
import tensorstore_ck.write.saver as _saver
from tensorstore_ck.storage import local as _local
from tensorstore_ck.write.unchanged import Unchanged

from . import content, preempt, rollback, tierops
from .faults import _HOME, Faults, SimStore, sim_storage, slow_reftable


class LogCount(logging.Handler):
    """Counts this process's publisher log records that say `needle` (logged at DEBUG)."""

    def __init__(self, needle: str):
        super().__init__(logging.DEBUG)
        self.needle, self.n = needle, 0

    def emit(self, record):
        if self.needle in record.getMessage():
            self.n += 1


# Fenced moves (each re-validation): a put's count is journaled and judged (I8: a fenced
# writer takes a gc hold, so it is fenced once).
FENCES = LogCount("re-validating")
# Lost races for the ref (each a commit object the table refused, removed after): the round
# line shows how many puts, and whether a recover came after them (I3's one put, one snapshot).
RACES = LogCount("lost the race")
for _h in (FENCES, RACES):
    logging.getLogger("tensorstore_ck.write.publish").addHandler(_h)
logging.getLogger("tensorstore_ck.write.publish").setLevel(logging.DEBUG)


class GoneCount(logging.Filter):
    """Counts this process's uploads that found their snapshot's local copy gone because
    another process sharing the tier made it durable and took it (Uploader.gone_meanwhile
    logs each, at DEBUG): the round line shows the path was drawn. A filter, not a
    handler: the uploader's warnings still reach the worker's stderr (logging's last resort)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def filter(self, record):
        if "made durable by another process" in record.getMessage():
            self.n += 1
        return True


GONE = GoneCount()
logging.getLogger("tensorstore_ck.tier.uploader").addFilter(GONE)
logging.getLogger("tensorstore_ck.tier.uploader").setLevel(logging.DEBUG)


class Journal:
    def __init__(self, path: str, wid: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.wid = wid

    def write(self, **rec) -> None:
        rec = {"w": self.wid, **rec}
        os.write(self.fd, (json.dumps(rec, sort_keys=True) + "\n").encode())
        os.fsync(self.fd)


SIM_DIRECT_MIN = 8192
# A stopped saver is killed after this many seconds of silence (saver.SILENCE, 60): the
# harness's rounds last seconds.
SIM_SAVER_SILENCE = 2.0


def open_store(cfg: dict, faults: Faults | None, **kw) -> tsck.Store:
    """The round's store; with cfg["tier"], through that local tier (open_store(local=)):
    wrap_storage then wraps the remote storage, which only the uploader writes, and both
    ref tables (the tier's and the remote one) get the fault points."""
    st = cfg["store"]
    # The harness's objects are a few KiB, far below the blocks a local store writes with
    # O_DIRECT (storage/local.py DIRECT_MIN, 1 MiB): lowered, its blocks of 8 KiB and more
    # go that way too (padded to the alignment, cut back), under kill -9 and the checks.
    _local.DIRECT_MIN = SIM_DIRECT_MIN
    wrap = (lambda inner: SimStore(inner, faults)) if faults is not None else None
    if kw.pop("saver", False):
        _saver.SILENCE = SIM_SAVER_SILENCE
        # A saver process writes the asynchronous puts' blocks: it opens the storage itself,
        # wrapped by the same faults' delays and failures (sim_storage, carried by pickle; the
        # kill points stay this process's), and writes at the default DIRECT_MIN (its own
        # import of storage/local.py).
        kw["saver"] = "process"
        if faults is not None:
            _HOME[os.getpid()] = faults
            wrap = functools.partial(sim_storage, faults.p, faults.seed, os.getpid())
    if cfg.get("tier"):
        kw["local"] = cfg["tier"]
        kw["early_upload"] = bool(cfg.get("early_upload"))
        # The remote's blocks float-coded, as an object store's are: the tier writes lz4
        # and the uploader (or the early upload) codes each block for the remote.
        kw["compression"] = "float"
        if cfg.get("budget"):
            kw["local_budget"] = int(cfg["budget"])
    refs = st.get("refs")
    if cfg.get("tier_end") == "down" and faults is not None and isinstance(refs, str) \
            and (refs.startswith(("postgresql://", "postgres://", "host=")) or " dbname=" in refs):
        # Its remote ref table (PostgreSQL) through a proxy of this process's own, which the
        # writer takes down with the remote storage (Faults.remote_down): a real connection
        # to the server that stops answering, or is refused, while the tier closes (T16).
        from psycopg.conninfo import conninfo_to_dict, make_conninfo

        from .netproxy import NetProxy
        d = conninfo_to_dict(refs)
        faults.pg_proxy = NetProxy(int(d.get("port") or 5432), d.get("host") or "127.0.0.1", marker=None)
        refs = make_conninfo(refs, host="127.0.0.1", port=str(faults.pg_proxy.port))
    give_up = time.time() + 60
    while True:
        try:
            s = tsck.open_store(st["url"], refs=refs, storage_options=st.get("storage_options"),
                                create=False, wrap_storage=wrap, workers=3,
                                # the budget the harness's blackouts were sized against: a
                                # write inside one gives up (OutcomeUnknown), as they test
                                retry_budget=1.5, **kw)
            break
        except tsck.StorageError:  # the network proxy's blackout (tests/sim/netproxy.py): wait it out
            if time.time() > give_up:
                raise
            time.sleep(0.5)
    if faults is not None:
        slow_reftable(s.reftable, faults)
        if cfg.get("tier"):
            slow_reftable(s.remote_core.refs, faults)
            _upload_kill_points(s, faults)
    return s


def _kill_saver(s, sig: str) -> None:
    """SIGKILL or SIGSTOP the store's saver process, if it runs now (the put it writes
    fails with SaverDied, at once or after its silence, and publishes nothing; the next
    put starts another)."""
    pid = s._saver.pid
    if pid is not None:
        try:
            os.kill(pid, getattr(signal, f"SIG{sig}"))
        except ProcessLookupError:
            pass


def _upload_kill_points(s, faults: Faults) -> None:
    """The uploader's last two stages as kill points (faults.kill_upload): "move", every
    object sent and synced, the remote ref not moved yet; "durable", the remote ref moved,
    the tier not told (its queue still holds the snapshot). The uploader's thread is
    already running (it resumes a queue at open): a stage it passed before this is missed."""
    up = s._tier.uploader
    move_to, upload_done = up.publisher.move_to, up.local.refs.tier_rows.upload_done

    def move(*a, **k):
        faults.upload_point("move")
        return move_to(*a, **k)

    def done(*a, **k):
        faults.upload_point("durable")
        return upload_done(*a, **k)

    up.publisher.move_to, up.local.refs.tier_rows.upload_done = move, done


def _die_with_parent() -> None:
    """In a `tsck gc` child: a kill -9 of this worker kills its gc too (Linux), so the
    driver's checks after a round run on a quiescent store."""
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_GC_PHASES = (tsck_gc.PHASE_OBJECTS, tsck_gc.PHASE_SECONDS)  # the package's own (_ForkedRank)


def job_of(ref: str) -> str:
    return ref.split("/", 1)[0]


def _err(e: BaseException) -> dict:
    raw = not isinstance(e, tsck.TsckError)
    out = {"result": type(e).__name__, "error": str(e)[:400]}
    if raw:
        out["raw"] = True
        out["trace"] = traceback.format_exc()[-1500:]
    return out


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return 0


RANKS = 2  # the world size of a worker's collective puts
ROT_I = 1_000_000  # journal index offset of the damage done as a put returns (Worker._rot_after_put)
CAT_I = 2_000_000  # a catalog writer's own calls: its rules at start (CAT_I), its prune after put i (CAT_I + 1 + i)
DOWN_I = 3_000_000  # a writer ending "down": the moment its remote storage went away
MEET_WAIT = 60.0  # seconds a worker waits for the round's others to be open (Worker._meet)
# close(timeout=) of a tier writer whose remote goes down as it ends (T16), drawn per writer.
CLOSE_DOWN_TIMEOUTS = (1.0, 3.0, 8.0)


def tier_bytes(path: str) -> int:
    """The bytes of a tier's stored objects (blocks, nodes, commits: what its budget bounds)."""
    n = 0
    for kind in ("blocks", "nodes", "commits"):
        for d, _, fs in os.walk(os.path.join(path, kind)):
            for f in fs:
                try:
                    n += os.stat(os.path.join(d, f)).st_size
                except FileNotFoundError:  # deleted by an eviction or a prune meanwhile
                    pass
    return n
# Operations journaled under another name (every check of puts judges collective ones).
JOURNAL_AS = {"cput": "put"}


class Worker:
    _die_after = False  # a planned rank-0 kill broke its ranks' group: this worker dies next
    _upload_stopped = False  # a wait_durable() raised the failure that stopped the uploader

    def __init__(self, cfg: dict, cfg_path: str = ""):
        self.cfg = cfg
        self.cfg_path = cfg_path
        self.ranks: list = []
        self.wid = cfg["id"]
        self.rng = random.Random(cfg["seed"])
        # gc and prune delete in short phases; small limits make many phases out of the few
        # candidates a round has (drawn from a stream of their own: the worker's stays as it was).
        ph = random.Random(f"{cfg['seed']}-phases")
        tsck_gc.PHASE_OBJECTS = ph.choice([1, 3, 16, 64, tsck_gc.PHASE_OBJECTS])
        tsck_gc.PHASE_SECONDS = ph.choice([0.005, 0.05, tsck_gc.PHASE_SECONDS])
        self.j = Journal(cfg["journal"], self.wid)
        profile = dict(cfg.get("faults") or {})
        self.kill_auto = profile.get("kill_at") == "auto"  # recover: chosen once the commits are counted
        if self.kill_auto:
            profile["kill_at"] = None
        self.faults = Faults(profile, self.rng.getrandbits(64),
                             on_kill=lambda n, op, key: self.j.write(kill=n, op=op, key=key))
        self.faults.raced = lambda: RACES.n  # kill_raced: the lost races so far
        self.puts: list[dict] = []   # this worker's successful puts: ref, step, root
        self._taken: set = set()  # op indices already made (the second put of a skip pair)
        self._out: dict = {}  # rank pid -> what it printed that was not read yet (_rank_line)
        self.pinned: list[str] = []
        self.n = 0
        self.branch: str | None = None  # a ref just rolled back: the next put goes on it (rollback.py)
        self.frozen: torch.Tensor | None = None  # content.frozen(frozen_v), kept across puts
        self.frozen_v = 0

    # -- the operations -------------------------------------------------------------
    def op_put(self, s, i):
        ref = self.rng.choice(self.cfg["refs"])
        if self.branch is not None:  # the new branch's next snapshot, after a rollback
            ref, self.branch = self.branch, None
        step = self.cfg["step_base"] + i
        own = None
        if self.rng.random() < self.cfg.get("vulture_p", 0.0):
            own = self._vulture(s)
        if own is None and self.rng.random() < self.cfg.get("reuse_p", 0.35):
            # Put again the own tensor of an earlier snapshot: most often of the oldest
            # unprotected ones of this job, those retention drops next (a gc running now
            # or soon lists their blocks for deletion while this put reuses them); else
            # one the driver listed, or one of this worker's.
            hist = self._expiring(s, job_of(ref))
            if hist and self.rng.random() < self.cfg.get("resave_p", 0.5):
                own = hist[int(min(len(hist), 3) * self.rng.random())]
            else:
                earlier = self.cfg.get("reuse", []) + [list(p["own"]) for p in self.puts]
                own = self.rng.choice(earlier) if earlier else None
        spec = content.make_spec(self.wid, i, self.rng.randrange(content.VARIANTS), step, own)
        blocking = self.rng.random() < self.cfg.get("blocking_p", 0.6)
        grow = random.Random(f"{self.cfg['seed']}-{self.wid}-{i}-grow")  # (a stream of its own)
        if not blocking and grow.random() < self.cfg.get("grow_p", 0.0):
            # A state whose size is not the last asynchronous put's: the staging pool keeps
            # buffers of several sizes (max_inflight=2) and must pick among them by identity.
            spec["g"] = grow.choice([2_000, 30_000, 90_000])
        if grow.random() < self.cfg.get("layout_p", 0.25):
            spec["l"] = grow.choice([1, 2, 3])  # the same keys, another layout (content.state)
        args = {"ref": ref, "step": step, "spec": spec, "blocking": blocking}
        if s.pack_size:
            args["packs"] = s.pack_size  # its small tensors packed (open_store(pack_size=))
            spec["p"] = 1
        if not blocking and s._saver is not None:
            args["saver"] = True  # its blocks written by the saver process
            kills = random.Random(f"{self.cfg['seed']}-{self.wid}-{i}-saver")  # (a stream of its own)
            if kills.random() < 0.3:  # the saver killed (SIGKILL) or stopped (SIGSTOP: hung, killed
                # by the put after saver.SILENCE) this long after the put was staged
                args["saver_kill"] = round(kills.uniform(0.0, 0.05), 4)
                args["saver_sig"] = kills.choice(["KILL", "KILL", "STOP"])
        if self.cfg.get("tier") and s._saver is not None:
            kills = random.Random(f"{self.cfg['seed']}-{self.wid}-{i}-upsaver")  # (a stream of its own)
            if kills.random() < 0.3:  # the saver killed or stopped as it uploads what came before:
                # that upload's attempt fails (SaverDied) and is tried again with a new saver
                args["upload_saver_kill"] = round(kills.uniform(0.0, 0.3), 4)
                args["upload_saver_sig"] = kills.choice(["KILL", "KILL", "STOP"])
        if self.cfg.get("tier"):  # published in the tier: durable (remote) only once uploaded
            args["tier"] = os.path.basename(self.cfg["tier"])
            if self.cfg.get("budget"):  # (T13 judges the tier's bytes sampled as the put returns)
                args.update(budget=self.cfg["budget"], sharing=self.cfg.get("sharing", 1))
        kw = {}
        if self.rng.random() < 0.15:  # a conditional move on the tip seen now
            cur = s.reftable.get_or_none(ref)
            kw["expected"] = args["expected"] = None if cur is None else cur.hex()
        if not self.cfg.get("tier"):  # (a tier's budget judges a put by its state's bytes: T13)
            args["frozen"] = self._frozen_step(grow)
            spec["f"] = self.frozen_v
        state = content.state(spec)
        if "f" in spec:
            state["frozen"] = self.frozen  # the one the worker keeps, not a copy: watched across puts

        def call():
            fenced0, races0 = FENCES.n, RACES.n
            t0 = time.time_ns()
            if args.get("upload_saver_kill") is not None:
                threading.Timer(args["upload_saver_kill"], _kill_saver, (s, args["upload_saver_sig"])).start()
            if blocking:
                info = s.put_snapshot(state, ref=ref, step=step, metrics={"loss": self.rng.random()},
                                      meta={"sim": spec}, **kw)
            else:
                fut = s.put_snapshot(state, ref=ref, step=step, metrics={"loss": self.rng.random()},
                                     meta={"sim": spec}, blocking=False, **kw)
                if args.get("saver_kill") is not None:
                    threading.Timer(args["saver_kill"], _kill_saver, (s, args["saver_sig"])).start()
                for k, v in state.items():  # staged: the caller may reuse its buffers at once
                    if hasattr(v, "fill_") and k != "frozen":
                        v.fill_(7)
                info = fut.result()
            if self.cfg.get("rot"):
                self._rot_after_put(i, t0 - 20_000_000)  # mtimes come from a coarse clock
            self.puts.append({"ref": ref, "step": step, "root": info.root, "own": spec.get("u", [self.wid, i])})
            # hits: objects this Store reused from its presence record so far (the driver
            # reports them, so a run shows the record was exercised beside gc)
            out = {"root": info.root, "time": info.time, "ref_job": info.job, "fenced": FENCES.n - fenced0,
                   "races": RACES.n - races0, "hits": s.assets.presence.hits, "durable": info.durable,
                   "kept_plans": s._plan_cache.hits if s._plan_cache is not None else 0,
                   "unchanged": Unchanged.get().reused if Unchanged.get() is not None else 0}
            if self.cfg.get("catalog"):
                out["tier_bytes"] = tier_bytes(self.cfg["tier"])
            return out
        return args, call

    def _frozen_step(self, rng) -> str:
        """The worker's frozen tensor before a put: kept as it is (most puts), or changed
        once through a seeded write path (content.frozen's next version) -> that path."""
        if self.frozen is None:
            self.frozen, self.frozen_v = content.frozen(0), 0
        if rng.random() >= 0.3:
            return "kept"
        v = self.frozen_v + 1
        at, val, t = content.frozen_at(v), float(v), self.frozen
        how = rng.choice(["inplace", "data", "numpy", "dlpack", "thread", "readv"])
        if how == "inplace":
            with torch.no_grad():
                t[at:at + 1].fill_(val)
        elif how == "data":
            t.data[at] = val
        elif how == "numpy":
            t.numpy()[at] = val
        elif how == "dlpack":
            np.from_dlpack(t)[at] = val
        elif how == "thread":
            th = threading.Thread(target=t.numpy().__setitem__, args=(at, val))
            th.start()
            th.join()
        else:  # the kernel writes it (copy_to_user): no instruction of this process does
            r, w = os.pipe()
            try:
                os.write(w, np.float32(val).tobytes())
                os.readv(r, [memoryview(t.numpy()).cast("B")[4 * at:4 * at + 4]])
            finally:
                os.close(r)
                os.close(w)
        self.frozen_v = v
        return how

    def op_durable(self, s, i):
        """A writer with a local tier waits for its uploads (wait_durable with a timeout):
        once it says True, the newest snapshot this worker put of each ref must be marked
        durable. (An older one may have been skipped by the backlog rule: a newer one of
        its ref was queued behind it.)"""
        timeout = self.rng.choice([0.2, 1.0, 4.0])
        newest = {}
        for p in self.puts:
            newest[p["ref"]] = p["root"]
        roots = list(newest.values())

        def call():
            done = s.wait_durable(timeout=timeout)
            out = {"durable": done, "roots": roots}
            if done:
                marked = s.reftable.tier_rows.durable(bytes.fromhex(r) for r in roots)
                out["unmarked"] = [r for r in roots if bytes.fromhex(r) not in marked]
            return out
        return {"timeout": timeout, "tier": os.path.basename(self.cfg["tier"])}, call

    def op_rot(self, s, i):
        """A writer with a local tier damages its own tier's disk (cfg["rot"]): one stored
        block, one byte flipped in its middle or its last bytes cut. What must follow (T3,
        T5, T7, T10): the damaged copy never reaches the remote; the uploader stops on it
        if it still had to send it (wait_durable() or close() raises the IntegrityError naming it); a
        read through the tier takes the remote copy or raises; the tier's own fsck names
        only it. The driver retires the tier after the round (a node's disk replaced)."""
        names = self._tier_blocks()
        how = self.rng.choice(["flip", "cut"])
        if names and self.rng.random() < 0.7:  # mostly a block just written: its upload may still be due
            names = sorted(names, key=_mtime)[-8:]
        path = self.rng.choice(names) if names else None
        return {"tier": os.path.basename(self.cfg["tier"]), "how": how}, lambda: {"key": self._damage(path, how)}

    def _tier_blocks(self, since_ns: int = 0) -> list[str]:
        """The stored blocks of this writer's tier (modified at since_ns or later)."""
        root, out = os.path.join(self.cfg["tier"], "blocks"), []
        for d, _, fs in os.walk(root):
            for n in fs:
                p = os.path.join(d, n)
                try:
                    if len(n) == 64 and all(c in "0123456789abcdef" for c in n) and \
                            (not since_ns or os.stat(p).st_mtime_ns >= since_ns):
                        out.append(p)
                except FileNotFoundError:
                    pass
        return sorted(out)

    def _damage(self, path: str | None, how: str) -> str | None:
        """Flip a byte in the middle of the stored block at `path`, or cut its last bytes ->
        its key (None: no block to damage)."""
        if path is None:
            return None
        try:
            with open(path, "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                if how == "flip" and size:
                    f.seek(size // 2)
                    b = f.read(1)
                    f.seek(size // 2)
                    f.write(bytes([b[0] ^ 0x10]))
                else:
                    f.truncate(max(0, size - 1 - self.rng.randrange(64)))
        except FileNotFoundError:  # moved aside meanwhile (a put found it damaged and healed it)
            return None
        return "blocks/" + os.path.relpath(path, os.path.join(self.cfg["tier"], "blocks"))

    def _rot_after_put(self, i: int, since_ns: int) -> None:
        """A writer with cfg["rot"] sometimes damages a block its put just wrote, as the put
        returns: racing its uploader, which must not send it damaged. Journaled as its own
        op "rot" (index ROT_I + i)."""
        names = self._tier_blocks(since_ns)
        if not names or self.rng.random() >= 0.4:
            return
        how = self.rng.choice(["flip", "cut"])
        path = self.rng.choice(names)
        self._journaled(ROT_I + i, "rot", {"tier": os.path.basename(self.cfg["tier"]), "how": how, "after_put": True},
                        lambda: {"key": self._damage(path, how)})

    def op_cput(self, s, i):
        """A collective put by this worker's ranks (tests/sim/ranks.py, a real gloo group of
        RANKS processes): replicated base and var, own cut into row ranges, one commit
        whose chunk index rank 0 writes. Journaled as a put (args["collective"]), so every
        check of puts judges it, and its spec (spec["c"]) rebuilds what a whole checkout
        must return."""
        ref = self.rng.choice(self.cfg["refs"])
        step = self.cfg["step_base"] + i
        own = None
        if self.rng.random() < self.cfg.get("reuse_p", 0.35):
            earlier = self.cfg.get("reuse", []) + [list(p["own"]) for p in self.puts]
            own = self.rng.choice(earlier) if earlier else None
        spec = dict(content.make_spec(self.wid, i, self.rng.randrange(content.VARIANTS), step, own), c=RANKS)
        # Asynchronous in half the calls: a Random of its own (seeded by the call), so the
        # worker's stream of choices, which seeds reproduce, stays what it was.
        asyn = random.Random(f"{self.cfg['seed']}-{self.wid}-{i}").random() < 0.5
        args = {"ref": ref, "step": step, "spec": spec, "blocking": not asyn, "collective": RANKS}
        if self.cfg.get("rank_tiers"):  # each rank through its own tier: published there, uploaded later
            args["rank_tiers"] = [os.path.basename(t) for t in self.cfg["rank_tiers"]]
            args["tier"] = args["rank_tiers"][0]
            if self.cfg.get("rank_budget"):  # (T13 judges each rank's tier as its put returns)
                args["rank_budget"] = self.cfg["rank_budget"]
        cmd = {"ref": ref, "step": step, "spec": spec, "async": asyn}
        if self.cfg.get("rank_tiers") and random.Random(f"{self.cfg['seed']}-{self.wid}-{i}-k0").random() < 0.25:
            # Rank 0 SIGKILLs itself once the snapshot is published in its tier, before the
            # others hear it (its c10d Store goes with it): rank 1 cannot ask rank 0's tier,
            # so it must say OutcomeUnknown and keep its part's intent (T9); the next round's
            # opens send both (the tip never queued, the part from the intent).
            args["kill0"] = cmd["kill0"] = True
        if self.rng.random() < 0.15:
            cur = s.reftable.get_or_none(ref)
            cmd["expected"] = args["expected"] = None if cur is None else cur.hex()
        if rollback.stagefail_drawn(self, i, cmd):  # one rank's state fails to read (R3)
            return args, rollback.stagefail_pair(self, i, args)
        steps = preempt.preempt_drawn(self, i, cmd)
        if steps:  # a SIGTERM at a seeded moment of a manager's run of steps (P1)
            return args, preempt.preempt_run(self, s, i, steps, args)
        # Out of step (a stream of its own, seeded by the call): rank 1 skips this put and goes
        # on to the next one at once, which the worker makes as op i+1 (step + 1) on every
        # rank; without a step in a third of those (every rank must refuse both).
        odd = random.Random(f"{self.cfg['seed']}-{self.wid}-{i}-skip")
        if (self.cfg.get("skip_p", 0.0) and odd.random() < self.cfg["skip_p"] and not cmd.get("kill0")
                and i + 1 < self.cfg["ops"] and not self.cfg.get("rank_tiers")):
            nostep = odd.random() < 0.5
            cmd.update(skip=1, timeout=8)
            args.update(skipped_by=[1])
            if nostep:
                cmd["nostep"] = True
                args["nostep"] = True
            return args, self._skip_pair(s, i, ref, cmd, args, nostep)
        return args, self._cput_call(cmd, args, ref, step, spec, i)

    def _skip_pair(self, s, i, ref, cmd, args, nostep):
        """Op i, which rank 1 skips, and op i + 1, which every rank makes (step + 1): rank 1
        is in op i + 1 while rank 0 is still in op i. Op i must not be published with rank
        1's part of op i + 1 (a mix: I1 reads it back against op i's spec); op i + 1, which
        every rank made alike, must not fail as out of step (C1); without steps both are
        refused on every rank."""
        step2 = self.cfg["step_base"] + i + 1
        # The same replicated variant: what a skipping rank's next state shares with the
        # others' (a mix is told apart by its own rows alone, as in a real job).
        spec2 = dict(content.make_spec(self.wid, i + 1, cmd["spec"]["v"], step2, None), c=RANKS)
        cmd2 = {"ref": ref, "step": step2, "spec": spec2, "async": cmd["async"], "timeout": 8}
        args2 = {"ref": ref, "step": step2, "spec": spec2, "blocking": not cmd["async"], "collective": RANKS,
                 "after_skip": i}
        if nostep:
            cmd2["nostep"] = args2["nostep"] = True
        self._taken.add(i + 1)

        def call():
            self.j.write(i=i + 1, op="put", args=args2, start=time.time())
            for p in self.ranks:  # rank 1 reads "skip", then op i + 1 at once
                p.stdin.write(json.dumps(cmd) + "\n" + json.dumps(cmd2) + "\n")
                p.stdin.flush()
            first = [self._rank_line(p, 150.0) if r != 1 else {"result": "skipped"}  # (rank 1 prints nothing)
                     for r, p in enumerate(self.ranks)]
            second = [self._rank_line(p, 150.0) for p in self.ranks]
            out2 = self._collect(second, ref, step2, spec2, i + 1)
            if out2.get("root") is None and not nostep and (
                    out2.get("result") == "OutOfStep" or any(w in out2.get("error", "") for w in (
                        "disagree", "did not arrive", "out of step"))):
                out2["raw"] = True  # (I4 judges it: a call every rank made, refused as out of step)
                out2["trace"] = f"C1 op {i + 1}, made alike by every rank after a skipped one: {out2.get('error')}"
            out2.setdefault("result", "ok")
            self.j.write(i=i + 1, end=time.time(), **out2)
            out = dict(first[0])
            out["ranks"] = [o.get("result", "ok") for o in first]
            if "root" in out:
                self.puts.append({"ref": ref, "step": cmd["step"], "root": out["root"],
                                  "own": cmd["spec"].get("u", [self.wid, i])})
            return out
        return call

    def _collect(self, outs: list, ref, step, spec, i) -> dict:
        """One collective put's outcome from every rank's line: rank 0's, with what each rank
        heard, and "mismatch" where two ranks heard different outcomes."""
        heard = [o.get("result", "ok") for o in outs]  # what each rank was told (T9 judges each tier by its own)
        out = outs[0]
        out["ranks"] = heard
        out["shared_got"] = sum(o.get("shared_got", 0) for o in outs)  # (counts since each rank's Store opened)
        if any("tier_bytes" in o for o in outs):  # each rank's tier as its put returned (T13)
            out["rank_tier_bytes"] = [o.get("tier_bytes") for o in outs]
        for r, o in enumerate(outs[1:], 1):  # every rank must hear the same outcome
            if o.get("raw"):
                out.update(raw=True, trace=f"rank {r}: " + o.get("trace", ""))
            if ("root" in o) != ("root" in out) or o.get("root") != out.get("root"):
                out.setdefault("mismatch", []).append(
                    f"rank {r} heard {o.get('root') or o.get('result')}, rank 0 {out.get('root') or out.get('result')}")
        if "root" in out:
            self.puts.append({"ref": ref, "step": step, "root": out["root"], "own": spec.get("u", [self.wid, i])})
            # the put's result stays what it was (it published); check.py judges these
            mismatch = out.pop("mismatch", []) + sum((o.get("mismatch", []) for o in outs), [])
            if mismatch:
                out["mismatch"] = mismatch
        return out

    def _cput_call(self, cmd, args, ref, step, spec, i):
        def call():
            line = json.dumps(cmd) + "\n"
            for p in self.ranks:
                p.stdin.write(line)
                p.stdin.flush()
            if cmd.get("kill0"):  # rank 0 is gone; rank 1 says what it could learn, then this worker dies
                told = self._rank_line(self.ranks[1], 150.0)
                self._die_after = True
                return {"result": "OutcomeUnknown", "ranks": [None, told.get("result", "ok")],
                        "rank1": {k: str(v)[:300] for k, v in told.items()}}
            return self._collect([self._rank_line(p, 150.0) for p in self.ranks], ref, step, spec, i)
        return call

    def _rank_line(self, p, timeout: float) -> dict:
        """The next line a rank prints. A rank that died or went silent leaves the put's
        outcome unknown to this worker: it dies too (kill -9), so the journal says so
        (a start with no result), rather than guess."""
        import select
        # Read the pipe itself, with a buffer of our own: a rank may print two lines at once
        # (a put it refuses at once, then the next), and a second select() would not see
        # one that a buffered readline() already took in.
        buf = self._out.setdefault(p.pid, bytearray())
        until, r = time.monotonic() + timeout, True
        while b"\n" not in buf:
            r, _, _ = select.select([p.stdout], [], [], max(0.0, until - time.monotonic()))
            chunk = os.read(p.stdout.fileno(), 65536) if r else b""
            if not chunk:
                break
            buf += chunk
        line = ""
        if b"\n" in buf:
            i = buf.index(b"\n") + 1
            line, buf[:] = buf[:i].decode(), buf[i:]
        if not line:
            self.j.write(kill="rank", op="cput", key=f"rank pid {p.pid} {'died' if r else 'silent'}")
            os.kill(os.getpid(), signal.SIGKILL)
        return json.loads(line)

    def start_ranks(self) -> None:
        """Start this worker's ranks (before it says it is ready: torch.distributed's start
        is not the round's time). Forked from this process while it has no other thread (it
        has not opened its store yet): a rank is then the process `python -m tests.sim.ranks`
        would be without its seconds of importing torch; a plain interpreter otherwise."""
        import socket
        import threading
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        argvs = [[self.cfg_path, str(r), str(RANKS), str(port)] for r in range(RANKS)]
        if threading.active_count() == 1:
            self.ranks = []
            for a in argvs:
                self.ranks.append(_ForkedRank(a, self.ranks))
        else:
            self.ranks = [subprocess.Popen([sys.executable, "-m", "tests.sim.ranks", *a], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True) for a in argvs]
        for p in self.ranks:
            out = self._rank_line(p, 90.0)
            assert out.get("ready"), out

    def _vulture(self, s):
        """Wait (briefly) for a gc's deletion phase, then pick the own tensor of a snapshot
        retention already dropped: its blocks are that gc's candidates, being deleted now,
        and this put reuses them (the window of failures 2 and 3)."""
        until = time.time() + 2.0
        while time.time() < until and s.reftable.gc_state()["phase"] != "deleting":
            time.sleep(0.01)
        rt = s.reftable
        gone = [p["own"] for p in self.puts if rt.catalog_get(bytes.fromhex(p["root"])) is None]
        gone = gone[-3:] or self.cfg.get("reuse", [])[-3:]
        return list(self.rng.choice(gone)) if gone else None

    @staticmethod
    def _expiring(s, job: str) -> list:
        """Own-tensor ids of the job's kept, unprotected snapshots, oldest first."""
        rt = s.reftable
        protected = {r for _, r in rt.list()} | {r for _, r in rt.tags()} | rt.pins()
        rows = sorted((row.get("time", 0.0), (row.get("meta") or {}).get("sim")) for root, row in rt.catalog_iter()
                      if row.get("job") == job and root not in protected)
        return [sp.get("u", [sp["w"], sp["o"]]) for _t, sp in rows if sp]

    def _target(self):
        """A target for tag/pin/read: a ref, REF@STEP of an older own put (the ones gc
        is about to expire), or an own root."""
        r = self.rng.random()
        if self.puts and r < 0.45:
            p = self.puts[int(len(self.puts) * self.rng.random() ** 2)]  # older ones more often
            return f"{p['ref']}@{p['step']}"
        if self.puts and r < 0.7:
            return self.rng.choice(self.puts)["root"]
        return self.rng.choice(self.cfg["refs"])

    def _catalog_target(self, s) -> str:
        """A catalog writer's tag, pin or read target: any snapshot of its job in its tier, by
        its full root (the newest, not yet durable; older ones the backlog skipped; durable
        ones the budget evicted), else a ref of the job."""
        job = self.cfg["catalog"]["job"]
        rows = sorted((row.get("time", 0.0), root.hex()) for root, row in s.reftable.catalog_iter()
                      if row.get("job") == job)
        return self.rng.choice(rows)[1] if rows else self.rng.choice(self.cfg["refs"])

    def _tier_args(self, args: dict) -> dict:
        # A catalog writer's tags, pins and their removals are made in its tier (the remote's
        # follow): to the remote checks their outcome is unknown, check_tiers judges them.
        if self.cfg.get("catalog"):
            args["tier"] = os.path.basename(self.cfg["tier"])
        return args

    def op_tag(self, s, i):
        name = f"t-{self.wid}-{i}"
        target = self._catalog_target(s) if self.cfg.get("catalog") else self._target()
        return self._tier_args({"name": name, "target": target}), lambda: {"root": s.tag(name, target).root}

    def op_pin(self, s, i):
        target = self._catalog_target(s) if self.cfg.get("catalog") else self._target()

        def call():
            root = s.pin(target)
            self.pinned.append(root)
            return {"root": root}
        return self._tier_args({"target": target}), call

    def op_unpin(self, s, i):
        if self.cfg.get("catalog"):  # the tier's pins (a sharing writer's, an earlier round's too)
            pins = sorted(r.hex() for r in s.reftable.pins())
            root = self.rng.choice(pins) if pins else self._catalog_target(s)
        elif self.pinned and self.rng.random() < 0.8:
            root = self.pinned.pop(self.rng.randrange(len(self.pinned)))
        else:
            root = self._target()
        return self._tier_args({"target": root}), lambda: {"root": s.unpin(root)}

    def op_retention(self, s, i):
        job = self.rng.choice(self.cfg["jobs"])
        keep = None if self.rng.random() < 0.1 else self.rng.choice([1, 1, 2, 3])
        rule = None if keep is None else tsck.Retention(keep_last=keep)
        return {"job": job, "keep_last": keep}, lambda: (s.set_retention(job, rule), {})[1]

    def op_gc(self, s, i):
        if self.rng.random() < 0.1:  # `tsck gc` in a process of its own (slow to start: torch)
            # with a lease of the round's, so a killed one holds the lock seconds, not 120 s
            lease = self.rng.choice(self.cfg.get("gc_leases") or [self.cfg["gc_stale"]])
            return {"via": "cli", "lease": lease}, lambda: self._gc_cli(lease)
        # Each gc declares its own lease (with stale skew: one of several, so gcs and the
        # writers' own gc_lease settings all differ).
        lease = self.rng.choice(self.cfg.get("gc_leases") or [self.cfg["gc_stale"]])

        def call():
            rep = s.gc(lease=lease)
            return {"expired": rep.expired, "deleted": rep.deleted_objects, "rescued": rep.rescued,
                    "phases": rep.phases}
        return {"via": "api", "lease": lease}, call

    def _gc_cli(self, lease: float):
        st = self.cfg["store"]
        cmd = [sys.executable, "-m", "tensorstore_ck", "gc", st["url"], "--json", "--lease", str(lease)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TSCK_"))}
        if st.get("refs"):
            env["TSCK_REFS"] = st["refs"]
        if st.get("storage_options"):
            env["TSCK_STORAGE_OPTIONS"] = json.dumps(st["storage_options"])
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, preexec_fn=_die_with_parent)
        if p.returncode != 0:
            kind = "GcBusy" if "another gc" in p.stderr else "CliError"
            return {"result": kind, "error": (p.stderr or p.stdout)[-400:], "rc": p.returncode}
        rep = json.loads(p.stdout)
        return {"expired": rep.get("expired", []), "deleted": rep.get("deleted_objects")}

    def op_prune(self, s, i):
        job = self.rng.choice(self.cfg["jobs"])
        lease = self.rng.choice(self.cfg.get("gc_leases") or [self.cfg["gc_stale"]])

        def call():
            rep = s.prune(job, lease=lease)
            return {"expired": rep.expired, "deleted": rep.deleted_objects, "phases": rep.phases}
        return {"job": job, "lease": lease}, call

    # -- removals by name: delete_ref, forget, untag ------------------------------------
    def op_delete_ref(self, s, i):
        ref = self.rng.choice(self.cfg["refs"])
        args = {"ref": ref}
        if self.rng.random() < 0.5:  # conditional on the tip seen now
            cur = s.reftable.get_or_none(ref)
            args["expected"] = None if cur is None else cur.hex()[:self.rng.choice([8, 16, 64])]

        def call():
            d = s.delete_ref(ref, expected=args.get("expected"))
            return {"root": d["root"], "dropped": d["snapshots_dropped"]}
        return args, call

    def op_forget(self, s, i):
        # mostly an older own put by REF@STEP (tips, tags and pins are refused: those too)
        target = self._target() if not self.puts or self.rng.random() < 0.3 else \
            "{ref}@{step}".format(**self.puts[int(len(self.puts) * self.rng.random() ** 2)])
        return {"target": target}, lambda: {"root": s.forget(target).root}

    def op_untag(self, s, i):
        tags = [n for n, _ in s.reftable.tags()]
        name = self.rng.choice(tags) if tags else f"t-{self.wid}-none"
        return self._tier_args({"name": name}), lambda: {"root": s.untag(name)}

    def op_fsck(self, s, i):
        def call():
            rep = s.fsck(full=True)
            return {"findings": [str(f) for f in rep.findings][:20], "gc_ran": getattr(rep, "gc_ran", None),
                    "dropped_after_gc": getattr(rep, "dropped_after_gc", None)}
        return {}, call

    def op_read(self, s, i):
        target = self._target()

        # Half the reads take a part (checkout(paths=)): it must be exactly that part, under gc too.
        part = self.rng.sample(["base", "var", "own", "ids", "step", "note"], 2) if self.rng.random() < 0.5 else None

        def call():
            root = s.resolve(target)
            info = s.show(root)
            got = s.checkout(root, paths=part)
            spec = (info.meta or {}).get("sim")
            want = content.state(spec) if spec else None
            if want is not None and part is not None:
                want = {k: v for k, v in want.items() if k in part}
            diff = content.differences(got, want) if spec else ["no sim spec in meta"]
            out = {"root": root}
            if diff:
                out.update(result="mismatch", diff=diff[:5])
            return out
        return {"target": target, "paths": part}, call

    # -- the loop ---------------------------------------------------------------------
    def run_ops(self) -> int:
        cfg = self.cfg
        kw = {} if cfg.get("gc_lease") is None else {"gc_lease": cfg["gc_lease"]}
        weights = cfg["weights"]
        names = sorted(weights)
        for v in range(content.VARIANTS):  # warm the caches: the round's clock starts now
            content.state(content.make_spec(self.wid, 0, v, 0))
        if weights.get("cput"):
            self.start_ranks()  # (before the store's threads: see start_ranks)
        # Half the writers without a tier, on a store another process can open, put
        # asynchronously through a saver process (a stream of its own: the others' draws stay).
        url = cfg["store"]["url"]
        if not cfg.get("tier") and ("://" not in url or url.startswith("s3://")):
            kw["saver"] = random.Random(f"{cfg['seed']}:{self.wid}:saver").random() < 1 / 2
        elif cfg.get("tier") and cfg.get("saver"):  # the tier's uploads run in a saver process
            kw["saver"] = True
        # Small tensors packed into shared blocks by some writers (a stream of its own): packs
        # of a few of the harness's tensors, or the default (0 on a local disk, 64 MiB with a
        # tier: every small tensor of a put in one pack).
        pack = random.Random(f"{cfg['seed']}:{self.wid}:pack").choice([0, 12_288, 65_536, None])
        if pack is not None:
            kw["pack_size"] = pack
        s = open_store(cfg, self.faults, **kw)
        self.faults.gc_busy = lambda phases: s.reftable.gc_state()["phase"] in phases
        self._meet()
        deadline = time.time() + cfg["seconds"]
        # A writer ending "down": the remote storage goes away before its last 2-5 ops or
        # the last 30-50% of its time, whichever comes first (a stream of its own), so that
        # its last puts queue up in the tier unsent.
        drng = random.Random(f"{cfg['seed']}:down")
        down_at = (deadline - drng.uniform(0.3, 0.5) * cfg["seconds"], cfg["ops"] - drng.randint(2, 5)) \
            if cfg.get("tier_end") == "down" else None
        open(cfg["journal"] + ".ready", "w").close()  # the driver times its kills from here
        outage = tierops.Outage(self, s) if cfg.get("outage") else None  # the remote away for a while
        try:
            if cfg.get("catalog"):
                self._set_rules(s)
            for i in range(cfg["ops"]):
                if time.time() > deadline:
                    break
                if down_at is not None and (time.time() > down_at[0] or i >= down_at[1]) and not self.faults.down:
                    self.faults.remote_down()
                    self.j.write(i=DOWN_I, op="remote_down", args={"tier": os.path.basename(cfg["tier"])},
                                 start=time.time())
                    self.j.write(i=DOWN_I, end=time.time(), result="ok")
                if i in self._taken:
                    continue
                rollback.maybe_rollback(self, s, i)  # (a stream of its own)
                tierops.maybe_tier_op(self, s, i)  # (a stream of its own)
                if outage is not None:
                    outage.maybe_start(i)
                op = self.rng.choices(names, [weights[n] for n in names])[0]
                if i == 0 and weights.get("cput"):
                    # A collective put first: on a loaded machine a round's few seconds may
                    # otherwise end before the draw picks one (its ranks cost most to start).
                    op = "cput"
                try:
                    args, call = getattr(self, f"op_{op}")(s, i)
                except tsck.StorageError:  # choosing its arguments read the table; the network is down
                    time.sleep(0.2)
                    continue
                sim = s.storage if op in ("fsck", "gc") and args.get("via") != "cli" else None
                if isinstance(sim, SimStore):  # faults.py's `unreadable`: objects failing every read
                    args["unreadable"] = sim.arm_unreadable(op)
                self.j.write(i=i, op=JOURNAL_AS.get(op, op), args=args, start=time.time())
                try:
                    out = call() or {}
                except Exception as e:  # noqa: BLE001 - every outcome is journaled and judged
                    out = _err(e)
                finally:
                    if isinstance(sim, SimStore):
                        sim.disarm_unreadable()
                out.setdefault("result", "ok")
                self.j.write(i=i, end=time.time(), **out)
                self._upload_stopped |= op == "durable" and out["result"] != "ok"
                if op == "put" and out["result"] == "ok" and cfg.get("catalog"):
                    self._prune_after_put(s, i)
                if self._die_after:  # its ranks' group is broken: as torchrun would
                    self.j.write(kill="rank", op="cput", key="rank 0 killed itself publishing (planned)")
                    os.kill(os.getpid(), signal.SIGKILL)
                if op == "cput":
                    rollback.maybe_crestore(self, s, i, args, out)  # (a stream of its own)
                time.sleep(self.rng.random() * cfg.get("pause", 0.05))
            if outage is not None:  # the remote back: the uploads must resume (T22)
                outage.finish(s)
        finally:
            if cfg.get("tier"):
                self._close_tier(s)
            self.faults.armed = False
            try:
                s.close()
            except tsck.StorageError:  # its last writes' tokens are swept later
                pass
            for p in self.ranks:  # EOF on stdin: each rank closes its Store and exits
                p.stdin.close()
            for p in self.ranks:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        return 0

    def _meet(self) -> None:
        """cfg["meet"] {"path", "n"}: the round's workers start their operations together
        (a process's start takes seconds on a loaded host, a round a few; two writers sharing
        a tier must overlap, the collective puts' ranks start slowest): each says it is
        open, then waits for the others, at most MEET_WAIT (one killed or stuck meanwhile
        is not waited for)."""
        meet = self.cfg.get("meet")
        if not meet:
            return
        open(f"{meet['path']}.{self.wid}", "w").close()
        folder, name = os.path.split(meet["path"])
        until = time.time() + MEET_WAIT
        while time.time() < until and sum(f.startswith(name + ".") for f in os.listdir(folder)) < meet["n"]:
            time.sleep(0.02)

    def _close_tier(self, s) -> None:
        """How a writer with a local tier ends (seeded, cfg["tier_end"]): "close" finishes
        its uploads in close(), kill points still armed; "wait" waits a while for them
        (wait_durable), then closes; "kill" dies with its uploads queued (kill -9): the
        next worker that opens this tier resumes them; "down": the remote storage refuses
        every request from now on (faults.py `down`) and close(timeout=) is timed: it must
        end within its bound and, with uploads left, say with a SnapshotWarning that they
        stay queued (T16); the next worker that opens the tier resumes them. Journaled as
        op "close". A catalog writer whose close() returned then looks at what its job
        keeps (op "kept", T12)."""
        end = self.cfg.get("tier_end", "close")
        i = self.cfg["ops"] + 1
        tier = os.path.basename(self.cfg["tier"])
        self._journaled(i + 2, "uploader", {"tier": tier}, lambda: self._uploader_state(s))
        if end == "kill":
            self.j.write(kill="end", op="close", key="uploads left queued")
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)
        if end == "down":
            self._close_down(s, i)
            return
        if end == "wait":
            args, call = self.op_durable(s, i - 1)
            self._journaled(i - 1, "durable", args, call)
        kept = self._kept_here(s) if self.cfg.get("catalog") else None
        out = self._journaled(i, "close", {"tier": tier}, lambda: self._close_said(s))
        # (an uploader stopped on a failure that wait_durable() raised: close() says nothing more;
        # a close that says uploads stay queued stopped waiting at a failed attempt)
        if kept is not None and out["result"] == "ok" and not self._upload_stopped and not out.get("stays_queued"):
            self.faults.armed = False  # a look, not a fault window
            self._journaled(i + 1, "kept", {"tier": tier, "job": self.cfg["catalog"]["job"], "before": sorted(kept)},
                            lambda: self._kept_remote(kept))

    @staticmethod
    def _close_said(s) -> dict:
        """close(), and whether it said with a SnapshotWarning that uploads stay queued (an
        upload attempt failed while it waited, Uploader.drain, or, in a shared tier, the
        other process's): then it is no clean close, and T12 does not judge it."""
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            s.close()
        for w in ws:  # still in the worker's log
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        said = [str(w.message) for w in ws if issubclass(w.category, tsck.SnapshotWarning)]
        return {"fences": FENCES.n, "stays_queued": any("stay queued" in m for m in said)}

    @staticmethod
    def _uploader_state(s) -> dict:
        """As a tier writer ends, however it ends: the failure that stopped its uploader,
        if one did (T14: an uploader stops on damage only where a worker did damage), and
        how many of its uploads found their copy taken by another process (GONE)."""
        e = s._tier.uploader.error
        return {"stopped": type(e).__name__ if e is not None else None, "error": str(e)[:400] if e else None,
                "gone": GONE.n}

    def _close_down(self, s, i: int) -> None:
        """close(timeout=) with the remote storage refusing every request (T16)."""
        timeout = self.rng.choice(CLOSE_DOWN_TIMEOUTS)
        tier = os.path.basename(self.cfg["tier"])

        def call():
            self.faults.remote_down()  # (already, unless the writer's ops ended first)
            queued = s._tier.uploader.queued()
            stopped = s._tier.uploader.error is not None  # stopped on damage: raised, not warned
            out = {}
            with warnings.catch_warnings(record=True) as ws:
                warnings.simplefilter("always")
                t0 = time.monotonic()
                try:
                    s.close(timeout=timeout)
                except Exception as e:  # noqa: BLE001 - judged by check.py (T7, T14), timed here (T16)
                    out = _err(e)
                took = time.monotonic() - t0
            said = [str(w.message) for w in ws if issubclass(w.category, tsck.SnapshotWarning)]
            return dict(out, took=round(took, 3), queued_before=queued, fences=FENCES.n, stopped=stopped,
                        pg=self.faults.pg_how,
                        stays_queued=any("stay queued" in m for m in said), warnings=said[:3])
        self._journaled(i, "close", {"tier": tier, "down": True, "timeout": timeout,
                                     "sharing": self.cfg.get("sharing", 1)}, call)

    # -- a writer with a job of its own in its tier (cfg["catalog"]) ----------------------
    def _set_rules(self, s) -> None:
        """The job's retention, set first (both tiers' tables), as a CheckpointManager's
        keep= sets it; keep_best by a metric every put carries ("loss"), so the job has a best."""
        cat = self.cfg["catalog"]
        rule = {"keep_last": cat["keep_last"]}
        if cat.get("keep_best"):
            rule.update(keep_best=cat["keep_best"], metric="loss")
        args = dict(rule, job=cat["job"], tier=os.path.basename(self.cfg["tier"]))
        self._journaled(CAT_I, "retention", args, lambda: (s.set_retention(cat["job"], tsck.Retention(**rule)), {})[1])

    def _prune_after_put(self, s, i: int) -> None:
        """The job pruned after most puts, as CheckpointManager does after each snapshot:
        what the rules drop leaves the tier while its uploads may lag behind."""
        if self.rng.random() >= 0.75:
            return
        job = self.cfg["catalog"]["job"]
        lease = self.rng.choice(self.cfg.get("gc_leases") or [self.cfg["gc_stale"]])

        def call():
            rep = s.prune(job, lease=lease)
            return {"expired": rep.expired, "deleted": rep.deleted_objects, "phases": rep.phases}
        self._journaled(CAT_I + 1 + i, "prune", {"job": job, "lease": lease, "tier": os.path.basename(self.cfg["tier"])},
                        call)

    def _kept_here(self, s) -> set[str]:
        """What the tier keeps of the job now (its rules, tags, pins, ref tips, the upload
        in progress), before close() finishes the uploads."""
        from tensorstore_ck.maintain.gc import retention_plan
        job = self.cfg["catalog"]["job"]
        try:
            plan = retention_plan(s.core, s.reftable.wall_now())
        except tsck.TsckError:
            return set()
        return {d["root"].hex() for d in plan if d["keep"] and d["job"] == job}

    def _kept_remote(self, before: set[str]) -> dict:
        """After a clean close(): of what the tier kept before it, what the job still keeps
        over both tiers (check.kept_over_tiers) must be in the remote catalog."""
        from . import check
        job = self.cfg["catalog"]["job"]
        with tsck.open_store(self.cfg["tier"], create=False) as t, open_store(dict(self.cfg, tier=None), None) as r:
            now = check.kept_over_tiers(t, r, job)
            remote = {root.hex() for root, _ in r.reftable.catalog_iter()}
            pinned = {root.hex() for root in t.reftable.pins()}
        both = sorted(before & now)
        missing = [x for x in both if x not in remote]
        return {"kept": len(both), "not_remote": missing, "pinned": [x for x in missing if x in pinned]}

    def _journaled(self, i: int, op: str, args: dict, call) -> dict:
        self.j.write(i=i, op=op, args=args, start=time.time())
        try:
            out = call() or {}
        except Exception as e:  # noqa: BLE001 - judged by check.py
            out = _err(e)
        out.setdefault("result", "ok")
        self.j.write(i=i, end=time.time(), **out)
        return out

    def run_recover(self) -> int:
        s = open_store(self.cfg, self.faults, create_refs=True)
        if self.kill_auto:  # somewhere in its ref-table writes: catalog rows, then ref moves
            n = sum(1 for _ in s.assets.list_objects("commits"))
            self.faults.kill_on = {"ref-write"}  # one catalog row per commit, then the ref moves
            self.faults.kill_at = self.faults.kill_points + 1 + self.rng.randrange(max(1, 2 * n))
        self.j.write(i=0, op="recover", args={"kill_at": self.faults.kill_at}, start=time.time())
        try:
            rep = self._recover_once(s)
            out = {"result": "ok", "refs_restored": rep.refs_restored, "tags_restored": rep.tags_restored,
                   "catalog_rows_added": rep.catalog_rows_added, "skipped": len(rep.skipped)}
        except Exception as e:  # noqa: BLE001
            out = _err(e)
        self.j.write(i=0, end=time.time(), **out)
        self.faults.armed = False
        s.close()
        return 0

    def _recover_once(self, s):
        """s.recover(); beside running workers ("wait" in the config, seconds), a gc that
        holds the store makes recover refuse (GcBusy): tried again, as an operator would."""
        until = time.time() + float(self.cfg.get("wait") or 0.0)
        while True:
            try:
                return s.recover()
            except tsck.GcBusy:
                if time.time() >= until:
                    raise
                time.sleep(0.1)


class _ForkedRank:
    """A rank (tests/sim/ranks.py main(argv)) in a fork of this worker, with Popen's surface
    the worker uses: pid, stdin (text), stdout (read by its fd), poll, wait, kill. It ends
    as an interpreter does (non-daemon threads joined, atexit handlers run, streams
    flushed), without the worker's own atexit handlers."""

    def __init__(self, argv: list, earlier: list) -> None:
        r0, w0 = os.pipe()
        r1, w1 = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.dup2(r0, 0)
                os.dup2(w1, 1)
                for fd in (r0, w0, r1, w1):
                    os.close(fd)
                for other in earlier:  # an earlier rank's stdin must reach EOF when the worker closes it
                    other.stdin.close()
                    other.stdout.close()
                import atexit
                atexit._clear()
                # what a fresh interpreter's tensorstore_ck has (Worker.__init__ draws its own)
                tsck_gc.PHASE_OBJECTS, tsck_gc.PHASE_SECONDS = _GC_PHASES
                sys.stdin = open(0, "r", closefd=False)
                sys.stdout = open(1, "w", closefd=False)
                from . import ranks
                code = ranks.main(argv) or 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - as an interpreter prints it
                traceback.print_exc()
            finally:
                import atexit
                import threading
                try:
                    threading._shutdown()
                    atexit._run_exitfuncs()
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        os.close(r0)
        os.close(w1)
        self.pid, self.returncode = pid, None
        self.stdin = open(w0, "w")
        self.stdout = open(r1, "rb", buffering=0)

    def poll(self):
        if self.returncode is None:
            done, sts = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(sts)
        return self.returncode

    def wait(self, timeout: float | None = None):
        until = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if until is not None and time.monotonic() > until:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The driver's kill of a stuck worker is preceded by SIGUSR1: its threads' stacks go to
    # its .err, which says where it hung.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    with open(argv[0]) as f:
        cfg = json.load(f)
    w = Worker(cfg, argv[0])
    return w.run_recover() if cfg["role"] == "recover" else w.run_ops()


if __name__ == "__main__":
    sys.exit(main())
