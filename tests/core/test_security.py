"""Security properties of stored bytes and user-supplied names.

- pickle only when the caller opts in on both put and checkout: a planted
  manifest node holding {"P": <pickle that would create a file>} creates
  nothing through checkout / diff / fsck / gc / show / log without
  allow_pickle (and does with it: the payload is live, so the test is not
  vacuous);
- ref and tag names cannot escape the store's folder: hostile names are
  refused before anything is written, tags are stored as tags/<hex of name>,
  and a tag object or commit naming a hostile ref/tag is not restored by
  recover;
- nothing from a manifest is used as a path or looked up by attribute:
  dtype names come from a fixed table (torch attribute names that are not
  dtypes are refused), numpy object dtypes and object fields are refused,
  node and block addresses must be 32 bytes.
"""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.format.manifest import encode_commit, encode_node
from tensorstore_ck.core.assets import tag_key

STATS = {"bytes_total": 0, "bytes_new": 0, "blocks_total": 0, "blocks_new": 0}


class _CreatesFile:
    """Unpickling this calls open(path, "w"): it creates the file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def sandbox(tmp_path):
    """(store, folder): a local store at folder/store with one snapshot on a/b."""
    store = tsck.open_store(tmp_path / "store", inline_threshold=64)
    store.put_snapshot({"w": torch.arange(100, dtype=torch.float32), "n": 1}, ref="a/b", step=1)
    yield store, tmp_path
    store.close()


def _publish_node(store, value, ref="evil/x"):
    """Plant a manifest node and publish it as a snapshot on `ref` (what a
    writer with storage access, or a corrupted store, could hold)."""
    tree = store.assets.put_node(encode_node(value)).digest
    store.assets.sync()
    return store.commit_tree(tree, ref=ref, job=ref.split("/")[0], step=1, metrics={}, meta={}, stats=dict(STATS))


# ------------------------------------------------------------------------------ pickle
def test_put_refuses_objects_that_need_pickle(sandbox):
    store, _ = sandbox
    before = sorted(o.key for o in store.storage.list(""))
    with pytest.raises(tsck.UnsupportedType):
        store.put_snapshot({"s": {1, 2}}, ref="a/b", step=2)
    assert sorted(o.key for o in store.storage.list("")) == before


def test_pickle_needs_opt_in_on_both_sides(sandbox):
    store, _ = sandbox
    store.put_snapshot({"s": {1, 2}}, ref="p/x", step=1, allow_pickle=True)
    with pytest.raises(tsck.UnsupportedType):
        store.checkout("p/x")
    assert store.checkout("p/x", allow_pickle=True) == {"s": {1, 2}}


@pytest.mark.parametrize("where", ["top", "nested", "in_list", "dict_key_value"])
def test_planted_pickle_is_never_loaded_without_opt_in(sandbox, where):
    store, folder = sandbox
    marker = folder / f"pwned-{where}"
    payload = {"P": pickle.dumps(_CreatesFile(str(marker)))}
    value = {"top": payload,
             "nested": {"d": [["model", {"d": [["w", payload]]}]]},
             "in_list": {"l": [1, 2, payload]},
             "dict_key_value": {"o": [["k", {"t": [payload]}]]}}[where]
    info = _publish_node(store, value)
    with pytest.raises(tsck.UnsupportedType):
        store.checkout("evil/x")
    with pytest.raises((tsck.UnsupportedType, tsck.CheckoutMismatch)):  # "model" may not be there
        store.checkout(info.root, into={"model": {"w": torch.zeros(1)}})
    # the tools that walk manifests never unpickle either
    store.diff("evil/x", "a/b")
    store.fsck(full=True)
    store.gc(dry_run=True)
    store.show("evil/x")
    store.log("evil/x")
    store.du()
    assert not marker.exists(), "a pickle from a manifest was loaded without allow_pickle"
    # with the opt-in the same bytes do run: the payload above is a live one
    try:
        store.checkout("evil/x", allow_pickle=True)
    except tsck.TsckError:
        pass
    assert marker.exists()


def test_train_state_payload_not_unpickled_by_default(sandbox):
    """A pickle planted where a tensor is expected is refused, whatever the tag says."""
    store, folder = sandbox
    marker = folder / "pwned-tensor"
    blob = pickle.dumps(_CreatesFile(str(marker)))
    _publish_node(store, {"d": [["t", {"T": {"dt": "float32", "sh": [1], "n": len(blob), "x": blob}}],
                                ["p", {"P": blob}]]})
    with pytest.raises(tsck.TsckError):
        store.checkout("evil/x")
    assert not marker.exists()


# ------------------------------------------------------------------------------ names
HOSTILE = ["../x", "../../etc/passwd", "a/../../b", "/abs", "a//b", "a/", "..", ".", "a/..", "a/./b",
           "a\\..\\b", "..\\x", "%2e%2e/x", "a\x00b", "a\nb", "tags/../../x", "~/x", "a@1", "x" * 256,
           "é/../x", "a b", "C:\\x", "\udcff", ""]


def _files(folder):
    out = set()
    for dirpath, _dirs, files in os.walk(folder):
        for f in files:
            out.add(os.path.relpath(os.path.join(dirpath, f), folder))
    return out


@pytest.mark.parametrize("name", HOSTILE, ids=repr)
def test_hostile_names_are_refused_before_any_write(sandbox, name):
    store, folder = sandbox
    before = _files(folder)
    with pytest.raises(tsck.InvalidName):
        store.tag(name, "a/b")
    with pytest.raises(tsck.InvalidName):
        store.put_snapshot({"n": 2}, ref=name, step=2)
    with pytest.raises(tsck.InvalidName):
        store.put_snapshot({"n": 2}, ref="a/b", job=name, step=2)
    with pytest.raises(tsck.InvalidName):
        store.set_retention(name, tsck.Retention(keep_last=1))
    with pytest.raises((tsck.InvalidName, tsck.RefNotFound)):
        store.checkout(name)
    with pytest.raises((tsck.InvalidName, tsck.RefNotFound)):
        store.log(name)
    after = _files(folder)
    # LMDB may touch its own files; nothing else appears or changes place
    assert {f for f in after - before if not f.startswith(os.path.join("store", "refs.lmdb"))} == set()
    assert os.listdir(folder) == ["store"]


@pytest.mark.parametrize("name", ["golden", "rel/v1.0", "a-b_c.d/e", "x" * 100])
def test_tags_are_stored_as_hex_of_their_name(sandbox, name):
    store, folder = sandbox
    before = _files(folder / "store")
    store.tag(name, "a/b")
    new = {f for f in _files(folder / "store") - before if not f.startswith("refs.lmdb")}
    key = tag_key(name)
    assert new == {key}
    assert key == "tags/" + name.encode().hex() and "/" not in key[len("tags/"):]
    assert bytes.fromhex(key.split("/", 1)[1]).decode() == name
    with pytest.raises(tsck.RefConflict):  # immutable
        store.tag(name, "a/b")


def test_regression_long_tag_name_local_store(sandbox):
    """A valid 255-byte tag name becomes a 510-character file name (tags/<hex>):
    past NAME_MAX on local filesystems, so tagging fails with StorageError
    (ENAMETOOLONG). Names of 128..255 bytes pass validate_name but cannot be
    tags on a local store."""
    store, _ = sandbox
    # Tag names are limited to 120 bytes (their tags/<hex> file name stays under NAME_MAX);
    # a longer one is refused up front with InvalidName, not an ENAMETOOLONG later.
    with pytest.raises(tsck.InvalidName):
        store.tag("x" * 255, "a/b")
    store.tag("x" * 120, "a/b")
    assert store.resolve("x" * 120) == store.resolve("a/b")


def test_long_job_names(sandbox):
    """A job name is at most 255 bytes (MAX_NAME_BYTES, as a ref's component): one of 255
    is a job whose retention and snapshots are stored under it; a longer one is refused
    with InvalidName before anything is written (not an LMDB key overflow, which is no
    TsckError)."""
    store, folder = sandbox
    job = "x" * 255
    store.set_retention(job, tsck.Retention(keep_last=1))
    assert store.retention()[job] == tsck.Retention(keep_last=1)
    info = store.put_snapshot({"n": 2}, ref="a/b", job=job, step=2)
    assert info.job == job and [i.job for i in store.log("a/b")] == [job, "a"]
    before = _files(folder)
    for name in ("x" * 256, "x" * 600):
        with pytest.raises(tsck.InvalidName):
            store.set_retention(name, tsck.Retention(keep_last=1))
        with pytest.raises(tsck.InvalidName):
            store.put_snapshot({"n": 3}, ref="a/b", job=name, step=3)
    assert set(store.retention()) == {job}
    assert [i.step for i in store.log("a/b")] == [2, 1]
    assert {f for f in _files(folder) - before if not f.startswith(os.path.join("store", "refs.lmdb"))} == set()


def test_recover_does_not_restore_a_ref_named_like_a_path(sandbox):
    store, folder = sandbox
    tree = store.assets.put_node(encode_node({"d": []})).digest
    store.assets.put_commit(encode_commit(job="evil", ref="../../evil", step=1, time=1.0, metrics={}, meta={},
                                          parent=None, tree=tree, stats=dict(STATS)))
    rep = store.recover()
    assert "../../evil" not in rep.refs_restored
    assert all(".." not in n for n in store.refs())
    assert any("commits/" in u for u in rep.unreadable)
    assert os.listdir(folder) == ["store"]


def test_recover_skips_a_tag_object_named_like_a_path(sandbox):
    """A tag object whose name is a path is not restored, and does not stop
    recover: it is listed as unreadable. (Today decode_tag's InvalidName escapes
    run_recover, which catches only FormatError, so recover aborts there.)"""
    store, folder = sandbox
    root = bytes.fromhex(store.resolve("a/b"))
    store.storage.put_if_absent(tag_key("innocent"), [b'{"name": "../../x", "root": "%s", "time": 1.0}'
                                                      % root.hex().encode()])
    try:
        rep = store.recover()
    finally:
        assert "../../x" not in store.tags()
        assert os.listdir(folder) == ["store"]
    assert "../../x" not in rep.tags_restored
    assert len(rep.unreadable) == 1


# ------------------------------------------------------------------------------ manifests
TORCH_NON_DTYPES = ["Tensor", "_C", "os", "__class__", "load", "float32.__class__", "torch.float32", "cuda",
                    "ops", "", "Float", "float"]


@pytest.mark.parametrize("dt", TORCH_NON_DTYPES)
def test_torch_dtype_names_come_from_a_table(sandbox, dt):
    store, _ = sandbox
    _publish_node(store, {"T": {"dt": dt, "sh": [1], "n": 4, "x": b"\0" * 4}})
    with pytest.raises(tsck.FormatError):
        store.checkout("evil/x")


@pytest.mark.parametrize("dt", ["O", "|O", "<O", "O8", [["a", "O"]], [["a", "<f4"], ["b", [["c", "O"]]]],
                                [["a", "O", [2]]], "object", "os.system", "<f4; import os", "V" * 100,
                                [["a", "<f4"]] * 2000, ["<f4"]])
def test_numpy_object_and_bogus_dtypes_are_refused(sandbox, dt):
    store, _ = sandbox
    _publish_node(store, {"A": {"dt": dt, "sh": [1], "n": 8, "x": b"\0" * 8}})
    with pytest.raises(tsck.FormatError):
        store.checkout("evil/x")
    _publish_node(store, {"S": [dt, b"\0" * 8]}, ref="evil/y")
    with pytest.raises(tsck.FormatError):
        store.checkout("evil/y")


@pytest.mark.parametrize("value", [
    {"r": b"../../../../etc/passwd".ljust(32, b"\0")[:31]},                 # not 32 bytes
    {"r": "../../etc/passwd"},                                                # not bytes
    {"T": {"dt": "float32", "sh": [1], "n": 4, "bs": 4096, "b": ["../../etc/passwd"]}},
    {"T": {"dt": "float32", "sh": [1], "n": 4, "bs": 4096, "b": [b"/" * 33]}},
    {"W": {"ranks": ["../x"], "world": 1}},
])
def test_addresses_in_manifests_are_digests_not_paths(sandbox, value):
    store, folder = sandbox
    _publish_node(store, value)
    with pytest.raises(tsck.TsckError):
        store.checkout("evil/x")
    assert os.listdir(folder) == ["store"]


def test_device_field_is_not_trusted(sandbox):
    """'dev' only ever selects a device this process has; anything else is refused before a
    read (DeviceUnavailable) and lands on the CPU when map_location says so."""
    store, _ = sandbox
    for dev in ["../../x", "cuda:99", "meta", "cpu; rm -rf /", "mps"]:
        _publish_node(store, {"T": {"dt": "float32", "sh": [1], "n": 4, "x": b"\0" * 4, "dev": dev}},
                      ref="evil/d")
        with pytest.raises(tsck.DeviceUnavailable):
            store.checkout("evil/d")
        t = store.checkout("evil/d", map_location="cpu")
        assert isinstance(t, torch.Tensor) and t.device.type == "cpu"


def test_a_valid_numpy_dtype_still_reads(sandbox):
    """The refusals above are not blanket: a structured, big-endian dtype round-trips."""
    store, _ = sandbox
    a = np.zeros(3, dtype=np.dtype([("x", ">i4"), ("y", "<f8", (2,))]))
    store.put_snapshot({"a": a}, ref="ok/np", step=1)
    b = store.checkout("ok/np")["a"]
    assert b.dtype == a.dtype and b.tobytes() == a.tobytes()
