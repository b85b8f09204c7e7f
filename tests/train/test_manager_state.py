"""CheckpointManager(state=...): a TrainState, or a dict of Stateful objects and tensors
(what torch.distributed.checkpoint's save/load take); anything else is refused when the
manager is made, with InvalidArgument naming the key, not at the first snapshot. Data
loaders: any object with state_dict()/load_state_dict() resumes mid-epoch, torchdata's
StatefulDataLoader included.

Each case trains into a real LMDB store, restores into fresh objects in the same way a new
process would (restore_latest), and compares what comes next with the uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.errors import InvalidArgument


class ListLoader:
    """A loader of one's own: batches of a fixed list in an order drawn per epoch from a
    seed, its position (epoch, batch) given by state_dict(). Iterating resumes there."""

    def __init__(self, data: torch.Tensor, batch: int, seed: int):
        self.data, self.batch, self.seed = data, batch, seed
        self.epoch, self.pos = 0, 0

    def __iter__(self):
        order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        n = len(self.data) // self.batch
        while self.pos < n:
            i = self.pos
            self.pos += 1
            yield self.data[order[i * self.batch:(i + 1) * self.batch]]
        self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.pos = int(sd["epoch"]), int(sd["pos"])


DATA = torch.arange(48, dtype=torch.float32).reshape(24, 2)


def _parts(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _train(model, opt, batches, ema: torch.Tensor):
    for x in batches:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        ema.mul_(0.9).add_(0.1 * loss.detach())


def _take(it, n):
    return [next(it) for _ in range(n)]


def _run_with_dict_state(tmp_path, make_loader):
    """Train 5 steps, snapshot through state={...} at step 5, train on: the reference.
    Then restore into fresh objects in a fresh manager and train the same steps."""
    store = tsck.open_store(tmp_path / "store")
    model, opt = _parts()
    loader, ema = make_loader(), torch.zeros(())
    mgr = tsck.CheckpointManager(store, job="j", every_steps=5,
                                 state={"model": model, "optimizer": opt, "dataloader": loader, "ema": ema})
    it = iter(loader)
    for step in range(1, 6):
        _train(model, opt, _take(it, 1), ema)
        mgr.step(step)
    mgr.close()
    rest = _take(it, 4)
    _train(model, opt, rest, ema)
    want = (model.weight.detach().clone(), ema.clone(), torch.stack(rest))

    model2, opt2 = _parts(seed=1)  # different weights: the restore must overwrite them
    loader2, ema2 = make_loader(), torch.full((), 7.0)
    mgr2 = tsck.CheckpointManager(store, job="j", every_steps=5,
                                  state={"model": model2, "optimizer": opt2, "dataloader": loader2, "ema": ema2})
    assert mgr2.restore_latest(must_exist=True) == 5
    it2 = iter(loader2)
    rest2 = _take(it2, 4)
    _train(model2, opt2, rest2, ema2)
    mgr2.close()
    store.close()
    assert torch.equal(torch.stack(rest2), want[2])  # the loader resumed mid-epoch
    assert torch.equal(model2.weight.detach(), want[0])
    assert torch.equal(ema2, want[1])  # the tensor was restored in place


def test_a_dict_of_stateful_objects_and_tensors_snapshots_and_restores(tmp_path):
    _run_with_dict_state(tmp_path, lambda: ListLoader(DATA, 2, seed=3))


def test_torchdata_stateful_dataloader_resumes_mid_epoch(tmp_path):
    sdl = pytest.importorskip("torchdata.stateful_dataloader",
                              reason="torchdata is not installed (pip install torchdata)")

    def make():
        return sdl.StatefulDataLoader(DATA, batch_size=2, shuffle=True,
                                      generator=torch.Generator().manual_seed(5))
    _run_with_dict_state(tmp_path, make)


def test_torchdata_stateful_dataloader_in_a_trainstate(tmp_path):
    sdl = pytest.importorskip("torchdata.stateful_dataloader",
                              reason="torchdata is not installed (pip install torchdata)")
    loader = sdl.StatefulDataLoader(DATA, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(9))
    model, opt = _parts()
    with tsck.open_store(tmp_path / "store") as store:
        mgr = tsck.CheckpointManager(store, job="j", every_steps=2,
                                     state=tsck.TrainState(model=model, optimizer=opt, dataloader=loader))
        it = iter(loader)
        for step in (1, 2):
            next(it)
            mgr.step(step)
        mgr.close()
        want = list(it)
        loader2 = sdl.StatefulDataLoader(DATA, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
        ts2 = tsck.TrainState(model=_parts()[0], optimizer=_parts()[1], dataloader=loader2)
        assert tsck.CheckpointManager(store, job="j", state=ts2).restore_latest() == 2
        got = list(loader2)
    assert len(got) == len(want) == 4 and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("state, words", [
    ({"model": None}, ["model=", "NoneType"]),
    ({"epoch": 3}, ["epoch=", "int", "tensor"]),
    ({"model": torch.nn.Linear(2, 2).state_dict()}, ["model=", "the object itself"]),
    ({"dataloader": torch.utils.data.DataLoader(DATA)}, ["dataloader=", "StatefulDataLoader"]),
    ({3: torch.zeros(1)}, ["keys must be non-empty str"]),
    ([torch.nn.Linear(2, 2)], ["TrainState or a dict", "list"]),
    (torch.nn.Linear(2, 2), ["wrap it"]),
])
def test_what_cannot_be_restored_is_refused_when_the_manager_is_made(tmp_path, state, words):
    with tsck.open_store(tmp_path / "store") as store:
        with pytest.raises(InvalidArgument) as e:
            tsck.CheckpointManager(store, job="j", every_steps=1, state=state)
        for w in words:
            assert w in str(e.value)
        assert store.refs() == {} or not store.refs()  # nothing written


def test_a_dict_key_named_like_a_trainstate_field_is_an_object(tmp_path):
    counter = torch.tensor(41)
    model, opt = _parts()
    with tsck.open_store(tmp_path / "store") as store:
        mgr = tsck.CheckpointManager(store, job="j", every_steps=1, async_=False,
                                     state={"model": model, "step": counter, "rng": torch.ones(2)})
        mgr.step(1)
        counter += 1
        mgr.step(2)
        got = torch.tensor(0)
        mgr2 = tsck.CheckpointManager(store, job="j", state={"model": _parts(1)[0], "step": got,
                                                              "rng": torch.zeros(2)})
        assert mgr2.restore_latest() == 2
        assert int(got) == 42
