"""CommitEvent.store_size: the store's physical size (`tsck du`'s), measured by a listing
on a thread of the CheckpointManager's own, at most once every store_size_every seconds,
reported to on_commit as the last known value with when it was measured; the training
step and the hook never wait for the listing. On a local store, on S3 (the session's
S3 server: radosgw under .ci/run, else moto) and with a local tier (both sizes)."""

from __future__ import annotations

import json
import threading
import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.cli import main as cli_main
from tensorstore_ck.errors import InvalidArgument
from tensorstore_ck.storage.wrappers import WrappedStore
from tensorstore_ck.train import CheckpointManager, CommitEvent, TrainState

DEADLINE = 120.0  # generous: the machine is shared
KINDS = ("commits/", "nodes/", "blocks/")


def _du(capsys, path) -> int:
    capsys.readouterr()
    assert cli_main(["du", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["physical_bytes"]


def _train(mgr, model, steps, after_each=None):
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.step(step)
        mgr.wait()  # (the listing this commit asked for has ended too)
        if after_each is not None:
            after_each(step)


@pytest.mark.parametrize("async_", [True, False], ids=["async", "blocking"])
def test_store_size_is_what_du_says_after_the_snapshot_before(tmp_path, capsys, async_):
    events: list[CommitEvent] = []
    path = tmp_path / "s"
    model = torch.nn.Linear(128, 128)
    du = {}
    with tsck.open_store(path) as s:
        mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=1, async_=async_,
                                on_commit=events.append, store_size_every=0)
        _train(mgr, model, range(1, 5), lambda step: du.__setitem__(step, s.du()["physical_bytes"]))
        mgr.close()
    assert _du(capsys, path) == du[4]  # (Store.du() is what `tsck du` prints)
    assert [e.step for e in events] == [1, 2, 3, 4]
    # The first: the listing asked for when the manager was made, if it ended first. It
    # may run while the first snapshot writes: it finds the empty store, some of that
    # snapshot's objects or all of them, never more.
    assert events[0].store_size is None or 0 <= events[0].store_size <= du[1]
    for prev, e in zip(events, events[1:]):
        # each event: the size the listing after the snapshot before it found, which is du's then
        assert e.store_size == du[prev.step] > 0
        assert e.store_size_at >= prev.info.time - 1.0  # (listing began after that commit; clocks of one host)
        assert e.local_size is None
    assert du[4] > du[1]


def test_store_size_on_s3_is_what_du_says(tmp_path, s3_server, s3_url):
    events: list[CommitEvent] = []
    model = torch.nn.Linear(128, 128)
    du = {}
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server) as s:
        mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=1, async_=False,
                                on_commit=events.append, store_size_every=0)
        _train(mgr, model, range(1, 4), lambda step: du.__setitem__(step, s.du()["physical_bytes"]))
        mgr.close()
    assert [e.store_size for e in events[1:]] == [du[1], du[2]] and du[1] > 0


def test_the_listing_is_rate_limited(tmp_path):
    """Default interval: the listing at construction, then none until store_size_every has
    passed, however many snapshots commit; store_size_every=None: never a listing."""
    lists = []

    class Counting(WrappedStore):
        def list(self, prefix):
            if prefix in KINDS:
                lists.append(prefix)
            return super().list(prefix)

    events: list[CommitEvent] = []
    model = torch.nn.Linear(16, 16)
    with tsck.open_store(tmp_path / "s", wrap_storage=Counting) as s:
        mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=1, async_=False,
                                on_commit=events.append)
        mgr.wait()  # (the first listing has ended: every event below reports it)
        _train(mgr, model, range(1, 6))
        mgr.close()
        assert len(lists) == len(KINDS)  # one listing of each kind, at construction
        assert {e.store_size for e in events} == {0} and len({e.store_size_at for e in events}) == 1
        lists.clear()
        events.clear()
        mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=1, async_=False,
                                on_commit=events.append, store_size_every=None)
        _train(mgr, model, range(6, 9))
        mgr.close()
        assert lists == [] and [e.store_size for e in events] == [None] * 3
    with pytest.raises(InvalidArgument, match="store_size_every"):
        CheckpointManager(None, job="x", on_commit=events.append, store_size_every=-1)


class GatedListing(WrappedStore):
    """Listings of commits/, nodes/ and blocks/ wait for `gate` (a store whose listing takes
    minutes); records which thread each ran on."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate, self.started = threading.Event(), threading.Event()
        self.threads: list[threading.Thread] = []

    def list(self, prefix):
        if prefix in KINDS:
            self.threads.append(threading.current_thread())
            self.started.set()
            assert self.gate.wait(DEADLINE)
        return super().list(prefix)


@pytest.mark.parametrize("async_", [True, False], ids=["async", "blocking"])
def test_a_slow_listing_never_blocks_the_step_or_the_hook(tmp_path, async_):
    wrapped: list[GatedListing] = []
    heard = threading.Event()
    events: list[CommitEvent] = []

    def hook(e):
        events.append(e)
        heard.set()

    model = torch.nn.Linear(64, 64)
    with tsck.open_store(tmp_path / "s", wrap_storage=lambda st: wrapped.append(GatedListing(st)) or wrapped[-1]) as s:
        gated = wrapped[0]
        mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=1, async_=async_,
                                on_commit=hook, store_size_every=0)
        assert gated.started.wait(DEADLINE)  # the first listing runs, held
        for step in (1, 2):
            res = mgr.step(step)  # returns while the listing is held
            if async_:
                res.result(timeout=DEADLINE)
            assert heard.wait(DEADLINE)  # and the hook ran, with what was known: nothing yet
            heard.clear()
        assert not gated.gate.is_set()
        assert [(e.step, e.store_size) for e in events] == [(1, None), (2, None)]
        assert all(t is not threading.main_thread() and t.name == "tsck-store-size" for t in gated.threads)
        gated.gate.set()
        mgr.wait()  # the listings asked for meanwhile have ended: the next event has their size
        before = s.du()["physical_bytes"]
        mgr.step(3)
        mgr.close()
        assert events[-1].store_size == before > 0


def test_with_a_local_tier_both_sizes(tmp_path, capsys):
    """store_size: the remote store's (`tsck du URL`); local_size: the tier's (`tsck du URL
    --local PATH`), measured alongside."""
    from tensorstore_ck.maintain.usage import summary, tier_usage  # (what `tsck du` prints, on the open store's tiers)
    events: list[CommitEvent] = []
    model = torch.nn.Linear(128, 128)
    remote, local = tmp_path / "remote", tmp_path / "nvme"
    with tsck.open_store(str(remote), local=str(local)) as s:
        mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=1, async_=False)
        _train(mgr, model, [1])
        mgr.close()
        assert s.wait_durable(timeout=DEADLINE)
        # a manager made now lists both tiers at once, with snapshot 1 uploaded
        mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=1, async_=False,
                                on_commit=events.append, store_size_every=0)
        mgr.wait()
        remote_du, local_du = summary(s.remote_core)["physical_bytes"], tier_usage(s.core)["bytes"]
        _train(mgr, model, [2])
        mgr.close()
        assert s.wait_durable(timeout=DEADLINE)
    (e,) = events
    assert e.store_size == remote_du > 0 and e.local_size == local_du > 0
    capsys.readouterr()
    assert cli_main(["du", str(remote), "--local", str(local), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert e.store_size < d["physical_bytes"] and e.local_size < d["local"]["bytes"]  # (snapshot 2 came after)
