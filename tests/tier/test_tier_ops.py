"""gc, fsck and du with a local tier (docs/design/tiers.md, "gc, fsck and du across the
tiers"): the remote gc is unchanged (a local-only snapshot keeps nothing alive there, and
a gc running beside the uploads never deletes what a durable snapshot needs); `tsck fsck
STORE --local PATH` checks both tiers and says which one a problem is in; `tsck du STORE
--local PATH` shows the tier's bytes by what they are for.

The remote is a real store on disk; its writes are held or slowed by a WrappedStore
around its storage (wrap_storage=); the CLI runs through its main()."""

from __future__ import annotations

import json
import threading
import time

import torch

import tensorstore_ck as tsck
from tensorstore_ck.cli import main
from tensorstore_ck.errors import GcBusy
from tensorstore_ck.maintain.gc import run_gc
from tensorstore_ck.maintain.reach import kept_roots
from tensorstore_ck.storage.wrappers import WrappedStore

DEADLINE = 120.0  # generous: the machine is shared

from _util import open_tiered as _open, same_bits as _equal, tier_state as _state  # the backlog tests' state and store


class HoldAfter(WrappedStore):
    """Lets the first `n` remote object writes through, holds the next until `gate` is set."""

    def __init__(self, inner, n: int = 2):
        super().__init__(inner)
        self.n, self.keys = n, []
        self.gate, self.waiting = threading.Event(), threading.Event()
        self.landed = threading.Semaphore(0)  # released as each of the first n writes lands
        self._lock = threading.Lock()

    def put_addressed(self, key, bufs):
        with self._lock:
            mine = len(self.keys) < self.n
            if mine:
                self.keys.append(key)
        if not mine:
            self.waiting.set()
            assert self.gate.wait(DEADLINE)
        out = self.inner.put_addressed(key, bufs)
        if mine:
            self.landed.release()
        return out


def test_a_local_only_snapshot_keeps_nothing_alive_remotely(tmp_path):
    """A snapshot whose upload sent two blocks and holds: the remote table does not know
    it, so a remote gc neither keeps its root nor the two blocks (garbage to it); once the
    upload goes on, the fenced move re-sends them and the remote snapshot is whole."""
    wrapped = []
    store = _open(tmp_path, wrap_storage=lambda s: wrapped.append(HoldAfter(s)) or wrapped[-1])
    held = wrapped[0]
    info = store.put_snapshot(_state(1), "job/main", step=1)
    assert held.waiting.wait(DEADLINE)
    for _ in range(held.n):  # (the writes let through may still be under way when the next one waits)
        assert held.landed.acquire(timeout=DEADLINE)
    remote = store.remote_core
    assert bytes.fromhex(info.root) not in kept_roots(remote)
    report = run_gc(remote, grace=0.0)
    assert report.deleted_objects >= 2 and not any(remote.storage.exists(k) for k in held.keys)
    held.gate.set()
    assert store.wait_durable(timeout=DEADLINE) is True
    store.close()
    with tsck.open_store(str(tmp_path / "remote"), create=False) as r:
        assert r.fsck(full=True).findings == [] and _equal(r.checkout("job/main"), _state(1))


class Slow(WrappedStore):
    def put_addressed(self, key, bufs):
        time.sleep(0.01)
        return self.inner.put_addressed(key, bufs)


def test_remote_gc_beside_uploads_never_deletes_what_a_durable_snapshot_needs(tmp_path):
    """A remote gc runs again and again (no grace) while six snapshots, sharing a tensor,
    go through the tier: every snapshot the remote catalog lists is whole (remote fsck
    clean) and checks out bit for bit, and the remote tip is the newest."""
    store = _open(tmp_path, wrap_storage=Slow)
    remote = store.remote_core
    stop, runs, errors = threading.Event(), [0], []

    def gc_loop():
        while not stop.is_set():
            try:
                run_gc(remote, grace=0.0)
                runs[0] += 1
            except GcBusy:
                pass
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)
                return

    t = threading.Thread(target=gc_loop)
    t.start()
    try:
        shared = torch.arange(8192, dtype=torch.float32)
        for step in range(1, 7):
            store.put_snapshot({"shared": shared, **_state(step)}, "job/main", step=step)
            if step % 2 == 0:
                assert store.wait_durable(timeout=DEADLINE)
        assert store.wait_durable(timeout=DEADLINE)
        deadline = time.monotonic() + DEADLINE
        while runs[0] < 3 and not errors:  # at least a few full gcs ran beside the uploads
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    tip = store.resolve("job/main")
    store.close()
    with tsck.open_store(str(tmp_path / "remote"), create=False) as r:
        assert r.fsck(full=True).findings == []
        assert r.resolve("job/main") == tip and r.show("job/main").step == 6
        for info in r.log("job/main"):
            assert _equal(r.checkout(info.root), {"shared": torch.arange(8192, dtype=torch.float32),
                                                  **_state(info.step)})


def _tier_with_every_kind(tmp_path) -> dict:
    """A tier holding: s1 durable and evicted by the budget, s2 durable (cached), s3
    queued for upload, s4 local-only (never queued). s3 and s4 are put into the tier
    opened as a store of its own, which has no uploader (as a process killed before
    its uploads leaves them)."""
    nvme, pnvme = tmp_path / "nvme", tmp_path / "probe" / "nvme"
    with _open(tmp_path / "probe") as probe:  # what one snapshot takes in a tier
        probe.put_snapshot(_state(100), "job/probe", step=0)
        probe.wait_durable(timeout=DEADLINE)
    one = sum(p.stat().st_size for k in ("blocks", "nodes", "commits") for p in (pnvme / k).rglob("*") if p.is_file())
    with _open(tmp_path, local_budget=one + one // 2) as store:
        s1 = store.put_snapshot(_state(1), "job/main", step=1)
        assert store.wait_durable(timeout=DEADLINE)
        s2 = store.put_snapshot(_state(2), "job/main", step=2)
        assert store.wait_durable(timeout=DEADLINE)
        assert bytes.fromhex(s1.root) in store.reftable.tier_rows.evicted()
        assert bytes.fromhex(s2.root) not in store.reftable.tier_rows.evicted()
    with tsck.open_store(str(nvme), create=False) as tier:
        s3 = tier.put_snapshot(_state(3), "job/main", step=3)
        tier.reftable.tier_rows.upload_enqueue(bytes.fromhex(s3.root), "job/main", 3)
        s4 = tier.put_snapshot(_state(4), "job/side", step=4)
    return {"s1": s1, "s2": s2, "s3": s3, "s4": s4}


def test_du_with_local_shows_the_tiers_bytes_by_what_they_are_for(tmp_path, capsys):
    snaps = _tier_with_every_kind(tmp_path)
    remote, nvme = str(tmp_path / "remote"), str(tmp_path / "nvme")
    capsys.readouterr()
    assert main(["du", remote, "--local", nvme, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["local"]
    assert d["pending"]["snapshots"] == 1 and d["local_only"]["snapshots"] == 1
    assert d["durable"]["snapshots"] == 1  # s2 is cached
    assert d["evicted"]["snapshots"] == 1
    assert all(d[k]["bytes"] > 0 for k in ("pending", "local_only", "durable"))
    assert d["bytes"] == sum(d[k]["bytes"] for k in ("pending", "local_only", "durable", "unreferenced"))
    assert main(["du", remote, "--local", nvme]) == 0
    out = capsys.readouterr().out
    for word in ("local tier", "pending", "local_only", "durable", "evicted"):
        assert word in out
    assert snaps


def test_log_with_local_shows_what_is_not_uploaded_and_a_ref_only_there(tmp_path, capsys):
    """`tsck log STORE REF --local PATH`: the ref's remote history with the tier's
    snapshots not uploaded yet, marked local-only; a ref only the tier has is listed with
    a note that it is local-only. Without --local, the remote's "no ref" names the way."""
    snaps = _tier_with_every_kind(tmp_path)
    remote, nvme = str(tmp_path / "remote"), str(tmp_path / "nvme")
    capsys.readouterr()
    assert main(["log", remote, "job/main", "--local", nvme]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln[:16] for ln in lines] == [snaps[k].root[:16] for k in ("s3", "s2", "s1")], lines
    assert "local-only" in lines[0] and not any("local-only" in ln for ln in lines[1:]), lines
    assert main(["log", remote, "job/side"]) == 2
    err = capsys.readouterr().err
    assert "no ref named 'job/side'" in err and "--local TIER_PATH" in err, err
    assert main(["log", remote, "job/side", "--local", nvme]) == 0
    got = capsys.readouterr()
    assert got.out.startswith(snaps["s4"].root[:16]) and "local-only" in got.out, got
    assert "is local-only" in got.err and "not uploaded" in got.err, got.err
    assert main(["log", remote, "job/nothing", "--local", nvme]) == 2
    assert "nor in its local tier" in capsys.readouterr().err


def test_fsck_with_local_checks_both_tiers_and_names_the_tier_of_each_problem(tmp_path, capsys):
    """Clean: exit 0, both tiers ok. Then a damaged local block of the queued snapshot is
    a [local] problem, a remote block deleted under the durable tip a [remote] one, and
    an evicted snapshot the remote forgot a [local] not_remote one (no copy is left);
    exit 1. A tier of another store is refused (exit 2), and without --local fsck checks
    the remote alone."""
    snaps = _tier_with_every_kind(tmp_path)
    remote, nvme = str(tmp_path / "remote"), str(tmp_path / "nvme")
    capsys.readouterr()
    assert main(["fsck", remote, "--local", nvme]) == 0
    out = capsys.readouterr().out
    assert "[remote] ok" in out and "[local]  ok" in out and "1 snapshot(s) evicted" in out
    assert "1 queued for upload" in out
    # damage: a local block only s3 has, a remote block of s2, and s1 forgotten remotely
    with tsck.open_store(nvme, create=False) as tier:
        s3_blocks = {o.digest for o in _walk(tier, snaps["s3"].root) if o.kind == "block"}
        s2_blocks = {o.digest for o in _walk(tier, snaps["s2"].root) if o.kind == "block"}
    victim = next(iter(s3_blocks - s2_blocks)).hex()
    path = tmp_path / "nvme" / "blocks" / victim[:2] / victim
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    gone = next(iter(s2_blocks)).hex()
    (tmp_path / "remote" / "blocks" / gone[:2] / gone).unlink()
    with tsck.open_store(remote, create=False) as r:
        r.forget(snaps["s1"].root)
    assert main(["fsck", remote, "--local", nvme]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("[local]  corrupt") and victim in line for line in lines), lines
    assert any(line.startswith("[remote] missing") and gone in line for line in lines), lines
    assert any(line.startswith("[local]  not_remote") and snaps["s1"].root[:16] in line and "no copy" in line
               for line in lines), lines
    assert main(["fsck", remote, "--local", nvme, "--json"]) == 1
    j = json.loads(capsys.readouterr().out)
    assert j["ok"] is False and j["local"]["ok"] is False
    assert {f["problem"] for f in j["local"]["findings"]} == {"corrupt", "not_remote"}
    assert {f["problem"] for f in j["findings"]} == {"missing"}
    tsck.open_store(str(tmp_path / "other"), local=str(tmp_path / "other-nvme")).close()
    assert main(["fsck", remote, "--local", str(tmp_path / "other-nvme")]) == 2
    assert "not a local tier of" in capsys.readouterr().err
    assert main(["fsck", remote]) == 1  # the remote alone: its own problem only
    assert "[local]" not in capsys.readouterr().out


def _walk(store, root: str):
    from tensorstore_ck.core.walk import walk_commit
    return list(walk_commit(store.core.assets, bytes.fromhex(root), verify=False))
