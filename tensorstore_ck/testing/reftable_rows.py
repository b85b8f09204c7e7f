"""RefTableRowsTests: the first half of the RefTable contract (tensorstore_ck/refs/base.py):
refs and their compare-and-swap, the reflog, the steps index, the catalog, tags, pins and
retention. RefTableTests (reftable.py) adds removals, the gc state machine, the rebuild
mark, concurrency and persistence; subclass that one."""

from __future__ import annotations

import struct
import time

import pytest

from ..errors import Fenced, RefConflict, RefNotFound
from ..format.records import encode_record, encode_reflog
from ._common import TableSuite

__all__ = ["RefTableRowsTests"]


class RefTableRowsTests(TableSuite):
    """The RefTable contract (tensorstore_ck/refs/base.py): the logic is written once in
    RefTable, so what differs between backends is their transactions (_read/_write over
    a Txn) and close(); this suite runs the logic over each. The fixture and the class
    flags a subclass gives: TableSuite's (_common.py)."""

    # Rows written and read past the table's logic (an older writer's rows, a damaged
    # mark): in the table's own transactions, RefTable._write and ._read over a Txn, which
    # every backend built on RefTable implements. Override for a table reached otherwise.
    @pytest.fixture
    def write_rows(self, table):
        return table._write

    @pytest.fixture
    def read_rows(self, table):
        return table._read

    def _handles(self, table, open_table, n):
        return [open_table() for _ in range(n)] if self.independent_handles else [table] * n

    # -- refs: get, compare-and-swap -------------------------------------------------------
    def test_missing_ref(self, table):
        with pytest.raises(RefNotFound):
            table.get("a/b")
        with pytest.raises(KeyError):  # RefNotFound is a KeyError too
            table.get("a/b")
        assert table.get_or_none("a/b") is None
        assert table.list() == [] and table.reflog("a/b") == []

    def test_cas_create_move_and_conflicts(self, table):
        R = self.R
        table.compare_and_swap("a/b", None, R[1], message="create")
        assert table.get("a/b") == R[1] and table.get_or_none("a/b") == R[1]
        with pytest.raises(RefConflict) as ei:  # expected None: the ref must not exist
            table.compare_and_swap("a/b", None, R[2], message="create again")
        assert (ei.value.name, ei.value.expected, ei.value.actual) == ("a/b", None, R[1].hex())
        with pytest.raises(RefConflict) as ei:  # a stale expected
            table.compare_and_swap("a/b", R[3], R[2], message="stale")
        assert (ei.value.expected, ei.value.actual) == (R[3].hex(), R[1].hex())
        with pytest.raises(RefConflict) as ei:  # expected a tip, but there is no such ref
            table.compare_and_swap("c", R[1], R[2], message="absent")
        assert (ei.value.name, ei.value.expected, ei.value.actual) == ("c", R[1].hex(), None)
        assert table.get("a/b") == R[1]
        table.compare_and_swap("a/b", R[1], R[2], message="move", catalog_row={"step": 2})
        assert table.get("a/b") == R[2]
        table.compare_and_swap("a/b", R[2], R[2], message="same")  # a move to itself is a move
        assert table.catalog_get(R[2]) == {"step": 2}
        assert table.catalog_get(R[1]) is None
        assert [e.message for e in table.reflog("a/b")] == ["create", "move", "same"]

    def test_refused_moves_leave_no_trace(self, table):
        R = self.R
        table.compare_and_swap("r", None, R[1], message="c", catalog_row={"step": 1})
        with pytest.raises(RefConflict):
            table.compare_and_swap("r", R[5], R[2], message="stale", catalog_row={"step": 2})
        table.gc_begin("g", lease=10, now=1.0)
        table.gc_freeze("g", now=2.0)
        with pytest.raises(Fenced):
            table.compare_and_swap("r", R[1], R[3], message="fenced", catalog_row={"step": 3}, fence=0)
        assert table.get("r") == R[1]
        assert [e.new for e in table.reflog("r")] == [R[1]]
        assert table.catalog_get(R[2]) is None and table.catalog_get(R[3]) is None
        assert [k for k, _ in table.catalog_iter()] == [R[1]]
        table.gc_finish("g", now=3.0)
        table.compare_and_swap("r", R[1], R[4], message="m")  # the reflog goes on without a gap
        assert [(e.old, e.new) for e in table.reflog("r")] == [(None, R[1]), (R[1], R[4])]

    # -- reflog, list ----------------------------------------------------------------------
    def test_reflog_one_entry_per_move_oldest_first(self, table):
        R = self.R
        t0 = time.time()
        prev = None
        for i in range(1, 8):
            table.compare_and_swap("job/main", prev, R[i], message=f"step {i}")
            prev = R[i]
        # other refs whose names extend this one's as bytes must not bleed into its log
        table.compare_and_swap("job/main2", None, R[9], message="x")
        table.compare_and_swap("job/main/sub", None, R[10], message="x")
        table.compare_and_swap("job", None, R[11], message="x")
        log = table.reflog("job/main")
        assert [(e.name, e.old, e.new, e.message) for e in log] == [
            ("job/main", R[i - 1] if i > 1 else None, R[i], f"step {i}") for i in range(1, 8)]
        times = [e.time for e in log]
        assert times == sorted(times) and t0 - 1 <= times[0] and times[-1] <= time.time() + 1
        assert [e.new for e in table.reflog("job")] == [R[11]]
        assert [e.new for e in table.reflog("job/main2")] == [R[9]]
        assert table.reflog("job/mai") == []

    # -- history: the steps index (REF@STEP) and gc's compaction -------------------------------
    def test_step_index_and_history(self, table):
        R = self.R
        prev = None
        for i, step in enumerate([1, 2, 2, 3], start=1):
            table.compare_and_swap("j/m", prev, R[i], message="m", catalog_row={"step": step, "ref": "j/m"})
            prev = R[i]
        table.compare_and_swap("j/m2", None, R[5], message="m", catalog_row={"step": 2})
        assert table.step_root("j/m", 2) == R[3]  # the newest move at that step
        assert table.step_root("j/m", 1) == R[1] and table.step_root("j/m", 4) is None
        assert table.step_root("j/m2", 2) == R[5] and table.step_root("j", 2) is None
        assert [r for r, _row in table.history("j/m")] == [R[4], R[3], R[2], R[1]]
        assert table.history("nope") is None
        assert table.catalog_expire([R[3]]) == [R[3]]
        assert table.step_root("j/m", 2) == R[2]  # R[3] is no longer kept
        table.compare_and_swap("j/m", R[4], R[1], message="back")  # no row given: indexed from R[1]'s
        assert table.step_root("j/m", 1) == R[1]
        assert [r for r, _row in table.history("j/m")] == [R[1], R[4], R[2]]

    def test_step_index_is_rebuilt_for_moves_it_does_not_cover(self, table, write_rows):
        """A table written by code from before the index (or by such code since) gets the
        index rebuilt on the first REF@STEP lookup."""
        R, seq = self.R, struct.Struct(">Q")
        table.compare_and_swap("o/m", None, R[1], message="m", catalog_row={"step": 1})

        def drop_index(t):
            for k, _v in list(t.items("steps")):
                t.delete("steps", k)
            t.delete("meta", b"steps_seq")

        write_rows(drop_index)
        assert table.step_root("o/m", 1) == R[1]

        def old_move(t):  # an older writer's move: reflog, counter and catalog, no index
            n = seq.unpack(t.get("meta", b"reflog_seq"))[0] + 1
            t.put("meta", b"reflog_seq", seq.pack(n))
            t.put("refs", b"o/m", R[2])
            t.put("reflog", b"o/m\0" + seq.pack(n), encode_reflog(R[1], R[2], "old", 0.0))
            t.put("catalog", R[2], encode_record({"step": 7}))

        write_rows(old_move)
        assert table.step_root("o/m", 7) == R[2]
        table.compare_and_swap("o/m", R[2], R[3], message="m", catalog_row={"step": 8})
        assert table.step_root("o/m", 8) == R[3] and table.step_root("o/m", 1) == R[1]

    def test_compact_history_keeps_kept_moves_and_a_tail(self, table, read_rows):
        R = self.R
        prev = None
        for i in range(1, 16):
            table.compare_and_swap("c/m", prev, R[i], message=f"step {i}", catalog_row={"step": i})
            prev = R[i]
        table.compare_and_swap("c/other", None, R[2], message="x")  # another ref's tip
        table.tag_create("t", R[3])
        table.pin(R[4])
        before = table.publication_order()
        table.catalog_expire([R[i] for i in range(1, 15)])
        removed = table.compact_history(tail=3, batch=4)
        assert removed > 0 and table.compact_history(tail=3) == 0
        assert [e.new for e in table.reflog("c/m")] == [R[2], R[3], R[4], R[13], R[14], R[15]]
        assert [e.new for e in table.reflog("c/other")] == [R[2]]
        kept = {R[2], R[3], R[4], R[15]}
        after = table.publication_order()
        assert {r: s for r, s in after.items() if r in kept} == {r: s for r, s in before.items() if r in kept}
        assert table.step_root("c/m", 4) == R[4] and table.step_root("c/m", 5) is None
        assert read_rows(lambda t: {v for _k, v in t.items("steps")}) <= kept
        table.compare_and_swap("c/m", R[15], R[5], message="after", catalog_row={"step": 5})
        assert table.step_root("c/m", 5) == R[5]  # the sequence goes on, the index still covers it

    def test_publication_record_says_which_moves_were_recovers(self, table):
        """The latest move to a root decides its number and whether it was recover's
        (retention ranks recover's numbers within one ref only)."""
        from tensorstore_ck.refs.history import RECOVERED
        R = self.R
        table.compare_and_swap("p/a", None, R[1], message=RECOVERED)
        table.compare_and_swap("p/a", R[1], R[2], message="put")
        table.compare_and_swap("p/b", None, R[3], message=RECOVERED)
        table.compare_and_swap("p/b", R[3], R[1], message="reset")  # a writer's later move to R1
        table.catalog_put_if_absent(R[4], {"ref": "p/c", "step": 1})  # a row recover added, no move
        rec = table.publication_record()
        assert set(rec) == {R[1], R[2], R[3]}
        assert [rec[r][1] for r in (R[1], R[2], R[3])] == [False, False, True]
        assert rec[R[1]][0] > rec[R[3]][0] > rec[R[2]][0]
        assert table.publication_order() == {r: seq for r, (seq, _rec) in rec.items()}

    def test_list_is_a_sorted_string_prefix(self, table):
        names = ["a/x", "a/y", "b/x", "ab", "a", "a-b", "a.b", "a_b", "aB", "a/x/y"]
        for i, name in enumerate(names):
            table.compare_and_swap(name, None, self.R[i], message="c")
        assert table.list("a/") == [("a/x", self.R[0]), ("a/x/y", self.R[9]), ("a/y", self.R[1])]
        # bytewise order, in every backend
        assert [n for n, _ in table.list()] == sorted(names, key=str.encode)
        assert [n for n, _ in table.list("")] == sorted(names, key=str.encode)
        # a ref-table prefix is a plain string prefix, not a folder
        assert [n for n, _ in table.list("a")] == sorted((n for n in names if n.startswith("a")), key=str.encode)
        assert [n for n, _ in table.list("ab")] == ["ab"]
        assert table.list("c") == [] and table.list("a/x/y/z") == []

    def test_every_valid_name_is_kept_exactly(self, table):
        """Names are validated above the table (the Store, tsck's parser: at most 255 bytes of
        '/'-separated [A-Za-z0-9._-] components); whatever passes must be stored, listed and
        logged byte for byte, as a ref and as a tag: the longest, every allowed character,
        names that differ only in case."""
        R = self.R
        longest = "/".join(["x" * 63] * 4)  # 4 * 63 + 3 = 255 bytes
        charset = "AZaz09._-/-_.90zaZA"
        names = [longest, charset, "Main", "main", "MAIN", "...", "a..b", "-", "_/_"]
        assert len(longest.encode()) == 255
        for i, name in enumerate(names):
            table.compare_and_swap(name, None, R[i], message=name, catalog_row={"ref": name})
            table.tag_create("t/" + name[:253], R[i])
        assert table.list() == sorted(((n, R[i]) for i, n in enumerate(names)), key=lambda x: x[0].encode())
        for i, name in enumerate(names):
            assert table.get(name) == R[i]
            assert [(e.name, e.new, e.message) for e in table.reflog(name)] == [(name, R[i], name)]
            assert table.catalog_get(R[i]) == {"ref": name}
            assert table.tag_get("t/" + name[:253]) == R[i]
        assert [n for n, _ in table.tags()] == sorted(("t/" + n[:253] for n in names), key=str.encode)
        assert table.list(longest) == [(longest, R[0])] and table.list(longest + "x") == []

    # -- catalog ---------------------------------------------------------------------------
    def test_catalog_get_put_iter_prefix(self, table):
        R = self.R
        row = {"job": "j", "ref": "j/main", "step": 7, "time": 1.5, "metrics": {"loss": 0.25, "n": 3},
               "meta": {"k": "v"}, "bytes_total": 10, "bytes_new": 4, "blocks_total": 2, "blocks_new": 1}
        assert table.catalog_get(R[1]) is None
        table.catalog_put(R[1], row)
        assert table.catalog_get(R[1]) == row
        table.catalog_put(R[1], {"step": 8})  # catalog_put replaces
        assert table.catalog_get(R[1]) == {"step": 8}
        a, b, c = b"\xab\xcd" + bytes(30), b"\xab\xcd" + b"\x01" * 30, b"\xab\xce" + bytes(30)
        for r in (c, a, b):
            table.catalog_put(r, {"step": 1})
        assert [k for k, _ in table.catalog_iter()] == sorted([R[1], a, b, c])
        assert dict(table.catalog_iter())[a] == {"step": 1}
        assert table.catalog_prefix(b"\xab\xcd") == [a, b]
        assert table.catalog_prefix(b"\xab") == [a, b, c]
        assert table.catalog_prefix(b"\xab\xcd\x01") == [b]
        assert table.catalog_prefix(b"\xff") == []

    def test_catalog_put_if_absent(self, table):
        R = self.R
        assert table.catalog_put_if_absent(R[6], {"x": 1}) is True
        assert table.catalog_put_if_absent(R[6], {"x": 2}) is False
        assert table.catalog_get(R[6]) == {"x": 1}
        table.compare_and_swap("r", None, R[7], message="c", catalog_row={"x": 3})
        assert table.catalog_put_if_absent(R[7], {"x": 4}) is False
        assert table.catalog_get(R[7]) == {"x": 3}

    def test_catalog_expire_never_drops_a_tip_a_tag_target_or_a_pin(self, table):
        R = self.R
        for i in range(1, 6):
            table.catalog_put(R[i], {"step": i})
        table.compare_and_swap("r", None, R[1], message="c")
        table.tag_create("t", R[2])
        table.pin(R[3])
        # R[6] has no catalog row: not reported as dropped
        assert sorted(table.catalog_expire([R[1], R[2], R[3], R[4], R[6]])) == [R[4]]
        assert {r for r, _ in table.catalog_iter()} == {R[1], R[2], R[3], R[5]}
        assert table.catalog_expire([R[4]]) == []  # gone already
        table.unpin(R[3])
        assert table.catalog_expire([R[3]]) == [R[3]]
        table.compare_and_swap("r", R[1], R[5], message="m")  # R[1] is no longer a tip
        assert table.catalog_expire([R[1], R[5]]) == [R[1]]
        assert table.catalog_expire([]) == []
        assert {r for r, _ in table.catalog_iter()} == {R[2], R[5]}

    # -- tags, pins, retention -------------------------------------------------------------
    def test_tags_are_immutable_and_disjoint_from_refs(self, table):
        R = self.R
        assert table.tag_get("t") is None and table.tags() == []
        table.compare_and_swap("r", None, R[1], message="c")
        table.tag_create("t", R[1])
        assert table.tag_get("t") == R[1]
        for root in (R[2], R[1]):  # not even to the same target
            with pytest.raises(RefConflict) as ei:
                table.tag_create("t", root)
            assert (ei.value.name, ei.value.expected, ei.value.actual) == ("t", None, R[1].hex())
        with pytest.raises(RefConflict) as ei:
            table.tag_create("r", R[2])  # a ref has that name
        assert ei.value.actual == R[1].hex()
        with pytest.raises(RefConflict):
            table.compare_and_swap("t", None, R[2], message="c")  # a tag has that name
        assert table.get_or_none("t") is None and table.reflog("t") == []
        assert table.tag_get("r") is None and table.tag_get("t") == R[1]
        table.tag_create("b", R[3])
        table.tag_create("t2", R[1])  # many tags may name one root
        assert table.tags() == [("b", R[3]), ("t", R[1]), ("t2", R[1])]
        assert [n for n, _ in table.list()] == ["r"]  # tags are not refs

    def test_pins(self, table):
        R = self.R
        assert table.pins() == set()
        table.pin(R[1])
        table.pin(R[1])  # idempotent
        table.pin(R[2])
        assert table.pins() == {R[1], R[2]}
        table.unpin(R[1])
        table.unpin(R[1])  # absent is not an error
        table.unpin(R[9])
        assert table.pins() == {R[2]}
