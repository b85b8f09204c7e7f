"""A local tier whose ref table was lost (docs/design/tiers.md, "Crashes"): while the
tier holds snapshots, `open_store(remote, local=PATH)` refuses it (NotAStore naming
`tsck recover PATH`), creating and deleting nothing, as a plain store without its table
is refused. A table file of 0 bytes (a filesystem crash) is such a lost table, and so is
a table file that knows none of the tier's snapshots (a new LMDB file in its place).
Made afresh, the table would lack the snapshot not yet uploaded: a restore would go back
to the remote's older tip, nothing would upload it, and a gc of the tier would delete it. `tsck recover PATH` rebuilds the table from the tier's objects; the next
open uploads the recovered tip and marks what the remote catalog lists durable, without
sending it again.

Against a real S3 server (moto, or radosgw via TEST_S3_ENDPOINT) with an LMDB remote ref
table; the writer is a real process killed -9; the CLI is the real entry point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
import _zygote as zygote
from _util import REPO, assert_same, child_env, kill_and_close, line_from, object_listing, tier_state

import tensorstore_ck as tsck
from tensorstore_ck.errors import NotAStore

BS = 16 * 1024
DEADLINE = 120.0  # generous: the machine is shared


def _model(step: int) -> dict:
    """The model of the writer's TrainState at `step`."""
    torch.manual_seed(step)
    return torch.nn.Linear(256, 64).state_dict()


def _open(s3_url, s3_server, tmp_path, **kw) -> tsck.Store:
    return tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server,
                           block_size=BS, inline_threshold=256, **kw)


def _tsck(*args) -> subprocess.CompletedProcess:
    """The real `tsck` entry point, with no $TSCK_* of the developer's."""
    return zygote.run([sys.executable, "-m", "tensorstore_ck", *map(str, args)], capture_output=True, text=True,
                      timeout=DEADLINE, env=child_env(cli=True, drop=("TSCK_",)), cwd=str(REPO))


def _lose_table(local: str) -> dict:
    """Remove the tier's ref table -> what the tier stores (to compare with later)."""
    shutil.rmtree(os.path.join(local, "refs.lmdb"))
    return object_listing(local)


def _assert_refused(open_it, local: str, objects: dict, table: bytes | None = None) -> None:
    """table: the bytes of the table file left in place (None: no table there)."""
    with pytest.raises(NotAStore) as e:
        open_it()
    msg = str(e.value)
    assert f"`tsck recover {os.path.abspath(local)}`" in msg, msg
    assert "\n" not in msg
    if table is None:
        assert not os.path.exists(os.path.join(local, "refs.lmdb")), "the refused open made a table"
    else:
        assert _table_bytes(local) == table, "the refused open wrote the table file"
    assert object_listing(local) == objects, "the refused open changed the tier's objects"


def _table_bytes(local: str) -> bytes:
    with open(os.path.join(local, "refs.lmdb", "data.mdb"), "rb") as f:
        return f.read()


@pytest.mark.slow  # a real S3 server
def test_a_tier_that_lost_its_table_is_refused_naming_recover_and_keeps_every_object(s3_url, s3_server, tmp_path):
    """A tier holding a durable and a local-only snapshot loses refs.lmdb: the tiered open is
    refused, naming `tsck recover PATH` (the tier's path), also with the remote unreachable
    (the check is local, made first); opening PATH as a store of its own (`tsck log`, `tsck
    gc`) is refused likewise; nothing is created or deleted. A tier emptied of its table's
    files (the directory left) is refused too."""
    local = str(tmp_path / "nvme")
    with _open(s3_url, s3_server, tmp_path, local=local) as store:
        store.put_snapshot(tier_state(1, step=True), "job/main", job="job", step=1)
        assert store.wait_durable(timeout=DEADLINE)
        store._tier.uploader.close()  # step 2 stays local-only
        store.put_snapshot(tier_state(2, step=True), "job/main", job="job", step=2)
    objects = _lose_table(local)
    assert any(k.startswith("commits/") for k in objects)

    _assert_refused(lambda: _open(s3_url, s3_server, tmp_path, local=local), local, objects)
    away = {**s3_server, "endpoint_url": "http://127.0.0.1:9"}  # nothing listens there
    _assert_refused(lambda: _open(s3_url, away, tmp_path, local=local), local, objects)
    for args in (("log", local, "job/main"), ("gc", local)):
        r = _tsck(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert f"`tsck recover {local}`" in r.stderr, (args, r.stderr)
    assert not os.path.exists(os.path.join(local, "refs.lmdb"))
    assert object_listing(local) == objects

    os.makedirs(os.path.join(local, "refs.lmdb"))  # the directory without its files
    with pytest.raises(NotAStore, match="tsck recover"):
        _open(s3_url, s3_server, tmp_path, local=local)
    assert os.listdir(os.path.join(local, "refs.lmdb")) == []
    assert object_listing(local) == objects


@pytest.mark.slow  # a real S3 server
def test_a_tier_without_a_snapshot_is_made_afresh_when_its_table_is_lost(s3_url, s3_server, tmp_path):
    """Blocks and nodes without a commit (a writer killed before its put published) are no
    snapshot to lose: the tier opens, its table made afresh, as today."""
    local = str(tmp_path / "nvme")
    with _open(s3_url, s3_server, tmp_path, local=local) as store:
        store.put_snapshot(tier_state(1, step=True), "job/main", job="job", step=1)
        assert store.wait_durable(timeout=DEADLINE)
    shutil.rmtree(os.path.join(local, "commits"))
    _lose_table(local)
    with _open(s3_url, s3_server, tmp_path, local=local) as store:
        assert [i.step for i in store.log("job/main")] == [1]  # the remote's
        assert_same(store.checkout("job/main"), tier_state(1, step=True))


_WRITER = r"""
import sys, threading, time, json
import torch
import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import WrappedStore
s3_url, refs, local, opts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
hold = threading.Event()

class Hold(WrappedStore):  # once `hold` is set, no remote write happens: step 2 stays local-only
    def put_addressed(self, key, bufs):
        if hold.is_set():
            time.sleep(3600)
        return self.inner.put_addressed(key, bufs)

def state(step):
    torch.manual_seed(step)
    return tsck.TrainState(model=torch.nn.Linear(256, 64), step=step).state_dict()

store = tsck.open_store(s3_url, refs=refs, storage_options=opts, block_size=16384, inline_threshold=256,
                        local=local, wrap_storage=Hold, early_upload=False)
for step in (1, 2):
    info = store.put_snapshot(state(step), "job/main", job="job", step=step)
    if step == 1:
        assert store.wait_durable(timeout=120)
        hold.set()
print("LOCAL-ONLY", info.root, store.show("job/main").durable, flush=True)
time.sleep(3600)
"""


def _killed_writer(s3_url, s3_server, tmp_path, local: str) -> str:
    """A writer process: step 1 durable, step 2 published in the tier only, then killed -9
    -> step 2's root."""
    proc = zygote.Popen([sys.executable, "-c", _WRITER, s3_url, str(tmp_path / "refs.lmdb"), local,
                             json.dumps(s3_server)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        env=child_env())
    try:
        _, root, durable = line_from(proc, "LOCAL-ONLY", DEADLINE).split()
        assert durable == "False"
        return root
    finally:
        kill_and_close(proc)


@pytest.mark.slow  # a real S3 server, a subprocess
def test_recover_brings_back_the_local_only_snapshot_of_a_tier_that_lost_its_table(s3_url, s3_server, tmp_path):
    """Step 1 durable, step 2 published in the tier only by a writer killed -9, refs.lmdb
    removed: the open is refused; `tsck recover PATH` rebuilds the table, bound to the same
    store; the next open restores step 2 bit for bit, uploads it (the remote opened without
    the tier then has it) and marks step 1, which the remote catalog lists, durable without
    queueing or sending it again."""
    local = str(tmp_path / "nvme")
    root2 = _killed_writer(s3_url, s3_server, tmp_path, local)
    with _open(s3_url, s3_server, tmp_path) as remote:
        root1 = remote.resolve("job/main")
        assert remote.show("job/main").step == 1
    objects = _lose_table(local)

    _assert_refused(lambda: _open(s3_url, s3_server, tmp_path, local=local), local, objects)

    r = _tsck("recover", local)
    assert r.returncode == 0, r.stderr
    r = _tsck("log", local, "job/main")  # the tier as a store of its own, before its next open
    assert r.returncode == 0 and root2[:12] in r.stdout, (r.stdout, r.stderr)

    with _open(s3_url, s3_server, tmp_path, local=local) as store:
        assert store.resolve("job/main") == root2
        assert [e["root"].hex() for _, e in store.reftable.tier_rows.upload_pending()] == [root2]  # step 1 is not sent
        assert store.reftable.tier_rows.durable([bytes.fromhex(root1)]) == {bytes.fromhex(root1)}
        got = store.checkout("job/main")
        assert got["step"] == 2
        assert_same(got["model"], _model(2))
        model = torch.nn.Linear(256, 64)
        with torch.no_grad():
            model.weight.zero_()
            model.bias.zero_()
        mgr = tsck.CheckpointManager(store, job="job", ref="job/main", state=tsck.TrainState(model=model))
        try:
            assert mgr.restore_latest() == 2
        finally:
            mgr.close()
        assert_same(model.state_dict(), _model(2))
        assert store.wait_durable(timeout=DEADLINE)
        assert [(i.step, i.durable) for i in store.log("job/main")] == [(2, True), (1, True)]
    with _open(s3_url, s3_server, tmp_path) as remote:
        assert remote.resolve("job/main") == root2
        assert_same(remote.checkout("job/main")["model"], _model(2))
        assert remote.fsck().ok
    r = _tsck("log", local, "job/main")
    assert r.returncode == 0 and "local-only" not in r.stdout, r.stdout


@pytest.mark.slow  # a real S3 server
def test_an_empty_or_new_table_file_is_refused_naming_recover_and_recover_brings_the_tier_back(s3_url, s3_server,
                                                                                               tmp_path):
    """Step 1 durable, step 2 local-only; then the tier's data.mdb is left with 0 bytes (a
    node's filesystem crash): the tiered open is refused naming `tsck recover PATH`, also
    with the remote away, and so are `tsck log` and `tsck gc` of PATH, the file still 0
    bytes and every object kept. A new LMDB table file in its place (it records no store
    and knows none of the tier's snapshots) is refused the same way. `tsck recover PATH`
    then rebuilds the table: the tier restores step 2 and uploads it."""
    local = str(tmp_path / "nvme")
    with _open(s3_url, s3_server, tmp_path, local=local) as store:
        store.put_snapshot(tier_state(1, step=True), "job/main", job="job", step=1)
        assert store.wait_durable(timeout=DEADLINE)
        store._tier.uploader.close()  # step 2 stays local-only
        root2 = store.put_snapshot(tier_state(2, step=True), "job/main", job="job", step=2).root
    data = os.path.join(local, "refs.lmdb", "data.mdb")
    with open(data, "r+b") as f:
        f.truncate(0)
    objects = object_listing(local)
    assert any(k.startswith("commits/") for k in objects)

    _assert_refused(lambda: _open(s3_url, s3_server, tmp_path, local=local), local, objects, table=b"")
    away = {**s3_server, "endpoint_url": "http://127.0.0.1:9"}  # nothing listens there
    _assert_refused(lambda: _open(s3_url, away, tmp_path, local=local), local, objects, table=b"")
    for args in (("log", local, "job/main"), ("gc", local)):
        r = _tsck(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert f"`tsck recover {local}`" in r.stderr, (args, r.stderr)
    assert _table_bytes(local) == b"" and object_listing(local) == objects

    from tensorstore_ck.refs import LmdbRefTable
    LmdbRefTable(str(tmp_path / "other.lmdb")).close()  # a new, empty table file
    shutil.copyfile(tmp_path / "other.lmdb" / "data.mdb", data)
    fresh = _table_bytes(local)
    _assert_refused(lambda: _open(s3_url, s3_server, tmp_path, local=local), local, objects, table=fresh)

    r = _tsck("recover", local)
    assert r.returncode == 0, r.stderr
    with _open(s3_url, s3_server, tmp_path, local=local) as store:
        assert store.resolve("job/main") == root2
        assert_same(store.checkout("job/main"), tier_state(2, step=True))
        assert store.wait_durable(timeout=DEADLINE)
    with _open(s3_url, s3_server, tmp_path) as remote:
        assert remote.resolve("job/main") == root2
        assert_same(remote.checkout("job/main"), tier_state(2, step=True))


@pytest.mark.slow  # a real S3 server
def test_an_empty_table_file_beside_a_tier_without_snapshots_is_made_afresh_with_it(s3_url, s3_server, tmp_path):
    """A 0-byte table file in a tier that holds no commit loses nothing: the tier opens, its
    table made as a new tier's (not one marked as lost), so the next open after a put
    opens it too."""
    local = str(tmp_path / "nvme")
    with _open(s3_url, s3_server, tmp_path, local=local) as store:
        store.put_snapshot(tier_state(1, step=True), "job/main", job="job", step=1)
        assert store.wait_durable(timeout=DEADLINE)
    shutil.rmtree(os.path.join(local, "commits"))
    with open(os.path.join(local, "refs.lmdb", "data.mdb"), "r+b") as f:
        f.truncate(0)
    with _open(s3_url, s3_server, tmp_path, local=local) as store:
        assert_same(store.checkout("job/main"), tier_state(1, step=True))  # the remote's
        store.put_snapshot(tier_state(2, step=True), "job/main", job="job", step=2)
        assert store.wait_durable(timeout=DEADLINE)
    with _open(s3_url, s3_server, tmp_path, local=local) as store:
        assert store.show("job/main").step == 2
        assert_same(store.checkout("job/main"), tier_state(2, step=True))
