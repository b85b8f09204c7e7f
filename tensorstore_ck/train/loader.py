"""ResumableDataLoader: a data loader whose position is part of the snapshot.

Epoch e's order is a permutation drawn from (seed, e), and the dataset's own
randomness (python random, numpy and torch global RNGs used inside
__getitem__) is reseeded per batch from (seed, e, batch index) in whichever
process fetches it. A batch is therefore the same whether it comes from worker
0, worker 1 or the main process, and whether the epoch was resumed in the
middle or not.
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from ..errors import InvalidArgument

__all__ = ["ResumableDataLoader", "batch_seed"]


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
            raise InvalidArgument(f"batch_size must be an int >= 1, got {batch_size!r}")
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
            raise InvalidArgument(f"checkpoint was taken with batch_size {sd['batch_size']}, "
                              f"this loader has {self.batch_size}: the position would not be exact")
        self.epoch = int(sd["epoch"])
        self.batches_consumed = int(sd["batches_consumed"])
        self.seed = int(sd["seed"])
        self.shuffle = bool(sd.get("shuffle", self.shuffle))
