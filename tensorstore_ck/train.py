"""Training helpers: exact resume of a training run, and when to snapshot it.

    loader = ResumableDataLoader(dataset, batch_size=32, shuffle=True, num_workers=2, seed=0)
    ts = TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    mgr = CheckpointManager(store, job="run1", state=ts, every_steps=100,
                            retention=Retention(keep_last=3))
    step = mgr.restore_latest() or 0
    while step < total_steps:
        for x, y in loader:               # a resumed epoch yields exactly the remaining batches
            step += 1
            ...train...
            mgr.step(step, metrics={"loss": loss.item()})
    mgr.close()

Resume is bit-identical when everything random flows from state TrainState
captures: model, optimizer, scheduler and grad-scaler state, every RNG stream
(python, numpy's global state and the numpy Generators handed to it, torch CPU
and each CUDA device) and the data-loader position. ResumableDataLoader makes
the data side exact: epoch e's order is a permutation drawn from (seed, e), and
the dataset's own randomness (python random, numpy and torch global RNGs used
inside __getitem__) is reseeded per batch from (seed, e, batch index) in
whichever process fetches it. A batch is therefore the same whether it comes
from worker 0, worker 1 or the main process, and whether the epoch was resumed
in the middle or not.
"""

from __future__ import annotations

import hashlib
import numbers
import random
import time
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from .errors import InvalidName, RefNotFound
from .retention import Retention

__all__ = ["ResumableDataLoader", "TrainState", "CheckpointManager", "batch_seed"]


def batch_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one batch; independent streams per (seed, epoch, index)."""
    h = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


class _SeededDataset(torch.utils.data.Dataset):
    """Receives (index, batch seed) pairs; seeds the RNGs for the batch, then fetches."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def _fetch(self, items):
        seed = items[0][1]
        in_main = get_worker_info() is None
        if in_main:  # do not disturb the training loop's own streams (dropout, etc.)
            saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        try:
            getitems = getattr(self.dataset, "__getitems__", None)
            if getitems is not None:
                return getitems([i for i, _ in items])
            return [self.dataset[i] for i, _ in items]
        finally:
            if in_main:
                random.setstate(saved[0])
                np.random.set_state(saved[1])
                torch.set_rng_state(saved[2])

    def __getitems__(self, items):
        return self._fetch(items)

    def __getitem__(self, item):
        return self._fetch([item])[0]


class ResumableDataLoader:
    """A DataLoader whose position (epoch, batches consumed) can be saved and restored.

    Iterating yields the rest of the current epoch; when an epoch is exhausted
    the next iteration starts the next one. `epoch` and `batches_consumed` say
    where it stands; state_dict()/load_state_dict() carry them (and the seed)."""

    def __init__(self, dataset, batch_size: int = 1, shuffle: bool = False, *, seed: int = 0,
                 drop_last: bool = False, num_workers: int = 0, collate_fn: Callable | None = None,
                 pin_memory: bool = False, worker_init_fn: Callable | None = None, timeout: float = 0,
                 prefetch_factor: int | None = None, multiprocessing_context=None):
        if type(batch_size) is not int or batch_size < 1:
            raise InvalidName(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.loader_kwargs = dict(num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin_memory,
                                  worker_init_fn=worker_init_fn, timeout=timeout,
                                  multiprocessing_context=multiprocessing_context)
        if prefetch_factor is not None:
            self.loader_kwargs["prefetch_factor"] = prefetch_factor
        self.epoch = 0
        self.batches_consumed = 0

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(batch_seed(self.seed, epoch, -1))
        return torch.randperm(n, generator=g).tolist()

    def __iter__(self):
        if self.batches_consumed >= len(self):  # the last epoch was finished: start the next
            self.epoch += 1
            self.batches_consumed = 0
        epoch, start = self.epoch, self.batches_consumed
        order = self._order(epoch)
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        todo = [[(i, batch_seed(self.seed, epoch, b)) for i in batches[b]] for b in range(start, len(batches))]
        if not todo:
            return
        kwargs = {k: v for k, v in self.loader_kwargs.items() if v is not None or k == "collate_fn"}
        if kwargs.get("collate_fn") is None:
            kwargs.pop("collate_fn")
        # A private generator: otherwise creating the iterator draws its worker base
        # seed from torch's global RNG, shifting the training loop's stream (dropout)
        # by a different amount in a resumed run than in one that never stopped.
        gen = torch.Generator().manual_seed(batch_seed(self.seed, epoch, -2))
        loader = DataLoader(_SeededDataset(self.dataset), batch_sampler=todo, generator=gen, **kwargs)
        for batch in loader:
            # Counted before the caller sees it: a snapshot taken while the caller
            # works on this batch must not replay it.
            self.batches_consumed += 1
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed, "seed": self.seed,
                "batch_size": self.batch_size, "shuffle": self.shuffle}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("batch_size", self.batch_size) != self.batch_size:
            raise InvalidName(f"checkpoint was taken with batch_size {sd['batch_size']}, "
                              f"this loader has {self.batch_size}: the position would not be exact")
        self.epoch = int(sd["epoch"])
        self.batches_consumed = int(sd["batches_consumed"])
        self.seed = int(sd["seed"])
        self.shuffle = bool(sd.get("shuffle", self.shuffle))


def _has_state(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class TrainState:
    """Everything a run needs to continue exactly: captured by state_dict(), put back by load_state_dict()."""

    def __init__(self, model=None, optimizer=None, scheduler=None, scaler=None, dataloader=None, *,
                 numpy_generators: dict | None = None, step: int = 0, **objects):
        self.components = {k: v for k, v in (("model", model), ("optimizer", optimizer),
                                             ("scheduler", scheduler), ("scaler", scaler),
                                             ("dataloader", dataloader)) if v is not None}
        for name, obj in {**self.components, **objects}.items():
            if not _has_state(obj):
                raise InvalidName(f"TrainState {name}= must have state_dict() and load_state_dict() "
                                  f"(got {type(obj).__name__}); for a torch DataLoader use "
                                  "tsck.ResumableDataLoader")
        self.objects = objects
        self.numpy_generators = dict(numpy_generators or {})
        for name, g in self.numpy_generators.items():
            if not isinstance(g, np.random.Generator):
                raise InvalidName(f"numpy_generators[{name!r}] is not a numpy Generator")
        self.step = step

    def state_dict(self) -> dict:
        rng = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "numpy_generators": {k: g.bit_generator.state for k, g in self.numpy_generators.items()},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "step": self.step,
            **{k: v.state_dict() for k, v in self.components.items()},
            "objects": {k: v.state_dict() for k, v in self.objects.items()},
            "rng": rng,
        }

    def load_state_dict(self, sd: dict) -> None:
        for k, v in self.components.items():
            if k not in sd:
                raise InvalidName(f"snapshot has no {k!r} to restore")
            v.load_state_dict(sd[k])
        for k, v in self.objects.items():
            v.load_state_dict(sd["objects"][k])
        rng = sd["rng"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        for k, g in self.numpy_generators.items():
            g.bit_generator.state = rng["numpy_generators"][k]
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            states = rng["cuda"]
            for i in range(min(len(states), torch.cuda.device_count())):
                torch.cuda.set_rng_state(states[i], i)
        self.step = sd["step"]


class CheckpointManager:
    """Decides when to snapshot a TrainState and snapshots it (asynchronously by default).

    Triggers (any one fires a snapshot):
      every_steps=N      when step % N == 0
      every_seconds=T    when clock() - time of the last snapshot (or of the start) >= T
      on_metric=(name, "min"|"max")  when metrics[name] improves on the best seen (the first value counts)
    The job's retention rules are set in the store when given. Jobs in one store
    keep independent policies (each manager has its own job and ref)."""

    def __init__(self, store, *, job: str, state: TrainState | None = None, ref: str | None = None,
                 every_steps: int | None = None, every_seconds: float | None = None,
                 on_metric: tuple | None = None, retention: Retention | None = None,
                 async_: bool = True, when_busy: str | None = None, clock: Callable[[], float] = time.monotonic):
        if every_steps is not None and (type(every_steps) is not int or every_steps < 1):
            raise InvalidName(f"every_steps must be an int >= 1, got {every_steps!r}")
        if every_seconds is not None and not every_seconds > 0:
            raise InvalidName(f"every_seconds must be > 0, got {every_seconds!r}")
        if on_metric is not None and (not isinstance(on_metric, tuple) or len(on_metric) != 2
                                      or on_metric[1] not in ("min", "max")):
            raise InvalidName(f"on_metric must be (name, 'min'|'max'), got {on_metric!r}")
        self.store = store
        self.job = job
        self.ref = ref or f"{job}/main"
        self.state = state
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.on_metric = on_metric
        self.async_ = async_
        self.when_busy = when_busy
        self.clock = clock
        self.last_time = clock()
        self.last_step: int | None = None
        self.best: float | None = None
        self.last = None  # SnapshotInfo or Future of the last snapshot taken
        if retention is not None:
            store.set_retention(job, retention)

    def reasons(self, step: int, metrics: dict | None = None) -> list[str]:
        """Which triggers fire at this step (does not change any state)."""
        out = []
        if step == self.last_step:
            return out
        if self.every_steps and step % self.every_steps == 0:
            out.append("steps")
        if self.every_seconds is not None and self.clock() - self.last_time >= self.every_seconds:
            out.append("seconds")
        if self.on_metric is not None and metrics and self.on_metric[0] in metrics:
            v = metrics[self.on_metric[0]]
            if v == v and (self.best is None or (v < self.best if self.on_metric[1] == "min" else v > self.best)):
                out.append("metric")
        return out

    def step(self, step: int, metrics: dict | None = None, *, force: bool = False):
        """Call once per training step. Snapshots when a trigger fires (or force=True);
        returns the SnapshotInfo (blocking), a Future (async), or None. A failed
        background snapshot is raised here, at the next call."""
        self.store.raise_pending_error()
        why = self.reasons(step, metrics)
        if self.on_metric is not None and metrics and self.on_metric[0] in metrics:
            v = metrics[self.on_metric[0]]
            if v == v and (self.best is None or (v < self.best if self.on_metric[1] == "min" else v > self.best)):
                self.best = v
        if not why and not force:
            return None
        if self.state is None:
            raise InvalidName("CheckpointManager has no state= to snapshot")
        self.state.step = step
        metrics = {k: float(v.item()) if isinstance(v, torch.Tensor) and v.numel() == 1 else v
                   for k, v in (metrics or {}).items()}
        metrics = {k: v for k, v in metrics.items()
                   if isinstance(v, numbers.Real) and not isinstance(v, bool)}
        res = self.store.put_snapshot(self.state.state_dict(), ref=self.ref, job=self.job, step=step,
                                      metrics=metrics, meta={"triggers": why or ["forced"]},
                                      blocking=not self.async_, when_busy=self.when_busy)
        if res is not None:
            self.last_time = self.clock()
            self.last_step = step
            self.last = res
        return res

    def restore_latest(self, state: TrainState | None = None) -> int | None:
        """Load the newest committed snapshot of this job's ref into the state; its step, or None."""
        state = state or self.state
        if state is None:
            raise InvalidName("restore_latest needs a TrainState")
        try:
            history = self.store.log(self.ref)
        except RefNotFound:
            return None
        if not history:
            return None
        sd = self.store.checkout(history[0].root)
        state.load_state_dict(sd)
        self.last_step = state.step
        self.last_time = self.clock()
        if self.on_metric is not None:
            vals = [h.metrics[self.on_metric[0]] for h in history if self.on_metric[0] in h.metrics]
            vals = [v for v in vals if v == v]
            if vals:
                self.best = min(vals) if self.on_metric[1] == "min" else max(vals)
        return state.step

    def wait(self) -> None:
        """Wait for snapshots in flight; raise if one failed."""
        self.store.wait()
        self.store.raise_pending_error()

    def close(self) -> None:
        self.wait()

