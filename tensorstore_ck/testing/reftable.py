"""RefTableTests: the RefTable contract (tensorstore_ck/refs/base.py), for any ref table.
Subclass it in a test module and provide the fixture `open_table`, a callable that opens
a new handle on this test's table (an empty one of its own) and closes every handle it
opened afterwards:

    class TestMyTable(RefTableTests):
        persistent = True                      # the table outlives its handle

        @pytest.fixture
        def open_table(self, tmp_path):
            handles = []
            def open_():
                handles.append(MyRefTable(str(tmp_path / "refs")))
                return handles[-1]
            yield open_
            for h in handles:
                h.close()

The logic is written once in RefTable, so what differs between backends is their
transactions (_read/_write over a Txn) and close(); this suite runs the logic over each.
A few tests leave rows past that logic (an older writer's moves, a damaged rebuild mark)
through the fixtures `write_rows` and `read_rows`: the table's own _write and _read."""

from __future__ import annotations

import os

import pytest

from ..errors import Fenced, GcBusy, InvalidArgument, RebuildUnfinished, RefConflict, RefNotFound
from ..format.records import encode_record
from ._common import fast_switching, run_threads
from .reftable_rows import RefTableRowsTests

__all__ = ["RefTableTests"]


class RefTableTests(RefTableRowsTests):
    """The RefTable contract, whole (see the module's docstring; the class flags are
    RefTableRowsTests')."""

    # -- removals: delete_ref, forget, tag_delete ------------------------------------------
    def test_delete_ref_drops_its_history_but_not_what_others_keep(self, table):
        R = self.R
        prev = None
        for i in (1, 2, 3, 4):  # r: R1 -> R2 -> R3 -> R4
            table.compare_and_swap("r", prev, R[i], message=f"m{i}", catalog_row={"ref": "r", "step": i})
            prev = R[i]
        table.compare_and_swap("o", None, R[5], message="o", catalog_row={"ref": "o", "step": 0})
        table.compare_and_swap("o", R[5], R[2], message="o->R2")  # o's tip is in r's history
        table.tag_create("t", R[3])
        table.pin(R[1])
        table.catalog_put_if_absent(R[6], {"ref": "r", "step": 9})  # a row recover added, no move
        with pytest.raises(RefConflict) as ei:
            table.delete_ref("r", R[3])
        assert (ei.value.expected, ei.value.actual) == (R[3].hex(), R[4].hex())
        assert table.get("r") == R[4]  # a refused delete changes nothing
        with pytest.raises(RefNotFound):
            table.delete_ref("nope")
        assert table.delete_ref("r", R[4], message="bye") == (R[4], 2)  # R4 and R6; R1-R3 kept by others
        assert table.get_or_none("r") is None and [n for n, _ in table.list()] == ["o"]
        assert {k for k, _ in table.catalog_iter()} == {R[1], R[2], R[3], R[5]}
        assert table.history("r") is None and table.step_root("r", 4) is None
        last = table.reflog("r")[-1]
        assert (last.op, last.old, last.new, last.message) == ("delete", R[4], R[4], "bye")
        deleted, forgotten = table.removed()
        assert set(deleted) == {"r"} and forgotten == set()
        order = table.publication_order()  # removals are not publications: R4's rank is its move's
        assert order[R[2]] > order[R[4]] > order[R[3]]  # o's move to R2 came after R4's publication
        # A snapshot of the deleted history that another ref still kept, forgotten later: the
        # record goes to the deleted ref's reflog, which stays a deleted ref's.
        table.compare_and_swap("o", R[2], R[5], message="o moves on")
        table.forget(R[2], "r")
        assert table.history("r") is None and table.catalog_get(R[2]) is None
        # The name is free again; its new history starts after the removal.
        table.compare_and_swap("r", None, R[7], message="again", catalog_row={"ref": "r", "step": 1})
        assert [root for root, _row in table.history("r")] == [R[7]]
        assert table.step_root("r", 1) == R[7] and table.removed()[0] == {}

    def test_undelete_and_the_shared_namespace_of_refs_and_tags(self, table):
        R = self.R
        table.compare_and_swap("r", None, R[1], message="m1", catalog_row={"ref": "r", "step": 1})
        table.compare_and_swap("r", R[1], R[2], message="m2", catalog_row={"ref": "r", "step": 2})
        epoch = table.gc_state()["epoch"]
        with pytest.raises(RefConflict, match="exists again"):
            table.undelete("r", R[2], {"ref": "r", "step": 2}, fence=epoch)
        with pytest.raises(RefConflict, match="a ref has this name"):
            table.tag_create("r", R[1])
        assert table.deleted_ref_root("r") is None
        table.delete_ref("r")
        assert table.deleted_ref_root("r") == R[2] and table.catalog_get(R[2]) is None
        with pytest.raises(RefConflict, match="a deleted ref has this name"):
            table.tag_create("r", R[2])
        with pytest.raises(RefConflict, match="a deleted ref has this name"):
            table.tag_adopt("r", R[2], {"ref": "r", "step": 2}, fence=epoch)
        assert table.tags() == [] and table.catalog_get(R[2]) is None
        with pytest.raises(Fenced):
            table.undelete("r", R[2], {"ref": "r", "step": 2}, fence=epoch + 2)
        with pytest.raises(RefNotFound):
            table.undelete("never", R[2], {"ref": "never", "step": 2}, fence=epoch)
        assert table.get_or_none("r") is None
        table.undelete("r", R[2], {"ref": "r", "step": 2}, fence=epoch)
        assert table.get("r") == R[2] and table.catalog_get(R[2])["step"] == 2
        assert [root for root, _row in table.history("r")] == [R[2]] and table.step_root("r", 2) == R[2]
        assert table.reflog("r")[-1].op == "move" and table.deleted_ref_root("r") is None
        assert table.removed()[0] == {}  # recover no longer skips it
        # A ref is never created over a tag either.
        table.tag_create("t", R[1])
        with pytest.raises(RefConflict, match="a tag has this name"):
            table.compare_and_swap("t", None, R[3], message="x")

    def test_forget_refuses_what_is_kept_and_is_recorded(self, table):
        R = self.R
        prev = None
        for i in (1, 2, 3):
            table.compare_and_swap("r", prev, R[i], message=f"m{i}", catalog_row={"ref": "r", "step": i})
            prev = R[i]
        table.tag_create("t", R[2])
        for root in (R[3], R[2]):  # the tip, a tag's target
            with pytest.raises(InvalidArgument):
                table.forget(root, "r")
        table.pin(R[1])
        with pytest.raises(InvalidArgument):
            table.forget(R[1], "r")
        table.unpin(R[1])
        table.forget(R[1], "r")
        with pytest.raises(RefNotFound):
            table.forget(R[1], "r")  # forgotten already
        assert table.catalog_get(R[1]) is None and table.step_root("r", 1) is None
        assert [root for root, _row in table.history("r")] == [R[3], R[2]]
        assert table.reflog("r")[-1].op == "forget" and table.removed() == ({}, {R[1]})
        assert table.get("r") == R[3]
        table.compact_history(tail=0)
        assert [e.op for e in table.reflog("r")] == ["move", "move", "forget"]  # removals stay

    def test_a_move_drops_the_rows_of_the_encodings_it_supersedes_unless_kept(self, table):
        """compare_and_swap(superseded=): rows a recover gave a put's earlier encodings go
        in the move's transaction, each recorded as a forget; a tag's target, a pin or a
        ref's tip stays; a root with no row and the new root itself are left alone."""
        R = self.R
        table.compare_and_swap("r", None, R[1], message="m1", catalog_row={"ref": "r", "step": 1})
        for root in (R[2], R[3], R[4]):  # adopted by a recover
            table.catalog_put_if_absent(root, {"ref": "r", "step": 2})
        table.tag_create("t", R[3])
        table.pin(R[4])
        table.compare_and_swap("r", R[1], R[5], message="m5", catalog_row={"ref": "r", "step": 2},
                               superseded=(R[2], R[3], R[4], R[6], R[5]))
        assert table.get("r") == R[5] and table.catalog_get(R[2]) is None
        assert all(table.catalog_get(root) is not None for root in (R[1], R[3], R[4], R[5]))
        assert [(e.op, e.new) for e in table.reflog("r")] == [("move", R[1]), ("move", R[5]), ("forget", R[2])]
        assert table.removed() == ({}, {R[2]})

    def test_tag_delete(self, table):
        R = self.R
        table.compare_and_swap("r", None, R[1], message="c")
        table.tag_create("t", R[1])
        assert table.tag_delete("t") == R[1]
        assert table.tag_get("t") is None and table.tags() == []
        with pytest.raises(RefNotFound):
            table.tag_delete("t")
        table.tag_create("t", R[1])  # the name is free again
        assert table.tag_get("t") == R[1]

    def test_retention_set_and_all(self, table):
        assert table.retention_all() == {}
        table.retention_set("job", {"keep_last": 3})
        table.retention_set("other/job", {"keep_best": ["loss", "min", 2], "max_age_days": 1.5})
        assert table.retention_all() == {"job": {"keep_last": 3},
                                         "other/job": {"keep_best": ["loss", "min", 2], "max_age_days": 1.5}}
        table.retention_set("job", {"keep_last": 5})  # replaces
        assert table.retention_all()["job"] == {"keep_last": 5}
        table.retention_set("job", None)  # None clears
        table.retention_set("never-set", None)
        assert table.retention_all() == {"other/job": {"keep_best": ["loss", "min", 2], "max_age_days": 1.5}}

    # -- gc state machine ------------------------------------------------------------------
    def test_gc_state_machine(self, table):
        st = table.gc_state()
        assert (st["epoch"], st["phase"]) == (0, "idle")
        st = table.gc_begin("g1", lease=10, now=100.0)
        assert (st["epoch"], st["phase"], st["owner"]) == (0, "marking", "g1")
        assert table.gc_state()["phase"] == "marking"
        assert table.gc_heartbeat("g1", now=104.0)["expires"] == 114.0  # renewed: lease from now
        with pytest.raises(GcBusy):
            table.gc_heartbeat("someone-else", now=104.0)
        with pytest.raises(GcBusy):
            table.gc_freeze("someone-else", now=104.0)
        st = table.gc_freeze("g1", now=106.0)
        assert (st["epoch"], st["phase"]) == (1, "deleting")  # odd exactly while deleting
        assert table.gc_state()["epoch"] == 1
        with pytest.raises(GcBusy):
            table.gc_freeze("g1", now=106.5)  # only a marking gc freezes
        table.gc_heartbeat("g1", now=107.0)
        st = table.gc_finish("g1", now=108.0, deleted=5)
        assert (st["epoch"], st["phase"], st["owner"]) == (2, "idle", None)
        assert table.gc_state()["deleted"] == 5
        with pytest.raises(GcBusy):
            table.gc_heartbeat("g1", now=109.0)  # finished: it holds nothing
        # a dry run: marking -> idle, no deletion phase, the epoch does not move
        table.gc_begin("g2", lease=10, now=200.0)
        st = table.gc_finish("g2", now=201.0)
        assert (st["epoch"], st["phase"]) == (2, "idle")

    def test_a_second_gc_is_busy_until_the_first_is_stale(self, table):
        table.gc_begin("g1", lease=10, now=100.0)
        with pytest.raises(GcBusy):
            table.gc_begin("g2", lease=10, now=105.0)  # g1 is alive
        table.gc_heartbeat("g1", now=108.0)
        with pytest.raises(GcBusy):
            table.gc_begin("g2", lease=10, now=115.0)  # the heartbeat renewed the lease
        st = table.gc_begin("g2", lease=10, now=118.0)  # a stale marking gc is taken over
        assert (st["epoch"], st["owner"]) == (0, "g2")
        with pytest.raises(GcBusy):
            table.gc_heartbeat("g1", now=119.0)  # g1 lost its lock
        table.gc_freeze("g2", now=119.0)
        with pytest.raises(GcBusy):
            table.gc_begin("g3", lease=10, now=120.0)
        st = table.gc_begin("g3", lease=10, now=200.0)  # a stale deleting gc: epoch closed
        assert (st["epoch"], st["phase"], st["owner"]) == (2, "marking", "g3")
        with pytest.raises(GcBusy):
            table.gc_finish("g2", now=201.0)

    # -- the rebuild mark (recover under gc) ------------------------------------------------
    def test_an_unfinished_rebuild_refuses_every_gc_lock_for_deleting(self, table, write_rows):
        assert table.rebuild_unfinished() is None  # a table without the mark is complete
        assert table.rebuild_begin("rec1") is None
        mark = table.rebuild_unfinished()
        assert mark["owner"] == "rec1" and isinstance(mark["started"], float)
        for what in ("gc", "prune"):
            with pytest.raises(RebuildUnfinished, match=rf"{what} refused.*`tsck recover`.*nothing was deleted"):
                table.gc_begin("g", lease=10, now=100.0, what=what)
        assert table.gc_state()["phase"] == "idle"
        st = table.gc_begin("fsck", lease=10, now=100.0, rebuilding_ok=True)  # deletes nothing reachable
        table.gc_finish(st["owner"], now=101.0)
        # a second recover (the first was killed) takes the mark over; only a finish clears it
        assert table.rebuild_begin("rec2")["owner"] == "rec1"
        assert table.rebuild_unfinished()["owner"] == "rec2"
        table.rebuild_finish()
        assert table.rebuild_unfinished() is None
        table.gc_begin("g", lease=10, now=200.0)
        table.gc_finish("g", now=201.0)
        # stored bytes are untrusted: a mark that does not decode, or odd fields, still refuses
        for raw in (b"\xc1", encode_record({"owner": ["x"], "started": "soon"}), encode_record({"started": 1e300})):
            write_rows(lambda t, raw=raw: t.put("meta", b"rebuild", raw))
            assert table.rebuild_unfinished() is not None
            with pytest.raises(RebuildUnfinished, match="`tsck recover`"):
                table.gc_begin("g", lease=10, now=300.0)
        table.rebuild_finish()

    def test_a_rebuild_waits_for_a_live_gc_and_closes_a_dead_ones_lock(self, table):
        table.gc_begin("g1", lease=10, now=100.0)
        table.gc_freeze("g1", now=101.0)
        with pytest.raises(GcBusy):
            table.rebuild_begin("rec", now=105.0)  # g1's lease runs: it may be deleting
        assert table.rebuild_unfinished() is None
        table.rebuild_begin("rec", now=200.0)  # g1's lease ran out: closed, epoch even again
        st = table.gc_state()
        assert (st["phase"], st["owner"], st["epoch"] % 2) == ("idle", None, 0)
        with pytest.raises(GcBusy):
            table.gc_heartbeat("g1", now=201.0)  # a gc that outlived its lease cannot go on
        with pytest.raises(RebuildUnfinished):
            table.gc_begin("g2", lease=10, now=300.0)

    def test_fenced_compare_and_swap(self, table):
        R = self.R
        table.gc_begin("g1", lease=10, now=100.0)
        # a writer fenced at epoch 0 may move refs while gc only marks ...
        table.compare_and_swap("r", None, R[1], message="c", fence=0)
        table.gc_freeze("g1", now=106.0)
        # ... but not once a deletion phase started: neither with the old fence nor the odd one
        for fence in (0, 1, 2):
            with pytest.raises(Fenced):
                table.compare_and_swap("r", R[1], R[2], message="m", fence=fence)
        table.compare_and_swap("u", None, R[3], message="unfenced")  # fence=None: not checked
        assert table.get("r") == R[1]
        table.gc_finish("g1", now=107.0)
        with pytest.raises(Fenced):
            table.compare_and_swap("r", R[1], R[2], message="m", fence=0)  # the fence moved
        table.compare_and_swap("r", R[1], R[2], message="m", fence=2)
        # the fence is checked before the ref: a stale fence is Fenced, not RefConflict
        table.gc_begin("g2", lease=10, now=300.0)
        table.gc_freeze("g2", now=301.0)
        with pytest.raises(Fenced):
            table.compare_and_swap("r", R[9], R[4], message="m", fence=2)
        assert [e.new for e in table.reflog("r")] == [R[1], R[2]]

    def test_a_writers_hold_defers_the_deletion_phase(self, table):
        """Liveness for fenced writers: a hold taken while the epoch is even keeps a gc
        from freezing until the hold's move releases it, or it runs out on the table's clock."""
        R = self.R
        table.gc_begin("g1", lease=10, now=100.0)
        assert table.gc_hold("w1", seconds=5, now=100.5) == 0  # marking: even, the new fence
        st = table.gc_freeze("g1", now=101.0)
        assert (st["epoch"], st["phase"]) == (0, "marking") and st["held"] == pytest.approx(4.5)
        assert table.gc_hold("w1", seconds=5, now=102.0) == 0  # renewed: until 107
        st = table.gc_freeze("g1", now=106.0)
        assert st["epoch"] == 0 and st["held"] == pytest.approx(1.0)
        # the writer's fenced move goes through and releases the hold in its transaction
        table.compare_and_swap("r", None, R[1], message="c", fence=0, hold="w1")
        st = table.gc_freeze("g1", now=106.5)
        assert (st["epoch"], st["phase"], st["held"]) == (1, "deleting", 0.0)
        assert table.gc_hold("w2", now=106.6) is None  # a deletion phase runs: no hold
        table.gc_finish("g1", now=107.0)
        # a hold that runs out no longer defers anything; two holders: the longer one counts
        table.gc_begin("g2", lease=10, now=200.0)
        assert table.gc_hold("w2", seconds=3, now=200.0) == 2
        assert table.gc_hold("w3", seconds=8, now=200.0) == 2
        assert table.gc_freeze("g2", now=202.0)["held"] == pytest.approx(6.0)
        table.gc_unhold("w3")
        table.gc_unhold("w3")  # releasing twice is harmless
        assert table.gc_freeze("g2", now=203.5)["epoch"] == 3  # w2 ran out at 203
        with pytest.raises(Fenced):
            table.compare_and_swap("r", R[1], R[2], message="m", fence=2, hold="w2")
        table.gc_finish("g2", now=204.0)
        assert "holds" not in table.gc_state()  # the freeze cleared them
        assert table.get("r") == R[1]

    def test_a_gc_deletes_in_phases_and_a_hold_taken_during_one_defers_the_next(self, table):
        """gc_thaw closes a phase and keeps the lock; a writer fenced by that phase takes
        its hold while the phase still runs (None: no fence yet), and the next freeze
        waits for it, so the gap between two phases cannot be missed by polling."""
        R = self.R
        table.gc_begin("g1", lease=10, now=100.0)
        assert table.gc_freeze("g1", now=100.5)["epoch"] == 1
        assert table.gc_hold("w1", seconds=5, now=101.0) is None  # recorded, no fence yet
        st = table.gc_thaw("g1", now=101.5)
        assert (st["epoch"], st["phase"], st["owner"]) == (2, "marking", "g1")
        st = table.gc_freeze("g1", now=102.0)
        assert (st["epoch"], st["phase"]) == (2, "marking") and st["held"] == pytest.approx(4.0)
        assert table.gc_hold("w1", seconds=5, now=102.5) == 2  # the new fence
        table.compare_and_swap("r", None, R[1], message="c", fence=2, hold="w1")
        assert table.gc_freeze("g1", now=103.0)["epoch"] == 3  # the move released the hold
        with pytest.raises(GcBusy):
            table.gc_thaw("g2", now=103.5)  # not the owner
        table.gc_thaw("g1", now=104.0)
        with pytest.raises(GcBusy):
            table.gc_thaw("g1", now=104.5)  # no phase open
        st = table.gc_finish("g1", now=105.0)
        assert (st["epoch"], st["phase"]) == (4, "idle")

    def test_prune_requests_are_queued_and_served_by_an_expiry(self, table):
        R = self.R
        table.compare_and_swap("a", None, R[1], message="c", catalog_row={"job": "a"})
        table.compare_and_swap("a", R[1], R[2], message="c", catalog_row={"job": "a"})
        tok_a = table.prune_request("a")
        tok_b = table.prune_request("b")
        assert table.prune_pending("a", tok_a) and table.prune_pending("b", tok_b)
        read = table.prune_requests()
        assert set(read) == {"a", "b"}
        tok_b2 = table.prune_request("b")  # queued again after the read: not served by it
        assert not table.prune_pending("b", tok_b)
        assert table.catalog_expire([R[1]], served=read) == [R[1]]
        assert not table.prune_pending("a", tok_a)
        assert table.prune_pending("b", tok_b2)
        assert set(table.prune_requests()) == {"b"}
        assert table.gc_state()["epoch"] == 0  # the queue is beside the gc state, not in it

    def test_gc_abort_stale_closes_a_dead_deletion_phase(self, table):
        st = table.gc_abort_stale(now=50.0)
        assert (st["epoch"], st["phase"]) == (0, "idle")  # nothing to close
        table.gc_begin("g3", lease=10, now=200.0)
        assert table.gc_abort_stale(now=300.0)["phase"] == "marking"  # marking deletes nothing
        table.gc_freeze("g3", now=301.0)
        assert table.gc_abort_stale(now=305.0)["epoch"] == 1  # still fresh: untouched
        st = table.gc_abort_stale(now=315.0)
        assert (st["epoch"], st["phase"], st["owner"]) == (2, "idle", None)
        assert table.gc_state()["epoch"] == 2
        with pytest.raises(GcBusy):
            table.gc_heartbeat("g3", now=316.0)  # the dead gc lost its lock
        table.compare_and_swap("r", None, self.R[1], message="c", fence=2)

    # -- concurrency -----------------------------------------------------------------------
    def test_racing_compare_and_swap_has_one_winner_per_round(self, table, open_table):
        n, rounds = 6, 15
        handles = self._handles(table, open_table, n)
        table.compare_and_swap("race", None, self.R[0], message="start")
        wins = []
        for r in range(rounds):
            cur = table.get("race")
            news = [os.urandom(32) for _ in range(n)]
            with fast_switching():
                res = run_threads(n, lambda i: handles[i].compare_and_swap(
                    "race", cur, news[i], message=f"{r}:{i}"))
            winners = [i for i, x in enumerate(res) if x is None]
            assert len(winners) == 1, res
            losers = [x for x in res if x is not None]
            assert all(isinstance(x, RefConflict) for x in losers), losers
            assert {x.actual for x in losers} <= {news[winners[0]].hex()}
            assert table.get("race") == news[winners[0]]
            wins.append(news[winners[0]])
        log = table.reflog("race")
        assert [e.new for e in log] == [self.R[0]] + wins
        assert all(b.old == a.new for a, b in zip(log, log[1:]))

    def test_racing_exclusive_operations_have_one_winner(self, table, open_table):
        """tag_create, catalog_put_if_absent and gc_begin are exclusive under threads too."""
        n = 6
        handles = self._handles(table, open_table, n)
        roots = [os.urandom(32) for _ in range(n)]

        def tag(i):
            handles[i].tag_create("v1", roots[i])

        with fast_switching():
            res = run_threads(n, tag)
            assert sum(x is None for x in res) == 1, res
            assert all(isinstance(x, RefConflict) for x in res if x is not None)
            assert table.tag_get("v1") == roots[res.index(None)]

            res = run_threads(n, lambda i: handles[i].catalog_put_if_absent(self.R[1], {"step": i}))
            assert res.count(True) == 1 and res.count(False) == n - 1, res
            assert table.catalog_get(self.R[1]) == {"step": res.index(True)}

            res = run_threads(n, lambda i: handles[i].gc_begin(f"g{i}", lease=10, now=100.0))
            assert sum(isinstance(x, dict) for x in res) == 1, res
            assert all(isinstance(x, GcBusy) for x in res if not isinstance(x, dict))
            assert table.gc_state()["owner"] == f"g{[isinstance(x, dict) for x in res].index(True)}"

    # -- persistence -----------------------------------------------------------------------
    def test_state_persists_across_reopen(self, table, open_table):
        if not self.persistent:
            pytest.skip(f"{type(table).__name__} keeps nothing once closed")
        R = self.R
        table.compare_and_swap("r", None, R[1], message="c", catalog_row={"step": 1})
        table.compare_and_swap("r", R[1], R[2], message="m", catalog_row={"step": 2})
        table.tag_create("t", R[1])
        table.pin(R[2])
        table.retention_set("job", {"keep_last": 2})
        table.gc_begin("g", lease=10, now=10.0)
        table.gc_freeze("g", now=11.0)
        table.close()
        again = open_table()
        assert again.get("r") == R[2]
        assert [(e.old, e.new, e.message) for e in again.reflog("r")] == [(None, R[1], "c"), (R[1], R[2], "m")]
        assert dict(again.catalog_iter()) == {R[1]: {"step": 1}, R[2]: {"step": 2}}
        assert again.tags() == [("t", R[1])] and again.pins() == {R[2]}
        assert again.retention_all() == {"job": {"keep_last": 2}}
        st = again.gc_state()
        assert (st["epoch"], st["phase"], st["owner"]) == (1, "deleting", "g")
        again.compare_and_swap("r", R[2], R[3], message="after")  # the reflog sequence goes on
        assert [e.message for e in again.reflog("r")] == ["c", "m", "after"]
