"""A local tier whose ref table was lost (docs/design/tiers.md, "Crashes"): while the
tier holds snapshots, `open_store(remote, local=PATH)` refuses it (NotAStore naming
`tsck recover PATH`), creating and deleting nothing, as a plain store without its table
is refused. Made afresh, the table would lack the snapshot not yet uploaded: a restore
would go back to the remote's older tip, nothing would upload it, and a gc of the tier
would delete it. `tsck recover PATH` rebuilds the table from the tier's objects.

Against a real S3 server (moto, or radosgw via TEST_S3_ENDPOINT) with an LMDB remote ref
table; the writer is a real process killed -9; the CLI is the real entry point."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from _util import REPO, assert_same, child_env, object_listing

import tensorstore_ck as tsck
from tensorstore_ck.errors import NotAStore

BS = 16 * 1024
DEADLINE = 120.0  # generous: the machine is shared


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 256, generator=g), "b": torch.randn(300, generator=g), "step": torch.tensor(step)}


def _model(step: int) -> dict:
    """The model of the writer's TrainState at `step`."""
    torch.manual_seed(step)
    return torch.nn.Linear(256, 64).state_dict()


def _open(s3_url, s3_server, tmp_path, **kw) -> tsck.Store:
    return tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server,
                           block_size=BS, inline_threshold=256, **kw)


def _tsck(*args) -> subprocess.CompletedProcess:
    """The real `tsck` entry point, with no $TSCK_* of the developer's."""
    return subprocess.run([sys.executable, "-m", "tensorstore_ck", *map(str, args)], capture_output=True, text=True,
                          timeout=DEADLINE, env=child_env(cli=True, drop=("TSCK_",)), cwd=str(REPO))


def _lose_table(local: str) -> dict:
    """Remove the tier's ref table -> what the tier stores (to compare with later)."""
    shutil.rmtree(os.path.join(local, "refs.lmdb"))
    return object_listing(local)


def _assert_refused(open_it, local: str, objects: dict) -> None:
    with pytest.raises(NotAStore) as e:
        open_it()
    msg = str(e.value)
    assert f"`tsck recover {os.path.abspath(local)}`" in msg, msg
    assert "\n" not in msg
    assert not os.path.exists(os.path.join(local, "refs.lmdb")), "the refused open made a table"
    assert object_listing(local) == objects, "the refused open changed the tier's objects"


@pytest.mark.slow  # a real S3 server
def test_a_tier_that_lost_its_table_is_refused_naming_recover_and_keeps_every_object(s3_url, s3_server, tmp_path):
    """A tier holding a durable and a local-only snapshot loses refs.lmdb: the tiered open is
    refused, naming `tsck recover PATH` (the tier's path), also with the remote unreachable
    (the check is local, made first); opening PATH as a store of its own (`tsck log`, `tsck
    gc`) is refused likewise; nothing is created or deleted. A tier emptied of its table's
    files (the directory left) is refused too."""
    local = str(tmp_path / "nvme")
    with _open(s3_url, s3_server, tmp_path, local=local) as store:
        store.put_snapshot(_state(1), "job/main", job="job", step=1)
        assert store.wait_durable(timeout=DEADLINE)
        store._uploader.close()  # step 2 stays local-only
        store.put_snapshot(_state(2), "job/main", job="job", step=2)
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
        store.put_snapshot(_state(1), "job/main", job="job", step=1)
        assert store.wait_durable(timeout=DEADLINE)
    shutil.rmtree(os.path.join(local, "commits"))
    _lose_table(local)
    with _open(s3_url, s3_server, tmp_path, local=local) as store:
        assert [i.step for i in store.log("job/main")] == [1]  # the remote's
        assert_same(store.checkout("job/main"), _state(1))
