"""kill -9 at any instant of gc loses nothing that retention keeps, and the next
gc finishes the job.

One store is kept for all trials: 3 jobs with keep_last=2, a tag and a pin on
old snapshots. Each trial commits more snapshots (so there is plenty to
delete), starts tests/helpers/gc_once.py, SIGKILLs it at a moment spread over a
whole gc (measured first on a copy of the store; some kills right at the
start, some timed from the moment the deletion phase is seen), then checks
from the test process:

- every kept snapshot (ref tips, the tag, the pin, the last 2 of each job)
  checks out bit-exact and fsck finds nothing (orphans are allowed);
- once the dead gc's lease ran out, a gc in the test process takes its lock
  over, completes, and leaves exactly the reachable objects (fsck: no orphan,
  no finding) and exactly the kept snapshots in the catalog.

A second test kills gc inside its deletion phase (the deletion epoch stays
odd) and shows that a writer committing afterwards waits the lease out,
re-uploads the blocks the dead gc removed, and commits a complete snapshot.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import time
from pathlib import Path

import pytest

from _util import load_helper

import tensorstore_ck as tsck

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


gc_proc = load_helper("gc_proc")
gc_states = gc_proc.load("gc_states")

STALE = 1.0  # the lease of every gc here
JOBS = ("j0", "j1", "j2")
KEEP = 2
INITIAL = 15  # snapshots per job before the first trial
PER_TRIAL = 5  # snapshots per job added before each later trial
TRIALS = 12
OBJECT_DIRS = ("blocks", "nodes", "commits")


def _open(path):
    return tsck.open_store(path, block_size=gc_states.CRASH_BLOCK, inline_threshold=gc_states.CRASH_INLINE,
                           gc_lease=STALE)


class Model:
    """What the test committed: job -> [(step, root)] in commit order, plus tag and pin."""

    def __init__(self):
        self.commits: dict[str, list[tuple[int, str]]] = {j: [] for j in JOBS}
        self.step_of: dict[str, tuple[str, int]] = {}
        self.tagged: str | None = None
        self.pinned: str | None = None

    def add(self, store, n: int) -> None:
        for _ in range(n):
            for j in JOBS:
                step = len(self.commits[j])
                info = store.put_snapshot(gc_states.crash_state(j, step), ref=f"{j}/main", step=step)
                self.commits[j].append((step, info.root))
                self.step_of[info.root] = (j, step)

    @classmethod
    def filled(cls, store, n: int, tag: tuple[str, int], pin: tuple[str, int]) -> "Model":
        """Each job's keep_last rule set, N snapshots a job put, "golden" tagging the
        snapshot TAG = (job, index) names and a pin on PIN's."""
        model = cls()
        for j in JOBS:
            store.set_retention(j, tsck.Retention(keep_last=KEEP))
        model.add(store, n)
        model.tagged = store.tag("golden", model.commits[tag[0]][tag[1]][1]).root
        model.pinned = store.pin(model.commits[pin[0]][pin[1]][1])
        return model

    def kept(self) -> set[str]:
        out = {root for j in JOBS for _, root in self.commits[j][-KEEP:]}
        return out | {self.tagged, self.pinned}


def _objects(path: Path) -> set[str]:
    out = set()
    for d in OBJECT_DIRS:
        for root, _dirs, files in os.walk(path / d):
            out.update(os.path.join(root, f) for f in files)
    return out


def _check_kept(store, model: Model) -> None:
    for j in JOBS:
        assert store.resolve(f"{j}/main") == model.commits[j][-1][1], f"ref {j}/main moved"
    assert store.resolve("golden") == model.tagged
    assert model.pinned in {r.hex() for r in store.reftable.pins()}
    for root in sorted(model.kept()):
        j, step = model.step_of[root]
        got = store.checkout(root)
        assert gc_states.same_bits(gc_states.crash_state(j, step), got), f"{j}@{step} ({root[:12]}) differs"


def _settle(store) -> None:
    """Run one harmless write transaction on the ref table.

    A process SIGKILLed inside an LMDB commit may already have written its meta
    page without publishing it to readers; LMDB completes such a commit when the
    next process takes the write lock. Until then a read may still show the gc
    state from before the dead gc's last write, so the test takes the write lock
    once before it looks at what the dead gc left."""
    store.set_retention(JOBS[0], tsck.Retention(keep_last=KEEP))


def _wait_stale(store) -> None:
    """Sleep until the dead gc's lease ran out (on the ref table's clock)."""
    st = store.reftable.gc_state()
    if st["lease_left"]:
        time.sleep(st["lease_left"] + 0.1)


def _kill_phase(store, t_go_wall: float) -> str:
    st = store.reftable.gc_state()
    if st["phase"] != "idle":
        return st["phase"]
    last = st.get("last_gc") or {}
    return "finished" if float(last.get("at", 0.0)) >= t_go_wall else "not-begun"


def _run_gc_child(path: Path, tmp: Path, tag: str, procs, wait: bool = True) -> gc_proc.Proc:
    p = gc_proc.Proc("gc_once.py", [path, STALE], tmp / f"gc-{tag}.err")
    procs.append(p)
    if wait:
        p.wait_line("ready", 90)
    return p


@pytest.mark.slow
def test_gc_sigkill_at_random_moments(tmp_path, procs):
    rng = random.Random(20240611)
    path = tmp_path / "store"
    store = _open(path)
    try:
        model = Model.filled(store, INITIAL, tag=("j0", 2), pin=("j1", 4))

        # -- calibrate: one uncut gc on a copy of the store, timed from the test's side.
        # The store is closed while its directory is copied: reading refs.lmdb/lock.mdb
        # through another file descriptor of this process would drop this process's
        # POSIX (fcntl) locks on it, and the next process to open the ref table would
        # then think it is alone and re-initialise the lock file under our feet.
        store.close()
        calib = tmp_path / "calib"
        shutil.copytree(path, calib)
        store = _open(path)
        p = _run_gc_child(calib, tmp_path, "calib", procs)
        nxt = _run_gc_child(path, tmp_path, "0", procs, wait=False)  # imports while the calibration runs
        t0 = time.monotonic()
        p.send("go\n")
        assert p.wait(60) == 0, p.stderr()[-3000:]
        t_done, line = p.wait_line("report", 1)
        shutil.rmtree(calib)
        dur = t_done - t0
        print(f"\ncalibration: a whole gc takes {dur:.3f}s as seen from the test ({line})")

        # -- kill schedule: ("time", seconds after "go") or ("progress", fraction of the
        # doomed objects (a sample of the dry run's would_delete) already deleted)
        schedule = [("time", 0.0), ("time", 0.01 * dur)]
        n_time = (TRIALS - len(schedule)) // 2
        for i in range(n_time):  # stratified over the whole gc, and a little past its end
            schedule.append(("time", dur * 1.1 * (i + rng.random()) / n_time))
        n_prog = TRIALS - len(schedule)
        for i in range(n_prog):  # stratified over the deletion phase; the last once all are gone
            schedule.append(("progress", 1.0 if i == n_prog - 1 else (i + rng.random()) / n_prog))

        phases = collections.Counter()
        for trial, (mode, x) in enumerate(schedule):
            t_trial = time.monotonic()
            if trial:
                model.add(store, PER_TRIAL)
            t_added = time.monotonic()
            before = _objects(path)
            if mode == "progress":
                doomed = store.gc(dry_run=True).would_delete
                assert doomed, "nothing to delete: the trial would test nothing"
                sample = [path / k for k in rng.sample(doomed, min(100, len(doomed)))]
                want = max(1, round(x * len(sample)))
            p, nxt = nxt, None
            p.wait_line("ready", 90)
            t_go_wall = time.time()
            p.send("go\n")
            t_go = time.monotonic()
            if mode == "time":
                left = x - (time.monotonic() - t_go)
                if left > 0:
                    time.sleep(left)
            else:
                while p.proc.poll() is None and sum(not f.exists() for f in sample) < want:
                    time.sleep(0.0002)
            died = p.proc.poll()
            p.kill9()
            assert died in (None, 0), f"trial {trial}: the gc child died by itself ({died}): {p.stderr()[-3000:]}"
            _settle(store)
            phase = _kill_phase(store, t_go_wall)
            phases[phase] += 1
            after = _objects(path)
            assert after <= before, "a killed gc created objects"
            deleted_by_dead = len(before - after)

            # Nothing kept was touched; fsck finds no problem (orphans are fine).
            _check_kept(store, model)
            rep = store.fsck(full=True)
            assert rep.ok and rep.findings == [], (f"trial {trial}, after a kill in phase {phase}",
                                                   [str(f) for f in rep.findings[:10]])
            orphans_after_kill = rep.orphans

            # The next gc takes the dead one's lock over and finishes its work.
            _wait_stale(store)
            final = store.gc()
            st = store.reftable.gc_state()
            assert st["phase"] == "idle" and st["epoch"] % 2 == 0, st
            rep = store.fsck(full=True)
            assert rep.ok and rep.findings == [], (f"trial {trial}, after the gc that followed a kill in phase "
                                                   f"{phase}", [str(f) for f in rep.findings[:10]])
            assert rep.orphans == 0, f"trial {trial}: {rep.orphans} unreachable objects survive a full gc"
            catalog = {r.hex() for r, _ in store.reftable.catalog_iter()}
            assert catalog == model.kept(), f"trial {trial}: catalog is not exactly the kept snapshots"
            _check_kept(store, model)
            for j in JOBS:
                assert [i.step for i in store.log(f"{j}/main")][:KEEP] == \
                    [s for s, _ in model.commits[j][-KEEP:]][::-1]
            what = f"{x:.3f}s after go" if mode == "time" else f"{x:.0%} of doomed sample deleted"
            print(f"trial {trial:2d}: kill at {what:28s} phase {phase:9s} "
                  f"deleted-by-dead-gc={deleted_by_dead:5d} orphans-left={orphans_after_kill:5d} "
                  f"next gc deleted={final.deleted_objects:5d} "
                  f"({t_added - t_trial:.1f}s commits, {time.monotonic() - t_added:.1f}s kill+checks)")
            if trial + 1 < len(schedule):
                nxt = _run_gc_child(path, tmp_path, str(trial + 1), procs, wait=False)  # imports during the commits
        print(f"kills by phase: {dict(phases)}")
        assert phases["deleting"] >= TRIALS // 3, f"too few kills inside the deletion phase: {dict(phases)}"
        assert phases["marking"] + phases["not-begun"] >= 2, f"too few early kills: {dict(phases)}"
    finally:
        store.close()


@pytest.mark.slow
def test_writer_commits_after_gc_killed_while_deleting(tmp_path, procs):
    path = tmp_path / "store"
    store = _open(path)
    try:
        model = Model.filled(store, 8, tag=("j0", 1), pin=("j2", 1))
        # j1@0 expires; its own blocks are what the writer below will reuse.
        reused = gc_states.crash_state("j1", 0)
        own_keys = set()
        import blake3

        raw = reused["own"].tobytes()
        for i in range(0, len(raw), gc_states.CRASH_BLOCK):
            h = blake3.blake3(raw[i:i + gc_states.CRASH_BLOCK]).hexdigest()
            own_keys.add(path / "blocks" / h[:2] / h)
        assert all(k.exists() for k in own_keys)

        p = _run_gc_child(path, tmp_path, "del", procs)
        p.send("go\n")
        # Kill once the dead gc has removed some of j1@0's blocks but not all of them.
        while p.proc.poll() is None:
            if store.reftable.gc_state()["phase"] == "deleting" and not all(k.exists() for k in own_keys):
                break
            time.sleep(0.0002)
        exited_by_itself = p.proc.poll()
        p.kill9()
        _settle(store)
        st = store.reftable.gc_state()
        assert st["phase"] == "deleting" and st["epoch"] % 2 == 1, (
            f"gc was not killed while deleting: {st}; it had exited by itself with {exited_by_itself}: "
            f"{[line for _, line in p.lines]} {p.stderr()[-3000:]}")
        missing = sum(not k.exists() for k in own_keys)
        print(f"\nkilled in the deletion phase: epoch {st['epoch']}, {missing}/{len(own_keys)} of the "
              f"reused blocks already deleted")
        assert missing > 0

        # A writer now commits j1@0's content again: its fence is the dead gc's odd epoch,
        # so its ref move is refused until the dead gc is stale; then it re-validates.
        t = time.monotonic()
        info = store.put_snapshot(reused, ref="j1/main", step=0, meta={"again": True})
        waited = time.monotonic() - t
        st = store.reftable.gc_state()
        assert st["epoch"] % 2 == 0 and st["phase"] == "idle", st
        print(f"put after the killed gc: {waited:.3f}s, blocks_new={info.blocks_new}")
        assert info.blocks_new >= missing, "the writer did not re-upload the blocks the dead gc removed"
        assert all(k.exists() for k in own_keys)
        assert gc_states.same_bits(reused, store.checkout(info.root))
        assert gc_states.same_bits(reused, store.checkout("j1/main"))
        model.commits["j1"].append((0, info.root))
        model.step_of[info.root] = ("j1", 0)

        rep = store.fsck(full=True)
        assert rep.ok and rep.findings == [], [str(f) for f in rep.findings[:10]]
        _check_kept(store, model)

        # And gc works again, in process, without waiting: the writer closed the dead epoch.
        final = store.gc()
        assert final.deleted_objects > 0
        rep = store.fsck(full=True)
        assert rep.ok and rep.findings == [] and rep.orphans == 0, rep.to_json()
        _check_kept(store, model)
        assert gc_states.same_bits(reused, store.checkout(info.root))
    finally:
        store.close()
