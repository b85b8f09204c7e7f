"""The `tsck` command line (run as `python -m tensorstore_ck`) against a store filled via the API.

All CLI invocations are launched once, in parallel, by a module fixture (each one
imports torch, so running them one by one would be slow); the tests then look at
the cached results.
"""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

import _zygote as zygote
from _util import child_env, rand_tensor, run_cli

import tensorstore_ck as tsck

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A store with two jobs, history, a tag; returns the API's answers about it."""
    base = tmp_path_factory.mktemp("cli")
    path = base / "store"
    shared = rand_tensor(torch.float32, (256, 256), seed=1)  # shared by both jobs -> dedup
    with tsck.open_store(path, block_size=64 * 1024, inline_threshold=256) as s:
        for step in (100, 200, 300):
            s.put_snapshot({"shared": shared, "moving": rand_tensor(torch.float32, (128, 128),
                                                                     seed=step),
                            "step": step}, ref="jobA/main", step=step,
                           metrics={"val_loss": 3.0 - step / 100})
        s.put_snapshot({"shared": shared, "arr": np.arange(5000.0)}, ref="jobB/exp-1",
                       step=7, metrics={"acc": 0.5})
        s.tag("golden", "jobA/main@200")
        api = {
            "refs": {name: info for name, info in s.refs().items()},
            "log_A": s.log("jobA/main"),
            "log_B": s.log("jobB/exp-1"),
            "show_A": s.show("jobA/main"),
            "show_golden": s.show("golden"),
            "du": s.du(),
        }
    not_store = base / "not_a_store"
    not_store.mkdir()
    (not_store / "x.txt").write_text("hello")
    missing = base / "does" / "not" / "exist"
    # kept short: every invocation imports torch (~2 s of CPU each)
    cmds = {
        "refs": ("refs", path),
        "refs_json": ("refs", path, "--json"),
        "log": ("log", path, "jobA/main"),
        "log_json": ("log", path, "jobA/main", "--json"),
        "show": ("show", path, "jobA/main"),
        "show_json": ("show", path, "jobA/main", "--json"),
        "show_tag_json": ("show", path, "golden", "--json"),
        "du": ("du", path),
        "du_json": ("du", path, "--json"),
        # user errors
        "err_missing_store": ("refs", missing),
        "err_not_a_store": ("log", not_store, "jobA/main"),
        "err_bad_ref_name": ("log", path, "a//b"),
        "err_unknown_target": ("show", path, "nope/main", "--json"),
    }
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
        futs = {k: ex.submit(run_cli, *v) for k, v in cmds.items()}
        results = {k: f.result() for k, f in futs.items()}
    return {"path": path, "api": api, "res": results, "missing": missing,
            "not_store": not_store}


def ok(filled, key):
    r = filled["res"][key]
    assert r.returncode == 0, f"{key}: rc={r.returncode}\nstdout={r.stdout}\nstderr={r.stderr}"
    assert "Traceback" not in r.stdout + r.stderr
    return r


def load_json(filled, key):
    r = ok(filled, key)
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError as e:  # pragma: no cover - message only
        raise AssertionError(f"{key}: stdout is not one JSON document: {e}\n{r.stdout!r}")


def walk(obj):
    """Yield every dict/list/scalar in a JSON document, depth first, in document order."""
    yield obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from walk(v)


def snapshot_dicts(doc):
    """JSON objects that describe a snapshot: they carry a 'root' hex string."""
    return [d for d in walk(doc) if isinstance(d, dict) and isinstance(d.get("root"), str)
            and len(d["root"]) == 64]


def find_key(doc, key):
    return [d[key] for d in walk(doc) if isinstance(d, dict) and key in d]


# ---------------------------------------------------------------- refs
def test_refs_plain(filled):
    out = ok(filled, "refs").stdout
    for name, info in filled["api"]["refs"].items():
        assert name in out
        assert info.root[:8] in out, f"root of {name} not shown"


def test_refs_json(filled):
    doc = load_json(filled, "refs_json")
    api = filled["api"]["refs"]
    assert set(api) == {"jobA/main", "jobB/exp-1"}
    strings = {x for x in walk(doc) if isinstance(x, str)}
    for name, info in api.items():
        assert name in strings, f"ref {name} missing from JSON"
    roots = {d["root"] for d in snapshot_dicts(doc)} | {
        x for x in strings if len(x) == 64}
    assert {i.root for i in api.values()} <= roots
    # some object maps every ref name to (an object with) that ref's root
    maps = [d for d in walk(doc) if isinstance(d, dict) and set(api) <= set(d)]
    if maps:
        for name, info in api.items():
            v = maps[0][name]
            assert v == info.root or (isinstance(v, dict) and v.get("root") == info.root), name
    else:  # or a list of entries naming the ref
        entries = [d for d in (doc if isinstance(doc, list) else []) if isinstance(d, dict)]
        by_name = {d.get("ref", d.get("name")): d.get("root") for d in entries}
        for name, info in api.items():
            assert by_name.get(name) == info.root, name
    tags = [d for d in walk(doc) if isinstance(d, dict) and "golden" in d]
    if tags:  # tags listed too: golden -> the step-200 snapshot
        v = tags[0]["golden"]
        golden = filled["api"]["show_golden"].root
        assert v == golden or (isinstance(v, dict) and v.get("root") == golden)


# ---------------------------------------------------------------- log
def test_log_plain(filled):
    out = ok(filled, "log").stdout
    log = filled["api"]["log_A"]
    assert [i.step for i in log] == [300, 200, 100]
    positions = [out.find(i.root[:8]) for i in log]
    assert all(p >= 0 for p in positions), out
    assert positions == sorted(positions), "log must be newest first"
    for i in log:
        assert str(i.step) in out


def test_log_json(filled):
    doc = load_json(filled, "log_json")
    log = filled["api"]["log_A"]
    entries = snapshot_dicts(doc)
    assert [d["root"] for d in entries] == [i.root for i in log]
    assert [d.get("step") for d in entries] == [i.step for i in log]
    for d, i in zip(entries, log):
        if "parent" in d:
            assert d["parent"] == i.parent
        if "metrics" in d:
            assert d["metrics"] == i.metrics
        if "bytes_total" in d:
            assert d["bytes_total"] == i.bytes_total


# ---------------------------------------------------------------- show
def test_show_plain(filled):
    out = ok(filled, "show").stdout
    info = filled["api"]["show_A"]
    assert info.root in out or info.root[:12] in out
    assert "300" in out


def _one_snapshot(doc):
    entries = snapshot_dicts(doc)
    assert entries, f"no snapshot object in {doc!r}"
    return entries[0]


def test_show_json(filled):
    d = _one_snapshot(load_json(filled, "show_json"))
    info = filled["api"]["show_A"]
    assert d["root"] == info.root
    assert d["step"] == info.step == 300
    assert d.get("job", info.job) == info.job == "jobA"
    if "metrics" in d:
        assert d["metrics"] == info.metrics
    for k in ("bytes_total", "blocks_total", "bytes_new", "blocks_new", "parent"):
        if k in d:
            assert d[k] == getattr(info, k), k


def test_show_tag_json(filled):
    log = filled["api"]["log_A"]
    d = _one_snapshot(load_json(filled, "show_tag_json"))
    assert d["root"] == filled["api"]["show_golden"].root == log[1].root
    assert d["step"] == 200


# ---------------------------------------------------------------- du
def test_du_plain(filled):
    out = ok(filled, "du").stdout
    assert out.strip()
    assert "jobA" in out and "jobB" in out


def test_du_json(filled):
    doc = load_json(filled, "du_json")
    du = filled["api"]["du"]
    for key in ("logical_bytes", "physical_bytes"):
        vals = find_key(doc, key)
        assert vals, f"{key} missing from du --json"
        assert vals[0] == du[key], (key, vals[0], du[key])
    assert du["logical_bytes"] > 0 and du["physical_bytes"] > 0
    ratio = find_key(doc, "dedup_ratio")
    assert ratio and abs(float(ratio[0]) - float(du["dedup_ratio"])) < 1e-9
    # the shared 256 KiB tensor is in 4 snapshots but stored once: real dedup
    assert du["logical_bytes"] > du["physical_bytes"]
    jobs = find_key(doc, "jobs")
    assert jobs and set(jobs[0]) == set(du["jobs"]) == {"jobA", "jobB"}


# ---------------------------------------------------------------- errors
ERROR_KEYS = ["err_missing_store", "err_not_a_store", "err_bad_ref_name", "err_unknown_target"]


@pytest.mark.parametrize("key", ERROR_KEYS)
def test_user_errors_one_line_exit_2(filled, key):
    r = filled["res"][key]
    assert "Traceback" not in r.stdout and "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2, f"{key}: rc={r.returncode} stderr={r.stderr!r}"
    lines = r.stderr.strip("\n").splitlines()
    assert len(lines) == 1, f"{key}: expected one stderr line, got {r.stderr!r}"
    assert lines[0].startswith("tsck: error:"), lines[0]
    assert len(lines[0]) > len("tsck: error: ")


def test_missing_store_not_created(filled):
    # reading commands must not create a store at a mistyped path
    assert not filled["missing"].exists()
    assert sorted(os.listdir(filled["not_store"])) == ["x.txt"]


# ---------------------------------------------------------------- remote stores
def _cli_env(extra: dict) -> dict:
    env = child_env(drop=("AWS_", "TSCK_"), cli=True)
    env.update(extra)
    return env


@pytest.mark.slow
def test_cli_reaches_an_s3_store_with_a_postgres_ref_table(s3_server, s3_url, pg_dsn, s3_signatures_checked):
    """--refs / -o and their environment forms; credentials from AWS_* only, never echoed."""
    with tsck.open_store(s3_url, refs=pg_dsn, storage_options=s3_server) as s:
        root = s.put_snapshot({"w": torch.arange(10)}, ref="jobS3/main", step=7).root
    aws = {"AWS_ENDPOINT_URL": s3_server["endpoint_url"], "AWS_ACCESS_KEY_ID": s3_server["key"],
           "AWS_SECRET_ACCESS_KEY": s3_server["secret"]}
    base = [sys.executable, "-m", "tensorstore_ck"]

    def run(args, env):
        return zygote.run(base + args, capture_output=True, text=True, timeout=120, env=_cli_env(env),
                          cwd=str(REPO))

    secret = "s3cr3t-" + os.urandom(6).hex()
    cases = [
        (["refs", s3_url, "--refs", pg_dsn, "--json"], aws),
        (["refs", s3_url, "--json"], {**aws, "TSCK_REFS": pg_dsn}),
        (["refs", s3_url, "--refs", pg_dsn, "-o", f"endpoint_url={s3_server['endpoint_url']}",
          "-o", f"key={s3_server['key']}", "-o", f"secret={s3_server['secret']}", "--json"], {}),
        (["refs", s3_url, "--json"], {"TSCK_REFS": pg_dsn, "TSCK_STORAGE_OPTIONS": json.dumps(s3_server)}),
        (["refs", s3_url], aws),                                              # no ref table named
        (["refs", s3_url, "--refs", pg_dsn], {"TSCK_STORAGE_OPTIONS": "[1]"}),  # not an object
        (["refs", s3_url, "--refs", pg_dsn, "-o", f"{secret}"], aws),           # no '='
    ]
    with ThreadPoolExecutor(4) as ex:
        out = list(ex.map(lambda c: run(*c), cases))
    with s3_signatures_checked() as good:  # a wrong secret for a key the server knows
        out.append(run(["fsck", s3_url, "--refs", pg_dsn],
                       {**aws, "AWS_ACCESS_KEY_ID": good["key"], "AWS_SECRET_ACCESS_KEY": secret}))
    for r in out[:4]:
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["refs"]["jobS3/main"]["root"] == root
    no_refs, bad_json, bad_o, bad_secret = out[4:]
    assert no_refs.returncode == 2 and "refs" in no_refs.stderr and "Traceback" not in no_refs.stderr
    assert bad_json.returncode == 2 and "TSCK_STORAGE_OPTIONS" in bad_json.stderr
    assert bad_o.returncode == 2 and "KEY=VALUE" in bad_o.stderr
    assert bad_secret.returncode != 0 and "Traceback" not in bad_secret.stderr
    for r in out:
        assert secret not in r.stdout + r.stderr and s3_server["secret"] not in r.stdout + r.stderr
