"""Stored values the CLI must print, and odd commits that must not break the whole store.

Values reach the catalog through `tsck recover`, which copies what each stored
commit says: a commit time outside time_t (an OverflowError in log/refs/show if
unguarded), bytes in a commit's meta (a TypeError from json.dumps in show), a NaN time
(refused by the decoder: accepted, it would make every reader of the catalog, refs, gc,
fsck and du, fail for every snapshot). And --json writes strict JSON: no NaN/Infinity,
which strict parsers (jq) reject.
"""
from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.format.manifest import encode_commit
from tensorstore_ck.format.records import encode_record

from _util import run_cli


REPO = Path(__file__).resolve().parents[2]
STATS = {"bytes_total": 0, "bytes_new": 0, "blocks_total": 0, "blocks_new": 0}


def _cli_all(*cmds):
    with ThreadPoolExecutor(4) as ex:
        return list(ex.map(lambda c: run_cli(*c), cmds))


def _strict(text: str):
    """json.loads as jq reads: NaN, Infinity and -Infinity are not JSON."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def _plant_commit(s, *, ref: str, time: float, tree: bytes, meta=None, step=1) -> str:
    body = encode_commit(job=ref.split("/")[0], ref=ref, step=step, time=time, metrics={"loss": 1.0},
                         meta=meta or {}, parent=None, tree=tree, stats=dict(STATS))
    root = s.assets.put_commit(body).digest
    s.assets.sync()
    return root.hex()


def _good(path):
    s = tsck.open_store(path)
    info = s.put_snapshot({"w": torch.arange(100.0)}, ref="good/main", step=1)
    tree = s.reftable.catalog_get(bytes.fromhex(info.root))["tree"]
    return s, info, tree


def test_odd_times_and_bytes_in_meta_print(tmp_path):
    """A time beyond time_t and bytes in meta, brought in by recover: log, refs and show
    (text and --json) print them, never an OverflowError / TypeError traceback."""
    path = tmp_path / "s"
    s, _info, tree = _good(path)
    far = _plant_commit(s, ref="far/main", time=1e18, tree=tree)            # year ~3e10
    byt = _plant_commit(s, ref="byt/main", time=1000.0, tree=tree,
                        meta={"blob": b"\x00\xff", b"raw-key": [b"\x01", 1.5]})
    rep = s.recover()
    assert {"far/main", "byt/main"} <= set(rep.refs_restored), rep
    s.close()
    runs = _cli_all(("log", path, "far/main"), ("refs", path), ("show", path, far), ("show", path, byt),
                    ("show", path, byt, "--json"), ("refs", path, "--json"), ("log", path, "far/main", "--json"))
    for r in runs:
        assert r.returncode == 0 and "Traceback" not in r.stderr, (r.args, r.stderr)
    assert "out of range" in runs[0].stdout and "out of range" in runs[2].stdout
    assert "hex:00ff" in runs[3].stdout
    shown = _strict(runs[4].stdout)
    assert shown["meta"] == {"blob": "hex:00ff", "hex:" + b"raw-key".hex(): ["hex:01", 1.5]}
    assert _strict(runs[5].stdout)["refs"]["far/main"]["time"] == 1e18
    assert _strict(runs[6].stdout)[0]["root"] == far


def test_json_output_is_strict_json(tmp_path):
    """A diverged run's NaN/inf metrics are written by --json as null (strict JSON), never
    as NaN / Infinity."""
    path = tmp_path / "s"
    with tsck.open_store(path) as s:
        s.put_snapshot({"w": torch.zeros(3)}, ref="div/main", step=5,
                       metrics={"loss": float("nan"), "grad": float("inf"), "lr": -float("inf"), "ok": 0.5})
    runs = _cli_all(("log", path, "div/main", "--json"), ("show", path, "div/main", "--json"),
                    ("refs", path, "--json"))
    for r in runs:
        assert r.returncode == 0, r.stderr
    logged = _strict(runs[0].stdout)[0]["metrics"]
    assert logged == {"loss": None, "grad": None, "lr": None, "ok": 0.5}
    assert _strict(runs[1].stdout)["metrics"] == logged
    assert _strict(runs[2].stdout)["refs"]["div/main"]["metrics"] == logged


def test_a_nan_time_commit_is_one_finding_not_a_broken_store(tmp_path):
    """A NaN-time commit in storage is refused where it is decoded, so recover does not
    bring it into the catalog, where refs, gc, fsck and du would fail for every snapshot."""
    path = tmp_path / "s"
    s, info, tree = _good(path)
    odd = _plant_commit(s, ref="odd/main", time=float("nan"), tree=tree)
    rep = s.recover()
    assert any(odd in u for u in rep.unreadable), rep.unreadable
    assert not s.reftable.catalog_has(bytes.fromhex(odd))
    assert set(s.refs()) == {"good/main"}
    assert s.du()["snapshots"] == 1
    s.set_retention("good", tsck.Retention(keep_last=1))
    s.gc()
    assert s.fsck().ok  # the odd commit is an orphan: no kept snapshot names it
    s.close()
    runs = _cli_all(("refs", path), ("du", path), ("fsck", path), ("gc", path))
    assert [r.returncode for r in runs] == [0, 0, 0, 0], [r.stderr for r in runs]


def _plant_row(s, root_hex: str, row: dict, ref: str | None = None):
    """A catalog row as an older recover stored it (the ref table taking it as given)."""
    root = bytes.fromhex(root_hex)
    s.reftable._write(lambda t: t.put("catalog", root, encode_record(row)))
    if ref is not None:
        s.reftable.compare_and_swap(ref, None, root, message="recovered from storage")


def test_a_malformed_catalog_row_is_one_finding(tmp_path):
    """A table that already holds a NaN-time row (written by hand or another tool): one malformed catalog row
    (NaN time) is a finding of fsck, kept by gc, left out of du with its root named; refs
    lists it from its commit object, and a snapshot whose commit is bad too is one
    'unreadable' line of `tsck refs` (exit 1) while the others are listed."""
    path = tmp_path / "s"
    s, info, tree = _good(path)
    ok_commit = _plant_commit(s, ref="rowbad/main", time=1000.0, tree=tree)
    bad_commit = _plant_commit(s, ref="allbad/main", time=float("nan"), tree=tree)  # refused by the decoder too
    row = {"job": "x", "ref": "x", "step": 1, "time": float("nan"), "metrics": {}, "meta": {}, "tree": tree}
    _plant_row(s, ok_commit, row, ref="rowbad/main")
    _plant_row(s, bad_commit, row, ref="allbad/main")

    assert s.refs(errors={}).keys() == {"good/main", "rowbad/main"}
    errors: dict = {}
    s.refs(errors=errors)
    assert set(errors) == {"allbad/main"}
    with pytest.raises(tsck.FormatError, match="allbad/main"):
        s.refs()
    assert s.refs(prefix="rowbad")["rowbad/main"].time == 1000.0  # from its commit
    du = s.du()
    assert du["snapshots"] == 1 and set(du["malformed_rows"]) == {ok_commit, bad_commit}
    s.set_retention("good", tsck.Retention(keep_last=1))
    s.set_retention("x", tsck.Retention(keep_last=0))
    g = s.gc()
    assert set(g.malformed_rows) == {ok_commit, bad_commit} and not g.expired
    assert s.reftable.catalog_has(bytes.fromhex(ok_commit))
    f = s.fsck()
    probs = {(x.problem, x.snapshot) for x in f.findings}
    assert ("malformed_row", ok_commit) in probs and ("malformed_row", bad_commit) in probs
    assert all(x.snapshot in (ok_commit, bad_commit) for x in f.findings), f.findings
    assert ("undecodable", bad_commit) in probs  # its commit: one finding of its own
    assert s.checkout("good/main")["w"].equal(torch.arange(100.0))
    assert s.checkout("rowbad/main")["w"].equal(torch.arange(100.0))  # gc kept its tree
    s.close()
    refs, du_, fsck, gc = _cli_all(("refs", path), ("du", path), ("fsck", path), ("gc", path))
    assert refs.returncode == 1 and "Traceback" not in refs.stderr
    lines = refs.stdout.splitlines()
    assert any(ln.startswith("good/main") for ln in lines) and any(ln.startswith("rowbad/main") for ln in lines)
    assert [ln for ln in lines if "unreadable" in ln and ln.startswith("allbad/main")]
    assert du_.returncode == 0 and gc.returncode == 0, (du_.stderr, gc.stderr)
    assert fsck.returncode == 1 and "malformed_row" in fsck.stdout


def test_commit_decoder_refuses_non_finite_times_and_deep_meta():
    from tensorstore_ck.format.manifest import decode_commit

    def body(**kw):
        args = dict(job="a", ref="a/b", step=1, time=1.0, metrics={}, meta={}, parent=None, tree=b"\1" * 32,
                    stats=dict(STATS))
        args.update(kw)
        return encode_commit(**args)

    for t in (math.nan, math.inf, -math.inf):
        with pytest.raises(tsck.FormatError, match="time"):
            decode_commit(body(time=t))
    deep = {}
    for _ in range(40):
        deep = {"k": deep}
    with pytest.raises(tsck.FormatError, match="nested"):
        decode_commit(body(meta=deep))
    ok = {}
    for _ in range(32):  # what the writer accepts (validate.check_plain) decodes
        ok = {"k": ok}
    decode_commit(body(meta=ok))
    tsck.open_store("memory://deep-meta").put_snapshot({}, ref="a/b", meta=ok)
