"""TierTableTests: the contract of a local tier's own table (TierTable,
tensorstore_ck/refs/tiertable.py), reached as `RefTable.tier_rows`, for any ref table.
Subclass it with the same `open_table` fixture RefTableTests asks for:

    class TestMyTierTable(TierTableTests):
        persistent = True

        @pytest.fixture
        def open_table(self, tmp_path):
            ...                                # as for RefTableTests

The tier's rows share the ref table's transactions with the catalog rows they mark, so
what this suite checks is that pairing: a queue entry, a durable or evicted mark, a
collective part and an intent each change in one transaction with what they depend on,
and the ref table's own expiries (catalog_expire) take a row's marks with it and spare a
snapshot whose upload has started."""

from __future__ import annotations

import pytest

from ._common import TableSuite, fast_switching, run_threads

__all__ = ["TierTableTests"]


class TierTableTests(TableSuite):
    """The TierTable contract (see the module's docstring); the fixture and the class flags
    a subclass gives: TableSuite's (_common.py), as for RefTableTests."""

    @pytest.fixture
    def rows(self, table):
        return table.tier_rows

    def _publish(self, table, ref: str, root: bytes, step: int, prev: bytes | None = None) -> None:
        table.compare_and_swap(ref, prev, root, message=f"step {step}",
                               catalog_row={"job": ref.split("/")[0], "ref": ref, "step": step})

    # -- the upload queue ------------------------------------------------------------------
    def test_a_table_no_tier_used_answers_empty(self, rows):
        assert rows.upload_pending() == [] and rows.upload_last_seq() == 0
        assert rows.uploading() == set() and rows.evicted() == set() and rows.parts() == {}
        assert rows.intents() == {} and rows.intents_queue() == []
        assert rows.durable([self.R[1]]) == set() and rows.verified_get("s3://b/p") is None

    def test_the_queue_keeps_order_and_a_queued_root_keeps_its_place(self, rows):
        R = self.R
        s1 = rows.upload_enqueue(R[1], "j/main", 1)
        s2 = rows.upload_enqueue(R[2], "j/main", 2, part=R[9])
        s3 = rows.upload_enqueue(R[3], "j/main", 0, hold=True)
        assert s1 < s2 < s3 and rows.upload_last_seq() == s3
        assert rows.upload_enqueue(R[1], "j/other", 7) == s1  # queued already: same place, same entry
        pending = rows.upload_pending()
        assert [s for s, _ in pending] == [s1, s2, s3]
        assert pending[0][1] == {"root": R[1], "ref": "j/main", "step": 1}
        assert pending[1][1]["part"] == R[9] and pending[2][1]["hold"] is True

    def test_an_entry_begun_then_done_is_durable_and_gone(self, rows):
        R = self.R
        seq = rows.upload_enqueue(R[1], "j/main", 1)
        assert rows.uploading() == set()
        assert rows.upload_begin(seq) is True and rows.upload_begin(seq) is True  # begun twice: one mark
        assert rows.uploading() == {R[1]}
        rows.upload_done(seq, R[1])
        assert rows.upload_pending() == [] and rows.uploading() == set()
        assert rows.durable([R[1], R[2]]) == {R[1]}
        assert rows.upload_begin(seq) is False  # the entry is gone
        # The sequence never goes back: a new entry follows the last one handed out.
        assert rows.upload_enqueue(R[2], "j/main", 2) == seq + 1

    def test_a_durable_mark_keeps_when_its_upload_landed(self, table, rows):
        """upload_done(at=) is what durable_times() gives back (tsck goodput's time to
        durable); a mark without a time (durable_mark, upload_done without at) gives None,
        and a root not durable is not listed."""
        R = self.R
        rows.upload_done(rows.upload_enqueue(R[1], "j/main", 1), R[1], 1_700_000_123.25)
        rows.upload_done(rows.upload_enqueue(R[2], "j/main", 2), R[2])
        self._publish(table, "j/main", R[3], 3)
        rows.durable_mark([R[3]])
        assert rows.durable_times([R[1], R[2], R[3], R[4]]) == {R[1]: 1_700_000_123.25, R[2]: None, R[3]: None}

    def test_a_dropped_entry_marks_nothing_durable(self, rows):
        seq = rows.upload_enqueue(self.R[1], "j/main", 1)
        rows.upload_drop(seq)
        assert rows.upload_pending() == [] and rows.durable([self.R[1]]) == set()

    # -- durable and evicted marks ---------------------------------------------------------
    def test_marks_need_a_row_and_no_queued_upload(self, table, rows):
        R = self.R
        self._publish(table, "j/main", R[1], 1)
        self._publish(table, "j/main", R[2], 2, prev=R[1])
        rows.upload_enqueue(R[2], "j/main", 2)
        # durable_mark: only a root with a catalog row and not queued (R[3] has no row)
        assert rows.durable_mark([R[1], R[2], R[3]]) == [R[1]]
        assert rows.durable([R[1], R[2], R[3]]) == {R[1]}
        # evict_mark: only a root marked durable and not queued
        assert rows.evict_mark([R[1], R[2], R[3]]) == [R[1]]
        assert rows.evicted() == {R[1]}

    def test_publishing_an_evicted_root_again_unevicts_it_but_a_hold_does_not(self, table, rows):
        R = self.R
        self._publish(table, "j/main", R[1], 1)
        rows.durable_mark([R[1]])
        rows.evict_mark([R[1]])
        rows.upload_enqueue(R[1], "j/tag", 1, hold=True)  # sent for a tag: its objects stay remote
        assert rows.evicted() == {R[1]}
        rows.upload_drop(rows.upload_pending()[0][0])
        rows.upload_enqueue(R[1], "j/main", 1)  # published here again: its objects are local again
        assert rows.evicted() == set()

    # -- the ref table's expiry and the tier's rows ----------------------------------------
    def test_an_expired_row_takes_its_marks_and_a_started_upload_is_spared(self, table, rows):
        R = self.R
        self._publish(table, "j/main", R[1], 1)
        self._publish(table, "j/main", R[2], 2, prev=R[1])
        self._publish(table, "j/main", R[3], 3, prev=R[2])
        rows.durable_mark([R[1]])
        rows.evict_mark([R[1]])
        seq = rows.upload_enqueue(R[2], "j/main", 2)
        assert rows.upload_begin(seq)
        # R[1] goes with its evicted mark; R[2]'s upload has started, so it stays, said
        # "spared" in its entry; R[3] is the ref's tip.
        assert table.catalog_expire([R[1], R[2], R[3]]) == [R[1]]
        assert rows.evicted() == set()
        assert table.catalog_get(R[2]) is not None and table.catalog_get(R[1]) is None
        [(_, entry)] = rows.upload_pending()
        assert entry["spared"] is True and entry["started"] is True
        rows.upload_done(seq, R[2])  # done: the next expiry takes it
        assert table.catalog_expire([R[2]]) == [R[2]]

    # -- a rank's parts of collective snapshots and the intents before them ----------------
    def test_a_part_row_clears_its_intent_and_keeps_a_row_already_there(self, table, rows):
        R = self.R
        rows.intent_put(R[9], {"ref": "j/main", "step": 4, "job": "j"})
        assert rows.intents() == {R[9]: {"ref": "j/main", "step": 4, "job": "j"}}
        rows.catalog_put_part(R[4], {"job": "j", "ref": "j/main", "step": 4}, R[9])
        assert rows.intents() == {} and rows.parts() == {R[4]: R[9]}
        rows.catalog_put_part(R[4], {"job": "j", "ref": "j/main", "step": 99}, R[10])
        assert table.catalog_get(R[4])["step"] == 4  # the row stays as it was; the part is the newest
        assert rows.parts() == {R[4]: R[10]}
        rows.intent_put(R[11], {"ref": "j/main", "step": 5, "job": "j"})
        rows.intent_drop(R[11])
        assert rows.intents() == {}

    def test_intents_become_orphan_queue_entries_at_once(self, rows):
        R = self.R
        rows.upload_enqueue(R[1], "j/main", 1)
        rows.intent_put(R[9], {"ref": "j/main", "step": 4, "job": "j"})
        rows.intent_put(R[10], {"ref": "j/main", "step": 5, "job": "j"})
        assert sorted(rows.intents_queue()) == [R[9], R[10]]
        assert rows.intents() == {} and rows.intents_queue() == []
        entries = [e for _, e in rows.upload_pending()]
        assert entries[0]["root"] == R[1]
        assert {(e["root"], e["part"], e["orphan"], e["step"]) for e in entries[1:]} == {
            (R[9], R[9], True, 4), (R[10], R[10], True, 5)}

    def test_rank_zeros_part_is_marked_with_its_move(self, table, rows):
        R = self.R
        table.compare_and_swap("j/main", None, R[1], message="s1", catalog_row={"job": "j", "ref": "j/main"},
                               part0=R[8])
        rows.catalog_put_part(R[2], {"job": "j", "ref": "j/main", "step": 2}, R[9])
        assert rows.parts() == {R[1]: R[8], R[2]: R[9]}
        assert rows.parts(rank0=False) == {R[2]: R[9]}

    def test_parts_expire_spares_what_is_queued_or_kept(self, table, rows):
        R = self.R
        self._publish(table, "j/main", R[1], 1)  # the tip
        for r in (R[1], R[2], R[3], R[4]):
            rows.catalog_put_part(r, {"job": "j", "ref": "j/main"}, R[9])
        rows.upload_enqueue(R[3], "j/main", 3, part=R[9])
        table.pin(R[4])
        self._publish(table, "j/other", R[5], 1)  # a row that is not a part
        rows.durable_mark([R[2]])
        assert rows.parts_expire([R[1], R[2], R[3], R[4], R[5]]) == [R[2]]
        assert table.catalog_get(R[2]) is None and rows.durable([R[2]]) == set()
        assert set(rows.parts()) == {R[1], R[3], R[4]}

    # -- remote locations a tiered open verified -------------------------------------------
    def test_verified_locations(self, rows):
        rows.verified_put("s3://b/p", "store-1")
        rows.verified_put("s3://b/q", "store-2")
        rows.verified_put("s3://b/p", "store-3")
        assert rows.verified_get("s3://b/p") == "store-3" and rows.verified_get("s3://b/q") == "store-2"

    # -- concurrency and persistence -------------------------------------------------------
    def test_racing_enqueues_of_one_root_get_one_entry(self, table, open_table):
        handles = [open_table() for _ in range(4)] if self.independent_handles else [table] * 4
        with fast_switching():
            for round_ in range(5):
                root = bytes([round_ + 1]) * 32
                seqs = run_threads(4, lambda i: handles[i].tier_rows.upload_enqueue(root, "j/main", round_))
                assert all(isinstance(s, int) for s in seqs), seqs
                assert len(set(seqs)) == 1
        assert len(table.tier_rows.upload_pending()) == 5

    def test_the_rows_outlive_the_handle(self, table, open_table):
        if not self.persistent:
            pytest.skip("an in-memory table does not outlive its handle")
        R = self.R
        rows = table.tier_rows
        self._publish(table, "j/main", R[1], 1)
        seq = rows.upload_enqueue(R[2], "j/main", 2)
        rows.upload_begin(seq)
        rows.durable_mark([R[1]])
        rows.catalog_put_part(R[3], {"job": "j"}, R[9])
        rows.intent_put(R[10], {"ref": "j/main", "step": 5, "job": "j"})
        rows.verified_put("s3://b/p", "store-1")
        table.close()
        again = open_table().tier_rows
        assert again.upload_pending()[0][0] == seq and again.uploading() == {R[2]}
        assert again.durable([R[1]]) == {R[1]} and again.parts() == {R[3]: R[9]}
        assert set(again.intents()) == {R[10]} and again.verified_get("s3://b/p") == "store-1"
        assert again.upload_last_seq() == seq
