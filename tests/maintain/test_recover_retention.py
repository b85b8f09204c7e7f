"""keep_last over a ref table that recover rebuilt: the newest snapshots of the job stay.

recover moves each ref through its commits one ref after the other, so the reflog's
sequence numbers it writes order one ref's snapshots, not a job's: counted as
publications, a job's second ref outranked every snapshot of its first, and keep_last
expired snapshots newer than ones it kept (found by the interleaving harness, file
seed 7, `--focus mix`). Rows recover adds without a move (their ref was moved by a
writer meanwhile) have no number at all, and a writer's numbered rows outranked them
whatever their age. The store-level tests run on real LMDB and PostgreSQL (the table
removed, `recover` run); the ordering itself is checked over every mix of rows with
and without numbers (hypothesis).
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorstore_ck as tsck
from _backends import Backend, lose_ref_table
from tensorstore_ck.maintain.retention import Retention, SnapRow, explain_kept, newest_first_order


@pytest.fixture(params=["file", pytest.param("pg", marks=pytest.mark.slow)])
def where(request, tmp_path) -> Backend:
    if request.param == "pg":
        return Backend("pg", tmp_path, pg_dsn=request.getfixturevalue("pg_dsn"))
    return Backend("file", tmp_path)


def _interleaved(b: Backend, n: int = 4) -> list[bytes]:
    """Job j on two refs, published a1 b1 a2 b2 ...: the roots, oldest first."""
    roots = []
    with b.open(create=True) as s:
        for i in range(n):
            for ref in ("j/a", "j/b"):
                info = s.put_snapshot({"w": torch.full((256,), float(len(roots)))}, ref=ref, step=len(roots))
                roots.append(bytes.fromhex(info.root))
        store_id = s.config["id"]
    lose_ref_table(b, store_id)
    return roots


def _catalog(s: tsck.Store) -> set[bytes]:
    return s.reftable.catalog_roots()


def test_keep_last_after_recover_keeps_the_newest_of_the_job(where):
    """Before: recover numbered j/a's moves 1-4 and j/b's 5-8; keep_last=3 kept b4, b3, b2
    (and a4, a tip) and expired a3, newer than b2 and b3's peer."""
    roots = _interleaved(where)
    with where.open(create_refs=True) as s:
        rep = s.recover()
        assert set(rep.refs_restored) == {"j/a", "j/b"}
        assert s.resolve("j/a") == roots[-2].hex() and s.resolve("j/b") == roots[-1].hex()
        # recover's moves interleave the refs by age: the reflog's numbers follow the job.
        order = s.reftable.publication_order()
        assert sorted(roots, key=order.__getitem__) == roots
        s.set_retention("j", tsck.Retention(keep_last=3))
        s.gc()
        assert _catalog(s) == set(roots[-3:])  # b3 a4 b4
        # A snapshot published after the rebuild is the newest: it and the two newest
        # recovered ones stay.
        info = s.put_snapshot({"w": torch.full((256,), -1.0)}, ref="j/b", step=100)
        s.gc()
        assert _catalog(s) == set(roots[-2:]) | {bytes.fromhex(info.root)}
        assert s.fsck().ok


def test_keep_last_after_recover_beside_a_writer_keeps_the_newest_of_the_job(where):
    """A writer publishes on j/a over the recreated table before recover runs: recover
    leaves j/a where the writer put it and adds a1-a4 without a move (no number), and
    numbers j/b's moves after the writer's. Before: keep_last=3 kept b4, b3, b2 (and the
    writer's a5, a tip) and expired a4, newer than b3 and b2."""
    roots = _interleaved(where)
    with where.open(create_refs=True) as s:
        a5 = bytes.fromhex(s.put_snapshot({"w": torch.full((256,), 99.0)}, ref="j/a", step=99).root)
        rep = s.recover()
        assert set(rep.refs_restored) == {"j/b"} and s.resolve("j/a") == a5.hex()
        order = s.reftable.publication_order()
        assert roots[0] not in order and order[roots[1]] > order[a5]  # the mix the fix is about
        s.set_retention("j", tsck.Retention(keep_last=3))
        s.gc()
        assert _catalog(s) == {a5, roots[-1], roots[-2]}  # a5, b4, a4
        assert s.fsck().ok


def test_a_put_that_lost_its_race_is_one_snapshot_after_recover(where, monkeypatch):
    """A put whose move lost the race re-encodes its commit on the winner's snapshot and
    publishes that; its first encoding stays in storage when the put cannot remove it (the
    writer killed just after its move, the table or the storage away then: here the delete
    fails). recover after a lost table adopted both encodings: one put counted twice by
    keep_last, which expired a snapshot it keeps (the harness, pg seed 20262). Now the
    earlier encoding of a put is not a snapshot of its own."""
    w = lambda x: {"w": torch.full((256,), float(x))}  # noqa: E731
    with where.open(create=True) as s, where.open() as other:
        roots = [bytes.fromhex(s.put_snapshot(w(i), ref="j/main", step=i).root) for i in range(3)]
        cas, raced = s.reftable.compare_and_swap, []

        def racing(*a, **kw):  # another writer moves the ref between this put's commit write and its move
            if not raced:
                raced.append(bytes.fromhex(other.put_snapshot(w(3), ref="j/main", step=3).root))
            return cas(*a, **kw)

        def delete_fails(*_a, **_kw):
            raise OSError("injected: the storage refused the delete")

        monkeypatch.setattr(s.reftable, "compare_and_swap", racing)
        monkeypatch.setattr(s.assets, "delete_objects", delete_fails)
        last = s.put_snapshot(w(4), ref="j/main", step=4)
        monkeypatch.undo()
        assert bytes.fromhex(last.parent) == raced[0]
        assert len(list(s.assets.list_objects("commits"))) == 6  # 5 snapshots + the first encoding
        store_id = s.config["id"]
    lose_ref_table(where, store_id)
    with where.open(create_refs=True) as s:
        rep = s.recover()
        assert s.resolve("j/main") == last.root
        assert [i.step for i in s.log("j/main")] == [4, 3, 2, 1, 0]
        assert len(rep.skipped) == 1 and "earlier encoding" in next(iter(rep.skipped.values()))
        s.set_retention("j", tsck.Retention(keep_last=3))
        s.gc()
        assert _catalog(s) == {roots[2], raced[0], bytes.fromhex(last.root)}
        assert s.fsck().ok


def test_a_put_whose_refused_commit_a_recover_adopted_is_that_snapshot(where, monkeypatch):
    """A recover run over the live table adopts every complete commit it finds, so it may
    adopt the commit of a put whose move is losing a race, before the put re-encodes its
    commit on the winner. The put then published a second snapshot of its state beside the
    adopted one (one put, two snapshots: keep_last counted it twice). Now a put that finds
    its commit adopted after a lost race moves the ref to that commit as it is: one
    snapshot, in the ref's history after the winner's."""
    w = lambda x: {"w": torch.full((256,), float(x))}  # noqa: E731
    with where.open(create=True) as s, where.open() as other:
        roots = [bytes.fromhex(s.put_snapshot(w(i), ref="j/main", step=i).root) for i in range(3)]
        cas, raced = s.reftable.compare_and_swap, []

        def racing(*a, **kw):  # another writer moves the ref, then a recover runs, before this put's move
            if not raced:
                raced.append(bytes.fromhex(other.put_snapshot(w(3), ref="j/main", step=3).root))
                raced.append(other.recover())
            return cas(*a, **kw)

        monkeypatch.setattr(s.reftable, "compare_and_swap", racing)
        last = s.put_snapshot(w(4), ref="j/main", step=4)
        monkeypatch.undo()
        assert raced[1].catalog_rows_added == 1  # this put's first commit, adopted
        assert bytes.fromhex(last.parent) == roots[2] and last.step == 4
        assert s.resolve("j/main") == last.root and [i.step for i in s.log("j/main")] == [4, 3, 2, 1, 0]
        assert s.checkout(last.root)["w"].eq(4.0).all()
        assert len(list(s.assets.list_objects("commits"))) == 5  # no second encoding written
        s.set_retention("j", tsck.Retention(keep_last=3))
        s.gc()
        assert _catalog(s) == {roots[2], raced[0], bytes.fromhex(last.root)}
        assert s.fsck().ok


def test_a_refused_commit_a_recover_adopts_after_the_puts_next_encoding_leaves_with_its_move(where, monkeypatch):
    """The narrower window: the put lost its race and found its first commit not adopted;
    a recover adopts it while the put writes its next encoding. The put's move then drops
    that row in its own transaction (recorded in the reflog), so the put is one snapshot
    at every moment a gc could look, and its first commit is removed after."""
    w = lambda x: {"w": torch.full((256,), float(x))}  # noqa: E731
    with where.open(create=True) as s, where.open() as other:
        roots = [bytes.fromhex(s.put_snapshot(w(i), ref="j/main", step=i).root) for i in range(3)]
        cas, put_commit, seen = s.reftable.compare_and_swap, s.assets.put_commit, []

        def racing(*a, **kw):  # the first move: another writer moved the ref first
            if not seen:
                seen.append(bytes.fromhex(other.put_snapshot(w(3), ref="j/main", step=3).root))
            return cas(*a, **kw)

        def writing(body):  # the second encoding: a recover runs as it is written
            if len(seen) == 1 and s.reftable.get_or_none("j/main") == seen[0]:
                seen.append(other.recover())
            return put_commit(body)

        monkeypatch.setattr(s.reftable, "compare_and_swap", racing)
        monkeypatch.setattr(s.assets, "put_commit", writing)
        last = s.put_snapshot(w(4), ref="j/main", step=4)
        monkeypatch.undo()
        assert seen[1].catalog_rows_added == 1  # the first encoding, adopted
        assert bytes.fromhex(last.parent) == seen[0] and s.resolve("j/main") == last.root
        assert [i.step for i in s.log("j/main")] == [4, 3, 2, 1, 0]
        assert _catalog(s) == set(roots) | {seen[0], bytes.fromhex(last.root)}
        assert s.reftable.reflog("j/main")[-1].op == "forget"
        assert len(list(s.assets.list_objects("commits"))) == 5
        assert s.fsck().ok


@pytest.mark.parametrize("deleted", [True, False], ids=["deleted", "delete-failed"])
def test_a_refused_commit_a_recover_listed_before_and_adopts_after_the_puts_move_is_dropped_again(where,
                                                                                                   monkeypatch,
                                                                                                   deleted):
    """The last window: a recover lists the commits while a put's first encoding (refused:
    the put lost its race) is the only one, and adopts it only after the put published its
    next encoding and deleted the refused one (or failed to). Its row would name a missing
    commit, or make the put two snapshots; recover lists the commits again before it ends
    and drops that row (a forget record)."""
    import threading
    w = lambda x: {"w": torch.full((256,), float(x))}  # noqa: E731
    with where.open(create=True) as s, where.open() as other, where.open() as rec:
        roots = [bytes.fromhex(s.put_snapshot(w(i), ref="j/main", step=i).root) for i in range(3)]
        cas, put_commit, adopt = s.reftable.compare_and_swap, s.assets.put_commit, rec.reftable.catalog_put_if_absent
        listed, put_done, seen, out = threading.Event(), threading.Event(), [], {}

        def racing(*a, **kw):  # the first move: another writer moved the ref first
            if not seen:
                seen.append(bytes.fromhex(other.put_snapshot(w(3), ref="j/main", step=3).root))
            return cas(*a, **kw)

        def adopting(root, row):  # the recover, at the refused commit: after the put ended
            if row.get("step") == 4:
                listed.set()
                assert put_done.wait(60)
            return adopt(root, row)

        def writing(body):  # the second encoding: a recover has listed the commits before it
            if len(seen) == 1 and s.reftable.get_or_none("j/main") == seen[0]:
                seen.append(threading.Thread(target=lambda: out.update(rep=rec.recover()), daemon=True))
                seen[1].start()
                assert listed.wait(60)
            return put_commit(body)

        monkeypatch.setattr(s.reftable, "compare_and_swap", racing)
        monkeypatch.setattr(s.assets, "put_commit", writing)
        monkeypatch.setattr(rec.reftable, "catalog_put_if_absent", adopting)
        if not deleted:
            def delete_fails(*_a, **_kw):
                raise OSError("injected: the storage refused the delete")
            monkeypatch.setattr(s.assets, "delete_objects", delete_fails)
        last = s.put_snapshot(w(4), ref="j/main", step=4)
        put_done.set()
        seen[1].join(60)
        monkeypatch.undo()
        rep = out["rep"]
        why = "deleted while recover ran" if deleted else "an earlier encoding of the put"
        assert rep.catalog_rows_added == 0 and any(why in said for said in rep.skipped.values()), rep
        assert bytes.fromhex(last.parent) == seen[0] and s.resolve("j/main") == last.root
        assert _catalog(s) == set(roots) | {seen[0], bytes.fromhex(last.root)}
        assert [i.step for i in s.log("j/main")] == [4, 3, 2, 1, 0]
        assert s.fsck().ok


def test_recovered_numbers_count_within_a_ref_not_across_refs():
    """Along one ref recover's numbers are the parent chain (they win over a clock that
    went back); across refs, and against published rows, age decides."""
    # j/a's clock stepped back: a2 is older by time than a1, but recover put it after a1.
    a1 = SnapRow(b"a1", 1, 500.0, {}, seq=5, ref="j/a", recovered=True)
    a2 = SnapRow(b"a2", 2, 100.0, {}, seq=6, ref="j/a", recovered=True)
    b1 = SnapRow(b"b1", 1, 200.0, {}, seq=1, ref="j/b", recovered=True)
    b2 = SnapRow(b"b2", 2, 300.0, {}, seq=2, ref="j/b", recovered=True)
    c1 = SnapRow(b"c1", 1, 250.0, {}, seq=None, ref="j/c")
    w1 = SnapRow(b"w1", 7, 400.0, {}, seq=9, ref="j/b")   # published after the rebuild
    w2 = SnapRow(b"w2", 8, 450.0, {}, seq=10, ref="j/a")
    rows = [a1, a2, b1, b2, c1, w1, w2]
    got = [r.root for r in newest_first_order(rows)]
    # a1 is newer than both published rows, a2 follows a1 on its chain; b1, c1, b2 are
    # older than both, whatever recover numbered them.
    assert got == [b"a2", b"a1", b"w2", b"w1", b"b2", b"c1", b"b1"]
    for _ in range(20):
        random.shuffle(rows)
        assert [r.root for r in newest_first_order(rows)] == got


# ------------------------------------------------------------------ every mix, hypothesis
KINDS = ("published", "recovered", "none")


@st.composite
def _rows(draw, consistent: bool):
    """Rows of one job: published (a writer's number), recovered (recover's number, per
    ref) or without a number. With `consistent`, every number agrees with the age (a
    clock that never went back): published numbers across the job, recovered ones
    along each ref."""
    n = draw(st.integers(0, 14))
    ages = draw(st.lists(st.tuples(st.integers(0, 40), st.one_of(st.none(), st.integers(0, 40))),
                         min_size=n, max_size=n, unique=True))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=n, max_size=n))
    refs = draw(st.lists(st.sampled_from(["j/a", "j/b", "j/c"]), min_size=n, max_size=n))
    order = list(range(n))
    if consistent:
        order.sort(key=lambda i: (ages[i][0], -1 if ages[i][1] is None else ages[i][1]))
    else:
        order = draw(st.permutations(order))
    seq = {i: k for k, i in enumerate(order)}  # one counter, as the reflog's
    return [SnapRow(f"r{i}".encode(), ages[i][1], float(ages[i][0]), {},
                    None if kinds[i] == "none" else seq[i], refs[i], kinds[i] == "recovered") for i in range(n)]


def _age(r: SnapRow) -> tuple:
    return (r.time, -1 if r.step is None else r.step)


def _kept(rows, k: int) -> set[bytes]:
    return set(explain_kept(rows, Retention(keep_last=k), 0.0))


@settings(max_examples=300, deadline=None)
@given(_rows(consistent=False))
def test_keep_last_never_expires_what_its_order_says_is_newer(rows):
    """Whatever the numbers say: published rows keep their order; a published row is never
    kept while a newer one without a publication number goes; recover's numbers order
    one ref; and the rows' order in the input does not matter."""
    ranked = newest_first_order(rows)
    assert sorted(r.root for r in ranked) == sorted(r.root for r in rows)
    rank = {r.root: i for i, r in enumerate(ranked)}  # 0 = newest
    for x in rows:
        for y in rows:
            pub = lambda r: r.seq is not None and not r.recovered  # noqa: E731
            if pub(x) and pub(y) and x.seq > y.seq:
                assert rank[x.root] < rank[y.root]
            if pub(y) and not pub(x) and _age(x) > _age(y):
                assert rank[x.root] < rank[y.root], (x, y)
            if x.recovered and y.recovered and x.ref == y.ref and x.seq > y.seq:
                assert rank[x.root] < rank[y.root]
            if x.seq is None and y.seq is None and x.ref == y.ref and _age(x) > _age(y):
                assert rank[x.root] < rank[y.root]
    for k in range(len(rows) + 1):
        assert _kept(rows, k) == {r.root for r in ranked[:k]}
        assert _kept(list(reversed(rows)), k) == _kept(rows, k)


@settings(max_examples=300, deadline=None)
@given(_rows(consistent=True))
def test_keep_last_keeps_the_newest_whatever_mix_of_numbers(rows):
    """When no clock went back, keep_last=N keeps exactly the N newest by (time, step),
    whichever rows have a publication number, recover's or none."""
    by_age = sorted(rows, key=_age, reverse=True)
    for k in range(len(rows) + 1):
        assert _kept(rows, k) == {r.root for r in by_age[:k]}, k
