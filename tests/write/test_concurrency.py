"""Several writer processes snapshotting into one store at once.

Workers (tests/helpers/conc_worker.py) meet at a file barrier before every
round, so their puts really overlap. Each prints the roots it was told were
committed; the test then checks that nothing acknowledged was lost, that every
root checks out with the exact content its worker wrote, and (for compare-and-
swap) that each round had exactly one winner.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import _zygote as zygote
from _util import kill_left, load_helper, object_listing

import tensorstore_ck as tsck

HERE = Path(__file__).resolve().parents[1]
REPO = HERE.parent
WORKER = HERE / "helpers" / "conc_worker.py"
BLOCK = 64 * 1024
INLINE = 1024
ROUNDS = 15


statelib = load_helper("statelib")


class Result:
    def __init__(self, worker: int, out: str):
        self.worker = worker
        self.ok: dict[int, str] = {}
        self.conflicts: dict[int, tuple[str, str]] = {}
        self.new: dict[int, tuple[int, int]] = {}  # round -> (blocks_new, bytes_new)
        self.done = False
        for line in out.splitlines():
            w = line.split()
            if w and w[0] == "ok":
                self.ok[int(w[1])] = w[2]
                self.new[int(w[1])] = (int(w[3]), int(w[4]))
            elif w and w[0] == "conflict":
                self.conflicts[int(w[1])] = (w[2], w[3])
            elif w == ["done"]:
                self.done = True


def run_workers(tmp_path: Path, store: Path, refs: list[str], mode: str, rounds: int = ROUNDS,
                precreate: bool = True, during=None) -> list[Result]:
    """Run one worker per ref; `during()` is called repeatedly while they run."""
    if precreate:
        open_store(store).close()
    bar = tmp_path / "barrier"
    bar.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    procs = []
    for w, ref in enumerate(refs):
        err = open(tmp_path / f"worker{w}.err", "wb")
        p = zygote.Popen(
            [sys.executable, str(WORKER), str(store), ref, str(w), str(len(refs)), str(rounds), mode, str(bar)],
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=REPO,
            env=env,
        )
        procs.append((p, err))
    deadline = time.monotonic() + 240
    try:
        # If one worker dies, the others would wait at the barrier: stop them all.
        while None in [p.poll() for p, _ in procs]:
            dead = [w for w, (p, _) in enumerate(procs) if p.returncode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                break
            if during is not None:
                during()
            else:
                time.sleep(0.05)
        results = []
        for w, (p, err) in enumerate(procs):
            if p.poll() is None:
                p.kill()
            out, _ = p.communicate(timeout=60)
            err.close()
            msg = (tmp_path / f"worker{w}.err").read_text(errors="replace")[-4000:]
            assert p.returncode == 0, f"worker {w} rc={p.returncode}: {msg}"
            r = Result(w, out.decode())
            assert r.done, f"worker {w} did not finish: {msg}"
            results.append(r)
    finally:
        kill_left(procs)
    return results


def open_store(path: Path):
    return tsck.open_store(path, block_size=BLOCK, inline_threshold=INLINE)


def check_content(s, root: str, worker: int, i: int) -> None:
    got = s.checkout(root, verify=True)
    assert statelib.same_bits(got, statelib.conc_state(worker, i)), (root, worker, i)
    info = s.show(root)
    assert info.root == root
    assert info.step == worker * 100_000 + i


@pytest.mark.slow
def test_two_processes_different_refs(tmp_path):
    store = tmp_path / "store"
    refs = ["jobA/main", "jobB/main"]
    results = run_workers(tmp_path, store, refs, "uncond")
    with open_store(store) as s:
        for r, ref in zip(results, refs):
            assert sorted(r.ok) == list(range(ROUNDS)) and not r.conflicts
            log = s.log(ref)
            assert [e.root for e in log] == [r.ok[i] for i in reversed(range(ROUNDS))]
            assert all(e.job == ref.split("/")[0] for e in log)
            assert s.resolve(ref) == r.ok[ROUNDS - 1]
            for i, root in r.ok.items():
                check_content(s, root, r.worker, i)
        assert set(s.refs()) >= set(refs)
    # identical content written concurrently is stored once: the shared base
    # (4 tensors x 4 blocks) plus one 256 KiB head (4 blocks) per snapshot
    blocks = [p for p in (store / "blocks").rglob("*") if p.is_file() and len(p.name) == 64]
    assert len(blocks) == 16 + 2 * ROUNDS * 4
    # Both raced to write the shared base in round 0. Every stored block is counted new
    # by someone; a block both wrote before either named it (a local disk names a put's
    # writes at its sync) is counted by both, as both wrote its bytes: only the 16 shared
    # ones can be.
    counted = sum(b for r in results for b, _ in r.new.values())
    assert len(blocks) <= counted <= len(blocks) + 16
    raw = sum(int.from_bytes(p.read_bytes()[8:16], "little") for p in blocks)
    counted_bytes = sum(n for r in results for _, n in r.new.values())
    # bytes_new also counts the tensors inlined in new manifest nodes: each snapshot's own
    # "bias" (64 float32, under INLINE), new every time
    inline = sum(statelib.conc_state(r.worker, i)["own"]["bias"].nbytes for r in results for i in r.ok)
    # (what was counted twice is whole shared blocks: BLOCK bytes each, any number of them up to 16)
    assert raw + inline <= counted_bytes and counted_bytes - raw - inline == (counted - len(blocks)) * BLOCK


@pytest.mark.slow
def test_two_processes_same_ref_unconditional(tmp_path):
    store = tmp_path / "store"
    ref = "shared/main"
    seen: dict[str, tuple[int, int]] = {}

    def read_while_writing():
        # a reader in this process meanwhile: whatever the ref shows is complete
        with open_store(store) as s:
            try:
                root = s.resolve(ref)
            except tsck.RefNotFound:
                return
            got = s.checkout(root)
        w, i = got["worker"], got["i"]
        assert statelib.same_bits(got, statelib.conc_state(w, i)), (root, w, i)
        seen[root] = (w, i)

    results = run_workers(tmp_path, store, [ref, ref], "uncond", during=read_while_writing)
    acked = {root: (r.worker, i) for r in results for i, root in r.ok.items()}
    for r in results:
        assert sorted(r.ok) == list(range(ROUNDS)) and not r.conflicts
    assert len(acked) == 2 * ROUNDS
    with open_store(store) as s:
        log = s.log(ref)
        roots = [e.root for e in log]
        # nothing lost: every acknowledged put is in the ref's history, once
        assert sorted(roots) == sorted(acked)
        # one linear history: each commit's parent is the one before it
        for e, older in zip(log, log[1:]):
            assert e.parent == older.root, e
        assert log[-1].parent is None
        # each worker's own snapshots appear in the order it made them
        pos = {root: n for n, root in enumerate(roots)}
        for r in results:
            order = [pos[r.ok[i]] for i in range(ROUNDS)]
            assert order == sorted(order, reverse=True)
        assert s.resolve(ref) == roots[0]
        for root, (w, i) in acked.items():
            check_content(s, root, w, i)
    assert seen, "the reader never saw the ref"
    assert all(acked.get(root) == wi for root, wi in seen.items())


@pytest.mark.slow
def test_two_processes_same_ref_compare_and_swap(tmp_path):
    store = tmp_path / "store"
    ref = "shared/main"
    results = run_workers(tmp_path, store, [ref, ref], "cas")
    winners = []
    for i in range(ROUNDS):
        won = [r for r in results if i in r.ok]
        lost = [r for r in results if i in r.conflicts]
        # both saw the same ref (or the loser a stale one): exactly one wins
        assert len(won) == 1 and len(lost) == 1, f"round {i}: won {len(won)}, lost {len(lost)}"
        winners.append((won[0].worker, won[0].ok[i]))
    n_conflicts = sum(len(r.conflicts) for r in results)
    assert n_conflicts == ROUNDS
    committed = {root for _, root in winners}
    with open_store(store) as s:
        log = s.log(ref)
        # every root a process was told succeeded is in the history, in round order
        assert [e.root for e in log] == [root for _, root in reversed(winners)]
        assert s.resolve(ref) == winners[-1][1]
        for e, older in zip(log, log[1:]):
            assert e.parent == older.root
        for i, (w, root) in enumerate(winners):
            check_content(s, root, w, i)
    for r in results:
        for i, (expected, actual) in r.conflicts.items():
            # the conflict reports where the ref really was: a committed snapshot
            assert actual in committed, (i, expected, actual)
            assert actual != expected
            if i == 0:
                assert expected == "None"
            else:
                assert expected in committed


@pytest.mark.slow
def test_processes_creating_the_same_new_store_at_once(tmp_path):
    """Writers started together on a store that does not exist yet all get to write."""
    store = tmp_path / "new-store"
    refs = [f"job{w}/main" for w in range(4)]
    results = run_workers(tmp_path, store, refs, "uncond", rounds=2, precreate=False)
    with open_store(store) as s:
        for r, ref in zip(results, refs):
            assert [e.root for e in s.log(ref)] == [r.ok[1], r.ok[0]]
            for i, root in r.ok.items():
                check_content(s, root, r.worker, i)


def test_cas_in_process(tmp_path):
    with tsck.open_store(tmp_path / "s", block_size=BLOCK, inline_threshold=INLINE) as s:
        st0, st1, st2 = (statelib.conc_state(0, i) for i in range(3))
        a = s.put_snapshot(st0, ref="jobA/main", expected=None)
        with pytest.raises(tsck.RefConflict) as ei:
            s.put_snapshot(st1, ref="jobA/main", expected=None)
        e = ei.value
        assert isinstance(e, tsck.TsckError)
        assert e.expected is None
        assert str(e.actual) == a.root
        assert isinstance(e.kind, str) and e.kind
        assert s.resolve("jobA/main") == a.root
        assert [x.root for x in s.log("jobA/main")] == [a.root]

        b = s.put_snapshot(st1, ref="jobA/main", expected=a.root)
        assert b.parent == a.root
        with pytest.raises(tsck.RefConflict) as ei:
            s.put_snapshot(st2, ref="jobA/main", expected=a.root)  # stale
        assert str(ei.value.expected) == a.root and str(ei.value.actual) == b.root
        assert s.resolve("jobA/main") == b.root
        assert [x.root for x in s.log("jobA/main")] == [b.root, a.root]

        # expected=<root> on a ref that does not exist: conflict, actual is None
        with pytest.raises(tsck.RefConflict) as ei:
            s.put_snapshot(st2, ref="jobB/main", expected=a.root)
        assert ei.value.actual is None
        with pytest.raises(tsck.RefNotFound):
            s.resolve("jobB/main")

        c = s.put_snapshot(st2, ref="jobA/main")  # unconditional still works
        assert c.parent == b.root
        assert statelib.same_bits(s.checkout("jobA/main"), st2)
        assert statelib.same_bits(s.checkout(a.root), st0)


def test_a_ref_that_always_moves_first_gives_up_with_a_clear_error(monkeypatch):
    """A competing writer that wins every race on one ref (it moves the ref right
    before each of our compare-and-swaps): after COMMIT_ATTEMPTS tries the put gives
    up with SnapshotAborted saying why, and the ref is only ever on the rival's roots."""
    import tensorstore_ck.write.publish as store_mod
    from tensorstore_ck.refs import MemoryRefTable

    class RivalWinsEveryRace(MemoryRefTable):
        def __init__(self):
            super().__init__()
            self.rival = 0

        def compare_and_swap(self, name, expected, new, **kw):
            if name == "hot/ref":
                self.rival += 1
                cur = self.get_or_none(name)
                super().compare_and_swap(name, cur, self.rival.to_bytes(32, "big"), message="rival")
            return super().compare_and_swap(name, expected, new, **kw)

    monkeypatch.setattr(store_mod, "COMMIT_ATTEMPTS", 25)
    table = RivalWinsEveryRace()
    with tsck.open_store("memory://rival-wins", refs=table) as s:
        with pytest.raises(tsck.SnapshotAborted, match="25 lost races"):
            s.put_snapshot({"w": torch.ones(3)}, ref="hot/ref", step=1)
        assert table.get_or_none("hot/ref") == (25).to_bytes(32, "big")
        s.put_snapshot({"w": torch.ones(3)}, ref="calm/ref", step=1)  # other refs are unaffected


def test_a_put_that_lost_races_leaves_only_its_published_commit(tmp_path):
    """A put that loses the race for its ref re-encodes its commit with the new parent;
    the commit objects the table refused are removed, and so is the one of a put whose
    expected= was not met. Otherwise `recover`, after a lost ref table, would adopt each
    as a snapshot of its own: one put, several snapshots, crowding out older ones that
    keep_last was told to keep."""
    from tensorstore_ck.refs import MemoryRefTable

    class RivalWinsTwice(MemoryRefTable):
        """Before each of the first two moves of job/main, another writer moves it first
        (to snapshots that exist)."""
        def __init__(self):
            super().__init__()
            self.rival_roots: list[bytes] = []
            self.adopt = False  # a recover running meanwhile adopts the commit about to be refused

        def compare_and_swap(self, name, expected, new, **kw):
            if name == "job/main" and self.rival_roots:
                if self.adopt:
                    self.catalog_put_if_absent(new, kw["catalog_row"])
                super().compare_and_swap(name, self.get_or_none(name), self.rival_roots.pop(0), message="rival")
            return super().compare_and_swap(name, expected, new, **kw)

    def commits(path) -> set[str]:
        return {os.path.basename(k) for k in object_listing(path) if k.startswith("commits")}

    path = tmp_path / "s"
    table = RivalWinsTwice()
    with tsck.open_store(path, refs=table, block_size=BLOCK, inline_threshold=INLINE) as s:
        rivals = [s.put_snapshot(statelib.conc_state(1, i), ref=f"job/rival{i}", step=i) for i in range(2)]
        table.rival_roots = [bytes.fromhex(r.root) for r in rivals]
        info = s.put_snapshot(statelib.conc_state(0, 0), ref="job/main", step=7)
        assert table.rival_roots == [] and info.parent == rivals[1].root  # it lost two races, then landed
        published = {r.root for r in rivals} | {info.root}
        assert {r.hex() for r, _row in table.catalog_iter()} == published
        assert commits(path) == published
        with pytest.raises(tsck.RefConflict):
            s.put_snapshot(statelib.conc_state(0, 1), ref="job/main", expected=rivals[0].root)
        assert commits(path) == published, "a put refused by expected= left its commit object"
        # A commit a recover adopted meanwhile, its move refused, has a catalog row: it is
        # the put's snapshot, and the ref moves to it as it is (re-encoded, the put would be
        # two snapshots; deleted, the row would name a missing commit).
        table.rival_roots, table.adopt = [bytes.fromhex(rivals[0].root)], True
        again = s.put_snapshot(statelib.conc_state(0, 2), ref="job/main", step=8)
        assert {r.hex() for r, _row in table.catalog_iter()} == published | {again.root}
        assert commits(path) == published | {again.root} and s.resolve("job/main") == again.root
        assert again.parent == info.root  # the parent it was written on: the rival's move came after
        assert s.fsck().ok
        table.adopt = False
        published |= {again.root}

    # The ref table is lost: recover finds the snapshots that were published, no more.
    with tsck.open_store(path, refs=MemoryRefTable(), block_size=BLOCK, inline_threshold=INLINE) as s:
        rep = s.recover()
        assert rep.commits_found == len(published) == 4 and s.resolve("job/main") == again.root


def test_a_put_whose_commit_a_recover_moved_the_ref_to_never_moves_it_back(tmp_path):
    """A recover beside a put adopts the put's commit and moves the ref to it (the table
    had lost the ref), then another writer moves the ref on, all while the put's own move
    waits. The put's commit is its snapshot, already in the ref's history: the put
    returns it and moves nothing (moved to it again, the ref would go back past the
    other writer's later snapshot)."""
    from tensorstore_ck.refs import MemoryRefTable
    from tensorstore_ck.refs.history import RECOVERED

    class RecoverThenRival(MemoryRefTable):
        def __init__(self):
            super().__init__()
            self.rival: bytes | None = None

        def compare_and_swap(self, name, expected, new, **kw):
            if name == "job/main" and self.rival is not None:
                rival, self.rival = self.rival, None
                self.catalog_put_if_absent(new, kw["catalog_row"])  # recover adopts the put's commit
                super().compare_and_swap(name, self.get_or_none(name), new, message=RECOVERED)
                super().compare_and_swap(name, new, rival, message="rival")  # a writer moves on
            return super().compare_and_swap(name, expected, new, **kw)

    table = RecoverThenRival()
    with tsck.open_store(tmp_path / "s", refs=table, block_size=BLOCK, inline_threshold=INLINE) as s:
        first = s.put_snapshot(statelib.conc_state(0, 0), ref="job/main", step=1)
        rival = s.put_snapshot(statelib.conc_state(1, 0), ref="job/rival", step=2)
        table.rival = bytes.fromhex(rival.root)
        info = s.put_snapshot(statelib.conc_state(0, 1), ref="job/main", step=3)
        assert info.parent == first.root and info.step == 3
        assert s.resolve("job/main") == rival.root  # not moved back
        assert [e.new.hex() for e in table.reflog("job/main")] == [first.root, info.root, rival.root]
        assert table.catalog_has(bytes.fromhex(info.root)) and s.fsck().ok
        assert {os.path.basename(k) for k in object_listing(tmp_path / "s") if k.startswith("commits")} == \
            {first.root, rival.root, info.root}  # no second encoding
