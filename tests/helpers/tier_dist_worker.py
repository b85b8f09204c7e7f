"""Collective snapshots through local tiers, for tests/tier/test_tier_dist.py.

    python tier_dist_worker.py SCENARIO OUTDIR CONFIG.json

CONFIG: {"url": remote store URL, "opts": storage_options, "refs": the remote ref table,
"world": W, ...}. Every rank opens `open_store(url, refs=..., local=TIERS/<tier><rank>)`
(one local directory per rank under CONFIG's "tiers", standing for one node each), the remote storage wrapped by
a recorder of the keys read there. Ranks write OUTDIR/<phase>_rank<r>.json (roots, durable
flags, remote keys read) and OUTDIR/<phase>_rank<r>.pt (what a checkout returned); the
test judges against the data definitions of dist_worker.py.
"""

from __future__ import annotations

import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_worker as dw  # noqa: E402  (the launcher and the shared state definitions)
from dist_worker import launcher_main  # noqa: E402
import torch  # noqa: E402

REF = dw.REF


def _reads_class():
    from _util import Watched  # (tests/ is on sys.path: dist_worker puts it there)

    class Reads(Watched):
        """Records every object key read from the remote store (blocks, nodes, commits)."""

        def __init__(self, inner):
            super().__init__(inner)
            self.lock = threading.Lock()
            self.reads: list[str] = []

        def on_read(self, key):
            if key.split("/", 1)[0] in ("blocks", "nodes", "commits"):
                with self.lock:
                    self.reads.append(key)
    return Reads


def _open(cfg, out, rank, tier, holder, **kw):
    import tensorstore_ck as tsck
    if cfg.get("nodes"):  # nodes simulated on this host: rank r on node cfg["nodes"][r] (placement.this_node)
        os.environ["TSCK_NODE"] = cfg["nodes"][rank]
    if cfg.get("fan"):  # rank-tree nodes of cfg["fan"] ranks: several leaves in a small world
        import tensorstore_ck.format.world as worldfmt
        worldfmt.FAN = cfg["fan"]
    Reads = _reads_class()
    if cfg.get("gate"):  # every remote write waits until the file cfg["gate"] exists
        import time

        class Reads(Reads):  # noqa: F811
            def on_write(self, key):
                while not os.path.exists(cfg["gate"]):
                    time.sleep(0.05)
    # cfg["tier_of"][r]: the tier rank r opens (a restart whose ranks' numbers changed: a
    # node's i-th rank opens the tier its i-th rank had, as memory=True names them)
    where = os.path.join(cfg["tiers"], f"{tier}{(cfg.get('tier_of') or range(rank + 1))[rank]}")
    place = {"memory": where} if cfg.get("memory") else {"local": where}  # (memory: cfg["tiers"] on a tmpfs)
    if cfg.get("durable_every"):
        place["durable_every"] = cfg["durable_every"]
    return tsck.open_store(cfg["url"], refs=cfg["refs"], storage_options=cfg["opts"], **place, block_size=dw.BLOCK,
                           inline_threshold=dw.INLINE, wrap_storage=lambda s: holder.setdefault("w", Reads(s)), **kw)


def _with_replicated(st: dict) -> dict:
    """A rank's state with Replicated tensors of many blocks: each rank writes only the
    blocks it owns, and its part's nodes name them all (the others' too)."""
    import tensorstore_ck as tsck
    st["rep"] = {k: tsck.Replicated(v) for k, v in dw.replicated_tensors().items()}
    return st


def put_body(rank, world, out, res, cfg):
    """Two collective puts through the tiers (versions 0 and 1), then wait until durable."""
    holder: dict = {}
    with _open(cfg, out, rank, "tier", holder) as store:
        infos = [store.put_snapshot(_with_replicated(dw.sharded_state(rank, world, v)), REF, step=v + 1, timeout=60)
                 for v in (0, 1)]
        res["roots"] = [i.root for i in infos]
        res["durable_at_return"] = [i.durable for i in infos]
        res["waited"] = store.wait_durable(timeout=240)
        res["durable_after"] = store.show(infos[-1].root).durable if rank == 0 else None
        res["queue_left"] = len(store.core.refs.tier_rows.upload_pending())
        # Aborted after every rank said "done" (the replicas disagree): no rank's tier
        # keeps an intent to upload its part, nothing is queued.
        import tensorstore_ck as tsck
        bad = {"w": tsck.Replicated(torch.full((dw.BLOCK // 2,), float(rank)))}
        try:
            store.put_snapshot(bad, REF, step=3, timeout=60)
            res["disagree"] = "returned"
        except tsck.errors.SnapshotAborted as e:
            res["disagree"] = "SnapshotAborted: " + str(e)
        res["intents_after_abort"] = len(store.core.refs.tier_rows.intents())
        res["queue_after_abort"] = len(store.core.refs.tier_rows.upload_pending())
        # Then puts in a row: the keys each left in the c10d Store (rank 0 posts one for
        # every 16 ranks through tiers: its path down the rank tree) must not pile up.
        import torch.distributed as dist
        kv = dist.distributed_c10d._get_default_store()
        for v in range(4, 20):
            store.put_snapshot({"x": torch.full((4,), float(v))}, "keys/main", step=v, timeout=60)
            dist.barrier()
            res.setdefault("keys", []).append(kv.num_keys())


def _storage_opened(s) -> bool:
    """Whether the remote storage under wrapper `s` was opened: a lazily opened one
    (tier.opening.LazyStorage) says so; any other was opened with the store."""
    while s is not None:
        if type(s).__name__ == "LazyStorage":
            return s.opened
        s = getattr(s, "inner", None)
    return True


def _checkout_rows(store, rank, world, holder, res, cfg, out) -> None:
    """A collective checkout of REF into this rank's rows of each sharded tensor; what it
    read from the remote goes to res, what it got to OUT/<phase>_rank<r>.pt."""
    import tensorstore_ck as tsck
    into: dict = {}
    for path, (rows, cols, dtype) in dw.SHARDED.items():
        a, b = dw.row_split(rows, world, rank)
        dw._set(into, path, tsck.Sharded(torch.zeros(b - a, cols, dtype=dtype), (rows, cols), (a, 0)))
    into["local"] = None
    got = store.checkout(REF, into=into, timeout=60)
    res["remote_reads"] = list(holder["w"].reads)
    res["remote_opened"] = _storage_opened(holder["w"])
    dump = {"sharded": {"/".join(p): dw.get_path(got, p).local for p in dw.SHARDED}, "local": got["local"]}
    torch.save(dump, os.path.join(out, f"{cfg['phase']}_rank{rank}.pt"))


def load_body(rank, world, out, res, cfg):
    """A collective checkout of REF into this rank's view, through tier `cfg["tier"]`."""
    holder: dict = {}
    with _open(cfg, out, rank, cfg["tier"], holder) as store:
        _checkout_rows(store, rank, world, holder, res, cfg, out)


def manager_body(rank, world, out, res, cfg):
    """CheckpointManager unchanged over a tiered store (asynchronous collective snapshots,
    retention): cfg["mode"] "train" takes snapshots at steps 2, 4, 6 and closes (close()
    waits for the uploads); "resume" restores the latest through tier cfg["tier"]."""
    import tensorstore_ck as tsck
    import ddp_manager as dm
    holder: dict = {}
    with _open(cfg, out, rank, cfg["tier"], holder) as store:
        model, opt = dm._model_and_opt()
        mgr = tsck.CheckpointManager(store, job=dm.JOB, state=tsck.TrainState(model=model, optimizer=opt),
                                     every_steps=2, retention=tsck.Retention(keep_last=cfg.get("keep", 2)))
        if cfg["mode"] == "train":
            steps = {}
            for step in range(1, 7):
                dm._train_step(model, opt, rank, step)
                steps[step] = mgr.step(step)
            if cfg.get("gate"):  # uploads held until every snapshot was taken (and rank 0 pruned)
                import torch.distributed as dist
                store.wait()
                dist.barrier()
                if rank == 0:
                    mgr._pruner.wait()
                    open(cfg["gate"], "w").close()
            mgr.close()
            res["steps"] = dm._roots(steps)
            res.update(dm._counters(mgr))
        else:
            res["start"] = mgr.restore_latest()
            res["remote_reads"] = list(holder["w"].reads)
            mgr.close()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                   os.path.join(out, f"{cfg['phase']}_rank{rank}.pt"))


class _HoldGc:
    """Hold the gc lock of `store`'s tier from a thread, from now until after done(): until
    its uploader's cleanup met the lock once more after that (Uploader.tidy_busy: "met"),
    or has no word of rank 0 left to apply ("idle": nothing to drop met the lock, or a
    word was lost), at most 120 s ("timeout"). `result` says which."""

    def __init__(self, store):
        import threading
        self.up, self.core, self.result = store._tier.uploader, store._tier.core, None
        self._done, self._busy_at_done = threading.Event(), 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _state(self):
        if not self._done.is_set():
            return None
        if self.up.tidy_busy > self._busy_at_done:
            return "met"
        return "idle" if not self.up._follow and not self.up._tidying else None

    def _run(self):
        import time

        import tensorstore_ck as tsck
        from tensorstore_ck.maintain.lease import holding_gc_lock
        until = time.monotonic() + 120
        while True:
            try:  # (the uploader's own cleanup may hold the lock this moment)
                with holding_gc_lock(self.core, lease=30.0, role="test:"):
                    while time.monotonic() < until and self._state() is None:
                        time.sleep(0.02)
                    self.result = self._state() or "timeout"
                return
            except tsck.GcBusy:
                if time.monotonic() > until:
                    self.result = "lock not taken in 120 s"
                    return
                time.sleep(0.02)

    def done(self):
        self._busy_at_done = self.up.tidy_busy
        self._done.set()
        self._thread.join()


def tidy_body(rank, world, out, res, cfg):
    """CheckpointManager (a snapshot every step, keep_last=cfg["keep"], replicas=1) over
    tiers for cfg["steps"] steps; close() waits for the uploads and rank 0's prune. Then
    each rank's tier, opened as a store of its own, as an operator would: its catalog, its
    objects, fsck, gc."""
    import logging

    import tensorstore_ck as tsck
    import ddp_manager as dm
    import torch.distributed as dist
    said = res["said"] = []

    class Said(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())
    logging.getLogger("tensorstore_ck").addHandler(Said(logging.INFO))
    logging.getLogger("tensorstore_ck").setLevel(logging.INFO)
    holder: dict = {}
    with _open(cfg, out, rank, "tier", holder, replicas=1) as store:
        up, words = store._tier.uploader, {}
        follow = up.follow

        def heard(job, keep):  # rank 0's last word, as this rank's uploader got it
            words[job] = sorted(r.hex() for r in keep)
            return follow(job, keep)
        up.follow = heard
        if rank == cfg.get("lag_rank"):
            # Its uploads lag behind the puts and its cleanup runs after each one, with its
            # older parts still queued: the last word must outlast them.
            import time

            from tensorstore_ck.tier import uploader
            uploader.TIDY_EVERY = 1
            upload = up._upload

            def lagging(seq, entry):
                time.sleep(0.3)
                return upload(seq, entry)
            up._upload = lagging
        model, opt = dm._model_and_opt()
        mgr = tsck.CheckpointManager(store, job=dm.JOB, state=tsck.TrainState(model=model, optimizer=opt),
                                     every_steps=1, retention=tsck.Retention(keep_last=cfg["keep"]))
        steps = {}
        held = None
        for step in range(1, cfg["steps"] + 1):
            if step == cfg["steps"] and rank == 1:
                # rank 0's last word reaches this rank while a gc holds its tier (its own
                # gc, or another process's sharing it): the word must outlast that gc
                held = _HoldGc(store)
            dm._train_step(model, opt, rank, step)
            steps[step] = mgr.step(step)
        mgr.close()
        if held is not None:
            held.done()
            res["held"] = held.result
        res["waited"] = store.wait_durable(timeout=240)
        res["steps"] = dm._roots(steps)
        res["tidied"] = store._tier.uploader.tidied
        res["word"] = words.get(dm.JOB)
        torch.save({"model": model.state_dict()}, os.path.join(out, f"tidy_rank{rank}.pt"))
        dist.barrier()  # (no rank closes its peer server while another still sends to it)
    tier = os.path.join(cfg["tiers"], f"tier{rank}")
    with tsck.open_store(tier) as t:
        res["rows"] = sorted(r.hex() for r in t.core.refs.catalog_roots())
        res["parts"] = len(t.core.refs.tier_rows.parts())
        rep = t.fsck(full=True)
        res["fsck"] = [str(f) for f in rep.findings]
        res["orphans"] = rep.orphans
        res["objects"] = len(_objects(tier))
        res["gc"], lost = _gc(t, tier)
        res["gc_deleted"] = len(lost)
        res["rows_after_gc"] = sorted(r.hex() for r in t.core.refs.catalog_roots())
        res["fsck_after_gc"] = [str(f) for f in t.fsck(full=True).findings]


def many_tensors(rank: int, version: int, n: int) -> dict:
    """n tensors of one block each (4 KiB), each the rank's and version's own: a put packs
    them (a tier's pack size is an object store's) into one block of n x 4 KiB."""
    g = torch.Generator().manual_seed(rank * 1000 + version)  # (random: the pack does not compress)
    return {f"t{i}": torch.randn(1024, generator=g) for i in range(n)}


def rput_body(rank, world, out, res, cfg):
    """Two collective puts with replicas=cfg["replicas"]; every rank waits until durable
    (its replicas sent first), then a barrier: no rank closes its peer server while
    another still sends to it."""
    import torch.distributed as dist
    holder: dict = {}
    def state(v: int) -> dict:
        st = dw.sharded_state(rank, world, v)
        if cfg.get("many"):  # small tensors, packed into one block past the block size
            st["local"]["many"] = many_tensors(rank, v, cfg["many"])
        return st
    with _open(cfg, out, rank, "tier", holder, replicas=cfg["replicas"]) as store:
        infos = [store.put_snapshot(state(0), REF, step=1, timeout=60)]
        if cfg.get("deaf") is not None:  # rank cfg["deaf"]'s peer server stops listening: copies to it fail
            store._tier.peers.wait()
            dist.barrier()
            if rank == cfg["deaf"]:
                import socket
                store._tier.peers._sock.shutdown(socket.SHUT_RDWR)
            dist.barrier()
        for v in range(1, cfg.get("puts", 2)):
            infos.append(store.put_snapshot(state(v), REF, step=v + 1, timeout=60))
        res["roots"] = [i.root for i in infos]
        res["placed"] = infos[-1].meta.get("nodes")  # (the commit's record of each rank's node)
        res["tier_only"] = [bool(i.meta.get("tier_only")) for i in infos]
        res["sent_at_return"] = store._tier.peers.sent  # (a tier-only put returns once its copies are sent)
        if cfg.get("durable_every") and rank == 0:  # a tag on the tier-only tip: refused, nothing tagged
            import tensorstore_ck as tsck
            try:
                store.tag("keep", REF)
                res["tag"] = "made"
            except tsck.InvalidArgument as e:
                res["tag"] = f"refused: {e}"
            res["tags"] = sorted(store.reftable.tags())
        res["waited"] = store.wait_durable(timeout=240)
        res["rows"] = sorted(r.hex() for r in store.core.refs.catalog_roots())  # (its tier's, after the cleanups)
        res["sent"], res["refused"] = store._tier.peers.sent, store._tier.peers.refused
        dist.barrier()
        # A gc of each rank's own tier keeps its part and the replicas it holds.
        res["gc"], res["gc_lost"] = _gc(store, os.path.join(cfg["tiers"], f"tier{rank}"))


def heldmove_body(rank, world, out, res, cfg):
    """durable_every=2: step 1 durable, step 2 tier-only, step 3 durable, with rank 0's
    move of the remote ref to step 3 held (its uploader waits at the move until every
    other rank looked). The other ranks send their parts of step 3 (each marks its part
    durable), then each one's memory tier drops what a newer snapshot stands in for (as
    a lean still due from step 2's commit would run then): res["held"] is its tier's rows
    then. After the release, res["rows"]: its rows once rank 0 moved the ref."""
    import threading

    import torch.distributed as dist
    release = threading.Event()
    with _open(cfg, out, rank, "tier", {}, replicas=cfg["replicas"]) as store:
        infos = [store.put_snapshot(dw.sharded_state(rank, world, 0), REF, step=1, timeout=60)]
        store.wait_durable(timeout=120)
        dist.barrier()
        up = store._tier.uploader
        if rank == 0:
            real = up.publisher.move_to

            def held(*a, **k):
                release.wait(180)
                return real(*a, **k)
            up.publisher.move_to = held
        for v in (1, 2):
            infos.append(store.put_snapshot(dw.sharded_state(rank, world, v), REF, step=v + 1, timeout=60))
        res["roots"] = [i.root for i in infos]
        res["tier_only"] = [bool(i.meta.get("tier_only")) for i in infos]
        if rank != 0:
            store.wait_durable(timeout=120)  # (its part of step 3 sent and marked durable)
            up.lean_due()
            store.wait_durable(timeout=120)  # (the lean done)
            res["held"] = sorted(r.hex() for r in store.core.refs.catalog_roots())
        dist.barrier()
        release.set()
        res["waited"] = store.wait_durable(timeout=240)
        dist.barrier()
        res["rows"] = sorted(r.hex() for r in store.core.refs.catalog_roots())


class _Part:
    """A rank's state for a CheckpointManager: one tensor of several blocks, its own."""

    def __init__(self):
        self.t = torch.zeros(3 * dw.BLOCK // 4)

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, sd):
        self.t.copy_(sd["t"])


def _part_at(rank: int, step: int):
    return torch.randn(3 * dw.BLOCK // 4, generator=torch.Generator().manual_seed(rank * 1000 + step))


def noremote_body(rank, world, out, res, cfg):
    """A CheckpointManager (synchronous, a snapshot each step) over memory tiers with
    replicas. cfg["mode"] "train": rank 0's moves of the remote ref all fail (its remote
    ref table away for it alone), so the remote lists nothing of the job's ref; steps 1
    (durable by the schedule, never moved) and 2 (tier-only, its copies agreed) are put.
    cfg["moves"]: rank 0's moves go through (step 1 reaches the remote). cfg["cut"]: the
    ranks whose part of a step 3 (tier-only) neither reaches a holder nor the remote
    (their node cut off from the others and the remote as the step is put: their copies'
    sends fail, and so does every upload of theirs after), so step 3 is whole nowhere
    once their node is lost, and step 2 stays in the tiers (nothing newer stands in).
    cfg["steps"]: the steps put instead, after restore_latest (a later run of the job).
    "resume": the tiers of the ranks cfg["lost"] removed (their node lost), the blocks of
    those of cfg["damaged"] damaged, restore_latest. "rollback": restore(cfg["to"]) instead."""
    import shutil

    import torch.distributed as dist
    import tensorstore_ck as tsck
    if cfg["mode"] == "resume" and rank in cfg["lost"]:
        shutil.rmtree(os.path.join(cfg["tiers"], f"tier{rank}"))
    if cfg["mode"] == "resume" and rank in cfg.get("damaged", []):  # every block its tier holds, a byte flipped
        _damage_blocks(os.path.join(cfg["tiers"], f"tier{rank}"))
    dist.barrier()  # (every loss before any rank opens: a lost tier must not serve the old copies)
    with _open(cfg, out, rank, "tier", {}, replicas=1) as store:
        part = _Part()
        mgr = tsck.CheckpointManager(store, job="nr", state=tsck.TrainState(part=part), every_steps=1, async_=False,
                                     timeout=60)
        if cfg["mode"] == "train":
            if rank == 0 and not cfg.get("moves"):
                def away(*a, **k):
                    raise tsck.StorageError("the remote ref table is away (for rank 0, in this test)")
                store._tier.uploader.publisher.move_to = away
            if cfg.get("steps"):  # (a later run resumes first)
                res["restored"] = mgr.restore_latest()
            for step in cfg.get("steps") or ((1, 2, 3) if cfg.get("cut") else (1, 2)):
                if step == 3 and rank in cfg.get("cut", ()):
                    _cut_off(store)
                part.t.copy_(_part_at(rank, step))
                mgr.step(step)
            if rank == 0:  # (the others' tiers keep their parts' rows, not the ref)
                res["tier_only"] = [bool(h.meta.get("tier_only")) for h in store.log(mgr.ref)][::-1]
            if rank not in cfg.get("cut", ()) and (rank != 0 or cfg.get("moves")):
                store.wait_durable(timeout=120)  # (its part of step 1 sent: the remote has objects, no ref)
            dist.barrier()
            mgr.close()
            store.close(timeout=5)
        else:
            if rank == 0:  # (what log() lists before the restore: the history of the newer tip)
                try:
                    res["log"] = [h.step for h in store.log(mgr.ref)]
                except tsck.RefNotFound:
                    res["log"] = None
            if cfg["mode"] == "rollback":  # restore(cfg["to"]): the ref moves back to it
                res["restored"] = mgr.restore(cfg["to"])
            else:
                res["restored"] = mgr.restore_latest()
            res["exact"] = bool(res["restored"] is not None and torch.equal(part.t, _part_at(rank, res["restored"])))
            dist.barrier()


def _cut_off(store) -> None:
    """This rank's node cut off from the other nodes and the remote store from now on:
    its part's copies are not sent (the send fails), nor is anything it uploads."""
    from concurrent.futures import Future

    import tensorstore_ck as tsck

    def no_copies(root, tree):
        f = Future()
        f.set_exception(tsck.StorageError("the other nodes are unreachable (this rank's node cut off, in this test)"))
        return f

    def away(*a, **k):
        raise tsck.StorageError("the remote store is unreachable (this rank's node cut off, in this test)")
    store._tier.peers.replicate = no_copies
    store._tier.uploader._upload = away


def twostores_body(rank, world, out, res, cfg):
    """Two tiered stores with replicas=1 in each rank (remotes A and B), both joined to the
    job's side channel before either sends a copy; then a collective put into A. Each rank
    lists the blocks of its tiers A and B."""
    import torch.distributed as dist
    import tensorstore_ck as tsck
    stores = {n: tsck.open_store(os.path.join(cfg["tiers"], f"remote{n}"),
                                 local=os.path.join(cfg["tiers"], f"{n}{rank}"), replicas=1, block_size=dw.BLOCK,
                                 inline_threshold=dw.INLINE) for n in "AB"}
    try:
        for n in "AB":  # (as a first collective call of each does)
            assert stores[n]._tier.peers.join()
        dist.barrier()
        stores["A"].put_snapshot(dw.sharded_state(rank, world, 0), REF, step=1, timeout=60)
        stores["A"]._tier.peers.wait()
        dist.barrier()
        res["blocks"] = {n: sorted(_blocks_of(os.path.join(cfg["tiers"], f"{n}{rank}"))) for n in "AB"}
        dist.barrier()
    finally:
        for s in stores.values():
            s.close()


def _blocks_of(tier: str) -> set:
    return {f for _d, _s, fs in os.walk(os.path.join(tier, "blocks")) for f in fs}


def _gc(store, tier: str) -> tuple[str, list]:
    """store.gc() -> ("ran" or its error, the object files of `tier` it removed)."""
    before = _objects(tier)
    try:
        store.gc()
        ran = "ran"
    except Exception as e:  # noqa: BLE001 - judged by the test
        ran = f"{type(e).__name__}: {e}"
    return ran, sorted(before - _objects(tier))


def _objects(tier: str) -> set:
    return {os.path.relpath(os.path.join(d, f), tier) for kind in ("blocks", "nodes", "commits")
            for d, _s, fs in os.walk(os.path.join(tier, kind)) for f in fs}


def _damage_blocks(tier: str) -> None:
    """Every block file under `tier`, its last byte flipped."""
    for d, _s, fs in os.walk(os.path.join(tier, "blocks")):
        for f in fs:
            path = os.path.join(d, f)
            os.chmod(path, 0o644)
            with open(path, "r+b") as fh:
                fh.seek(-1, os.SEEK_END)
                last = fh.read(1)
                fh.seek(-1, os.SEEK_END)
                fh.write(bytes([last[0] ^ 1]))


def rload_body(rank, world, out, res, cfg):
    """The job restarted after the nodes of cfg["lost"] lost their tiers (removed here,
    before the store opens): a collective checkout with replicas."""
    import shutil

    import torch.distributed as dist
    if rank in cfg["lost"]:
        shutil.rmtree(os.path.join(cfg["tiers"], f"tier{rank}"))
    if rank in cfg.get("damaged", []):  # every block this node's tier holds, its last byte flipped
        _damage_blocks(os.path.join(cfg["tiers"], f"tier{rank}"))
    dist.barrier()  # (every loss before any rank reads: a lost tier must not serve the old copies)
    import logging
    sources = res["sources"] = []

    class Restored(logging.Handler):  # the checkout's INFO line: where this rank read from
        def emit(self, record):
            if getattr(record, "tsck", {}).get("event") == "restored":
                sources.append(record.tsck["source"])
    logging.getLogger("tensorstore_ck").addHandler(Restored(logging.INFO))
    logging.getLogger("tensorstore_ck").setLevel(logging.INFO)
    holder: dict = {}
    with _open(cfg, out, rank, "tier", holder, replicas=cfg["replicas"]) as store:
        _checkout_rows(store, rank, world, holder, res, cfg, out)
        peers = store._tier.peers
        res["fetched"], res["bad_copies"] = peers.fetched, peers.bad
        res["streamed"], res["stream_fetches"] = peers.streamed, peers.stream_fetches
        res["blocks_alone"] = peers.blocks_alone
        dist.barrier()  # (the others may still be fetching from this rank)


def stuck_kill_body(rank, world, out, res, cfg):
    """Snapshot A, collective through tiers; rank 1 is SIGKILLed after A was published
    (the launcher kills it at the trap), before its tier has A's row (cfg["trap"]
    "adopt": A's part of rank 1 never reaches the remote store) or after the row and
    before it queued its part ("published"). Rank 0 leaves without closing (the job died
    with it)."""
    import time

    import tensorstore_ck.tier.collective as peers
    if rank == 1:
        def trap(self, *args):
            open(os.path.join(out, "trap_rank1"), "w").close()
            time.sleep(120)
        setattr(peers.CollectiveTier, cfg.get("trap", "adopt"), trap)
    store = _open(cfg, out, rank, "tier", {})
    # (rank 0 waits out the put's timeout for the killed rank's word: short, the put itself takes ~1 s)
    res["root"] = store.put_snapshot(dw.sharded_state(rank, world, 0), REF, step=1, timeout=20).root


def dead_zero_body(rank, world, out, res, cfg):
    """Snapshot A, collective through tiers; rank 0 is SIGKILLed once A is published in
    its tier (the launcher kills it at the trap, before it hands the top nodes and the
    result to the others). Rank 1 sees rank 0's heartbeat stop and cannot ask rank 0's
    tier whether A was published: it records what it was told and whether its part's
    intent to upload is still in its tier. Neither closes (the job died with rank 0)."""
    import time

    import tensorstore_ck as tsck
    import tensorstore_ck.tier.collective as peers
    if rank == 0:
        def trap(self, *args):
            open(os.path.join(out, "trap_rank0"), "w").close()
            time.sleep(120)
        peers.CollectiveTier.top_blob = trap
    store = _open(cfg, out, rank, "tier", {})
    t0 = time.monotonic()
    try:
        res["root"] = store.put_snapshot(dw.sharded_state(rank, world, 0), REF, step=1, timeout=8).root
        res["outcome"] = "returned"
    except tsck.TsckError as e:
        res["outcome"], res["message"] = type(e).__name__, str(e)
    res["elapsed"] = time.monotonic() - t0
    res["intents"] = len(store.core.refs.tier_rows.intents())


def stuck_resume_body(rank, world, out, res, cfg):
    """The job restarted: rank 0's uploader resumes A, waiting for rank 1's part. Rank 1
    left its part's intent (killed before A's row) or A's row (killed after it): its open
    queues the part again and sends it, and A becomes durable before B is put
    (cfg["first_a"]). Rank 1's tier lost instead (cfg["wipe"]): no rank will send that
    part, and snapshot B must become durable without waiting for A."""
    import shutil
    import time

    import tensorstore_ck.tier.uploader as uploader
    # How long rank 0 waits for a stalled part before the newer snapshot supersedes it:
    # shorter than the ranks' barrier below may wait (the process group's timeout).
    uploader.SUPERSEDED_PART_WAIT = 5.0
    if rank == 1 and cfg.get("wipe"):
        shutil.rmtree(os.path.join(cfg["tiers"], "tier1"))
    holder: dict = {}
    with _open(cfg, out, rank, "tier", holder) as store:
        if cfg.get("first_a"):
            res["a_first"] = store.wait_durable(timeout=90)
        info = store.put_snapshot(dw.sharded_state(rank, world, 1), REF, step=2, timeout=60)
        t0 = time.monotonic()
        res["root"], res["waited"] = info.root, store.wait_durable(timeout=150)
        res["wait_s"] = time.monotonic() - t0
        res["orphans"] = store._tier.uploader.orphans
        if rank == 0:
            res["superseded"] = store._tier.uploader.superseded
            res["durable"] = {r: store.show(r).durable for r in (info.root, cfg["root_a"])}
        else:  # A's part: sent (durable for this rank) where its row was here
            res["a_part_sent"] = bool(store.core.refs.tier_rows.durable([bytes.fromhex(cfg["root_a"])]))
            res["intents"] = len(store.core.refs.tier_rows.intents())
        import torch.distributed as dist
        dist.barrier()


def budget_body(rank, world, out, res, cfg):
    """Every rank's tier with a budget its first part already fills, the remote's writes
    held (cfg["gate"]): the second collective put finds its tier over the budget with no
    upload able to free it, and fails (TierFull, the snapshot aborted on every rank)
    within BUDGET_WAIT (cfg["budget_wait"]), blocking or not (cfg["blocking"]). Then the
    gate opens and the first is durable."""
    import tensorstore_ck as tsck
    import tensorstore_ck.tier.uploader as uploader
    from tensorstore_ck.tier.budget import tier_bytes
    uploader.BUDGET_WAIT = cfg["budget_wait"]
    holder: dict = {}
    with _open(cfg, out, rank, "tier", holder, local_budget=cfg["budget"]) as store:
        res["first"] = store.put_snapshot(dw.sharded_state(rank, world, 0), REF, step=1, timeout=60).root
        before = tier_bytes(store.core)
        try:
            if cfg.get("blocking", True):
                store.put_snapshot(dw.sharded_state(rank, world, 1), REF, step=2, timeout=120)
            else:  # asynchronous: the same failure, from the future
                store.put_snapshot(dw.sharded_state(rank, world, 1), REF, step=2, timeout=120,
                                   blocking=False).result(timeout=180)
            res["second"] = "returned"
        except tsck.TsckError as e:
            res["second"] = f"{type(e).__name__}: {e}"
        res["tier_bytes"] = [before, tier_bytes(store.core)]
        open(cfg["gate"], "w").close()
        res["waited"] = store.wait_durable(timeout=240)
        res["tip"] = store.show(REF).root if rank == 0 else None


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    with open(argv[3]) as f:
        cfg = json.load(f)
    world = cfg["world"]
    if scenario == "put":
        return [dw.launch("put", world, put_body, out, cfg, limit=300)]
    if scenario == "rput":
        return [dw.launch("rput", world, rput_body, out, cfg, limit=300)]
    if scenario == "noremote":
        return [dw.launch(cfg["phase"], world, noremote_body, out, cfg, limit=300)]
    if scenario == "heldmove":
        return [dw.launch("heldmove", world, heldmove_body, out, cfg, limit=300)]
    if scenario == "twostores":
        return [dw.launch("twostores", world, twostores_body, out, cfg, limit=200)]
    if scenario == "rload":
        return [dw.launch(cfg["phase"], world, rload_body, out, cfg, limit=200)]
    if scenario == "stuckkill":
        return [dw.launch("stuckkill", world, stuck_kill_body, out, cfg, kill_rank=1, limit=200)]
    if scenario == "deadzero":
        return [dw.launch("deadzero", world, dead_zero_body, out, cfg, kill_rank=0, limit=200)]
    if scenario == "stuckresume":
        return [dw.launch("stuckresume", world, stuck_resume_body, out, cfg, limit=300)]
    if scenario == "tidy":
        return [dw.launch("tidy", world, tidy_body, out, cfg, limit=400)]
    if scenario == "manager":
        return [dw.launch(cfg["phase"], world, manager_body, out, cfg, limit=cfg.get("limit", 300))]
    if scenario == "load":
        return [dw.launch(cfg["phase"], world, load_body, out, cfg, limit=200)]
    if scenario == "budget":
        return [dw.launch("budget", world, budget_body, out, cfg, limit=300)]
    return None


if __name__ == "__main__":
    launcher_main(scenarios)
