"""`tsck retention` and `tsck gc --dry-run`'s explanation, through the
real entry point in a subprocess."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tensorstore_ck as tsck

from _util import object_listing, run_cli


LOSS = [3.0, 1.0, 2.0, 5.0, 4.0, 6.0]


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "s"
    with tsck.open_store(path) as s:
        for i, loss in enumerate(LOSS):
            s.put_snapshot({"w": torch.full((20000,), float(i))}, ref="a/main", step=i * 10,
                           metrics={"loss": loss})
        s.put_snapshot({"w": torch.ones(5)}, ref="b/main", step=0)
        s.tag("first", "a/main@0")
    return path


def test_retention_set_show_clear(store_path):
    r = run_cli("retention", store_path, "a", "--keep-last", "2", "--keep-best", "1", "--metric", "loss")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "a: keep last 2, keep best 1 by loss (min)"
    r = run_cli("retention", store_path, "b", "--keep-every-steps", "100", "--max-age-days", "0.5", "--json")
    assert json.loads(r.stdout) == {"job": "b", "retention": {"mode": "min", "keep_every_steps": 100,
                                                              "max_age_days": 0.5}}
    with tsck.open_store(store_path, create=False) as s:  # what the API sees
        assert s.retention() == {"a": tsck.Retention(keep_last=2, keep_best=1, metric="loss"),
                                 "b": tsck.Retention(keep_every_steps=100, max_age_days=0.5)}
    r = run_cli("retention", store_path, "--json")  # every job's rules
    assert set(json.loads(r.stdout)) == {"a", "b"}
    r = run_cli("retention", store_path, "b", "--clear")
    assert r.returncode == 0 and "no retention rule" in r.stdout
    r = run_cli("retention", store_path, "a")  # no option: shows it
    assert r.stdout.strip() == "a: keep last 2, keep best 1 by loss (min)"
    bads = (["a", "--keep-last", "-1"], ["a", "--keep-best", "1"], ["a", "--clear", "--keep-last", "1"],
            ["--keep-last", "1"], ["a", "--mode", "max"], ["a", "--keep-last", "x"], ["../x", "--keep-last", "1"])
    with ThreadPoolExecutor(4) as ex:  # each run imports torch: side by side
        results = list(ex.map(lambda bad: run_cli("retention", store_path, *bad), bads))
    for bad, r in zip(bads, results):
        assert r.returncode == 2 and r.stderr.startswith("tsck: error:") and "Traceback" not in r.stderr, (bad, r)
        assert len(r.stderr.strip().splitlines()) == 1
    with tsck.open_store(store_path, create=False) as s:  # refused ones changed nothing
        assert s.retention() == {"a": tsck.Retention(keep_last=2, keep_best=1, metric="loss")}


def test_a_count_past_what_the_ref_table_stores_is_one_line_naming_the_option(store_path):
    """--keep-last / --keep-best / --keep-every-steps of 2**64 or more ended in msgpack's
    OverflowError (a traceback); now argparse refuses it naming the option and its bound."""
    big = str(2**64)
    bads = (["a", "--keep-last", big], ["a", "--keep-best", big, "--metric", "loss"], ["a", "--keep-every-steps", big])
    with ThreadPoolExecutor(3) as ex:  # each run imports torch: side by side
        results = list(ex.map(lambda bad: run_cli("retention", store_path, *bad), bads))
    for bad, r in zip(bads, results):
        assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, (bad, r.stderr)
        assert r.stderr.strip().splitlines() == [f"tsck: error: argument {bad[1]}: must be an int from "
                                                 f"{0 if bad[1] != '--keep-every-steps' else 1} to {2**64 - 1} "
                                                 f"(2**64-1), got {big}"], r.stderr
    with tsck.open_store(store_path, create=False) as s:  # nothing written
        assert s.retention() == {}


def test_gc_dry_run_explains_each_snapshot_and_changes_nothing(store_path):
    assert run_cli("retention", store_path, "a", "--keep-last", "2", "--keep-best", "1", "--metric",
                   "loss").returncode == 0
    before = object_listing(store_path)
    r = run_cli("gc", store_path, "--dry-run")
    assert r.returncode == 0, r.stderr
    rows = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if parts and parts[0] == "a/main":
            rows[int(parts[1])] = line
    assert set(rows) == {0, 10, 20, 30, 40, 50}
    want = {0: ("keep", "tag first"), 10: ("keep", "best 1 by loss (min)"), 20: ("remove", "no rule keeps it"),
            30: ("remove", "no rule keeps it"), 40: ("keep", "last 2"), 50: ("keep", "tip of a/main, last 2")}
    for step, (action, why) in want.items():
        assert f" {action} " in rows[step] and why in rows[step], rows[step]
    assert "job a: keep last 2, keep best 1 by loss (min): keep 4 of 6" in r.stdout
    assert "job b: no retention rule, keeps all 1 snapshot(s)" in r.stdout
    assert "would expire 2 snapshot(s)" in r.stdout and "would delete" in r.stdout
    assert "blocks/" not in r.stdout and "commits/" not in r.stdout  # keys only with --json
    j = json.loads(run_cli("gc", store_path, "--dry-run", "--json").stdout)
    assert any(k.startswith("commits/") for k in j["would_delete"])
    assert {d["step"]: (d["keep"], d["why"]) for d in j["snapshots"] if d["job"] == "a"}[20] == \
        (False, ["no rule keeps it"])
    assert object_listing(store_path) == before  # the dry run changed nothing
    # ...and the real gc removes exactly what the dry run said.
    real = json.loads(run_cli("gc", store_path, "--json").stdout)
    assert sorted(real["expired"]) == sorted(j["expired"])
    assert real["deleted_objects"] == j["deleted_objects"]
    with tsck.open_store(store_path, create=False) as s:
        assert [i.step for i in s.log("a/main")] == [50, 40, 10, 0]
