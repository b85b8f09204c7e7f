"""What the saver tests (tests/write/test_saver.py) and the training processes they start
share: their store and states, and storage wrappers for open_store(wrap_storage=) with
saver="process": functions of an importable module, given by functools.partial, so that
pickle carries them to the saver process, which wraps the storage it writes with them as
the training process does."""
from __future__ import annotations

import errno
import os

import torch

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import InjectedFault, WrappedStore

BLOCK = 64 << 10


def state_at(step: int, n: int = 12, numel: int = 48 << 10) -> dict:
    """A state that is a function of its step (a fresh process rebuilds it to compare)."""
    g = torch.Generator().manual_seed(step)
    return {"step": step, "w": [torch.randn(numel, generator=g) for _ in range(n)],
            "b": torch.arange(step, step + 10), "note": f"at {step}"}


def open_(path, **kw):
    """The saver tests' store: its puts through a saver process."""
    return tsck.open_store(path, block_size=BLOCK, inline_threshold=256, saver="process", **kw)


class Ledger(WrappedStore):
    """Appends "<pid> <key>" to a file for every object put: who wrote what."""

    def __init__(self, inner, path: str):
        super().__init__(inner)
        self.path = path

    def _note(self, key: str) -> None:
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {key}\n")

    def put_if_absent(self, key, bufs):  # (put_addressed comes here too: WrappedStore)
        self._note(key)
        return self.inner.put_if_absent(key, bufs)


def ledger(path: str, inner):
    return Ledger(inner, path)


class FailBlocksElsewhere(WrappedStore):
    """Every block put by a process other than `home` fails (EIO, never retried)."""

    def __init__(self, inner, home: int):
        super().__init__(inner)
        self.home = home

    def put_if_absent(self, key, bufs):
        if key.startswith("blocks/") and os.getpid() != self.home:
            raise InjectedFault(errno.EIO, f"injected: the saver's write of {key} failed")
        return self.inner.put_if_absent(key, bufs)


def fail_blocks_elsewhere(home: int, inner):
    return FailBlocksElsewhere(inner, home)
