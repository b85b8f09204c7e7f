"""Tensors proven unchanged since this process last stored them: their blocks' addresses
are reused without a copy or a hash (docs/design/unchanged.md).

A fine-tune's frozen base, an embedding no optimizer touches, the teacher of a
distillation: most of a state may never change, and content addressing already stores
it once. What it still cost per snapshot was the copy into host memory (the stall), the
hash and the lookups. Here the kernel proves a tensor unchanged (util/writewatch.py: every
write to its pages, by any thread and any path, marks them written), so its addresses
are the ones hashed last time, and only their presence in storage is checked.

The proof, per tensor, in one process (one Unchanged for all its stores):
- a put plans the tensor: its pages are read back and protected again in one walk
  (written()), then, if anything was written (or it is new here), its bytes are copied or
  hashed after that walk, and the addresses found are recorded (bound to the leaf's
  results, complete once its blocks are hashed);
- the next put plans it: a walk that finds no page written since, over the same memory
  (the same storage object, alive all along: its memory was never freed and reused), with
  a complete record, proves the bytes are the ones hashed: the record's addresses are
  reused.
A walk that finds written pages marks every other record over them written too (two
tensors may share a page): the walk protected those pages again, and the other record
must not take that for "unchanged".

What is left to hashing, as before: tensors below MIN_BYTES (a page's worth of walking and
bookkeeping costs more than hashing them), device tensors, non-contiguous ones (their
bytes are a copy), pinned host memory (a device writes it by DMA, which no page table
sees), memory shared with another process, file mappings, and packed tensors (their bytes
go into a pack with others). A tensor found written at consecutive puts is watched less
often (every 2, 4, ... 64 puts; each watch costs one fault per page at its next write),
so a state that changes whole pays almost nothing for the watch.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

import numpy as np
import torch

from ..util.writewatch import PAGE, WriteWatch

__all__ = ["Unchanged", "MIN_BYTES"]

log = logging.getLogger(__name__)

MIN_BYTES = 1 << 20  # tensors smaller than this are hashed (their walk costs about as much)
_MAX_RECORDS = 8192  # each watched range may split a mapping in the kernel (vm.max_map_count)
_BACKOFF_MAX = 64


class _Rec:
    __slots__ = ("storage", "start", "end", "results", "n", "marked", "misses", "wait", "armed", "edges", "claims")

    def __init__(self, storage, start: int, end: int, n: int):
        self.storage = weakref.ref(storage)
        self.start, self.end, self.n = start, end, n
        self.results: list | None = None  # the leaf results the addresses come from
        self.marked: list = []  # page ranges another record's walk found (and protected again) written
        # The bytes of its first and last pages that it shares with other memory, as hashed
        # (taken from the staged copy): a write there may be a neighbour's, told apart by them.
        self.edges: tuple | None = None
        self.misses = 0       # consecutive puts that found it written
        self.wait = 0         # puts left before it is watched again
        self.armed = False    # watched since the last put's walk (its addresses bound then)
        self.claims = 0       # the claims that bound it so far: only the newest one's addresses count

    def digests(self) -> list | None:
        r = self.results
        if r is None or len(r) != self.n:
            return None
        return [x.digest for x in r]


class Unchanged:
    """The records of one process (get()). Thread-safe."""

    _one: "Unchanged | None" = None
    _tried = False
    _lock = threading.Lock()
    min_bytes = MIN_BYTES  # (the planner asks only about tensors this large)

    def __init__(self, watch: WriteWatch):
        self._watch = watch
        self._recs: dict[tuple, _Rec] = {}
        self._refused: dict[tuple, weakref.ref] = {}  # memory the kernel would not watch
        self.reused = 0   # tensors proven unchanged (counters, for tests and reports)
        self.hashed = 0   # tensors watched whose bytes were copied or hashed

    @classmethod
    def get(cls) -> "Unchanged | None":
        """This process's, or None where the kernel cannot watch writes."""
        with cls._lock:
            if not cls._tried:
                cls._tried = True
                try:
                    cls._one = cls(WriteWatch.open())
                except OSError as e:
                    log.info("unchanged tensors are hashed at every snapshot: the kernel cannot watch writes "
                             "here (%s)", e)
            return cls._one

    @classmethod
    def _after_fork(cls) -> None:
        # The child's mappings are not watched (no fork events were asked for): start over.
        if cls._one is not None:
            cls._one._watch.close()
        cls._one, cls._tried, cls._lock = None, False, threading.Lock()

    def claim(self, t: torch.Tensor, ranges: list):
        """A CPU tensor a plan reads in place, cut into `ranges` -> its blocks' addresses
        when it is proven unchanged since they were hashed; else a function that takes the
        leaf's results list (its addresses, once hashed), or None when it is not watched."""
        if not _eligible(t):
            return None
        start = t.data_ptr()
        end = start + t.nbytes
        key = (start, end, tuple(ranges))
        storage = t.untyped_storage()
        with self._lock:
            refused = self._refused.get(key)
            if refused is not None:
                if refused() is storage:
                    return None
                del self._refused[key]
            rec = self._recs.get(key)
            if rec is not None and rec.storage() is not storage:
                del self._recs[key]  # another storage at the address: the old one was freed
                rec = None
            if rec is None:
                if len(self._recs) >= _MAX_RECORDS:
                    self._sweep()
                    if len(self._recs) >= _MAX_RECORDS:
                        return None
                if not (_anonymous(start, end) and self._watch.watch(start, end)):
                    self._refused[key] = weakref.ref(storage)
                    return None
                rec = self._recs[key] = _Rec(storage, start, end, len(ranges))
            elif rec.wait > 0:  # found written lately: not watched for now
                rec.wait -= 1
                rec.results, rec.armed = None, False
                return None
            found = self._watch.written(start, end)
            if found is None:  # not watched: the memory was mapped anew since a watch (freed, reused)
                self._watch.forget(start, end)
                if not (_anonymous(start, end) and self._watch.watch(start, end)):
                    del self._recs[key]
                    self._refused[key] = weakref.ref(storage)
                    return None
                found = self._watch.written(start, end)
                if found is None:
                    del self._recs[key]
                    return None
            if found:
                self._mark(found, rec)
            written = _written(rec, found + rec.marked, t)
            rec.marked = []
            known = None if written else rec.digests()
            if known is not None:
                rec.misses = 0
                self.reused += 1
                return known
            if rec.armed and written:  # watched since the last put, and written: watched less often
                rec.misses += 1
                rec.wait = min(1 << rec.misses, _BACKOFF_MAX) - 1
            rec.armed = rec.wait == 0
            rec.results = rec.edges = None
            rec.claims += 1
            self.hashed += 1
            return _Bind(self, rec, rec.claims)

    def _mark(self, found: list, walked: _Rec) -> None:
        """Written pages found (and protected again) by one record's walk: every other
        record over them is told (marked), as its own walk would have found them."""
        for rec in self._recs.values():
            if rec is walked:
                continue
            a, b = WriteWatch.pages(rec.start, rec.end)
            for x, y in found:
                if x < b and a < y:
                    rec.marked.append((max(x, a), min(y, b)))

    def _sweep(self) -> None:
        self._recs = {k: r for k, r in self._recs.items() if r.storage() is not None}
        self._refused = {k: r for k, r in self._refused.items() if r() is not None}


class _Bind:
    """Where a watched tensor's addresses come from, once its bytes are staged and hashed."""

    __slots__ = ("owner", "rec", "claim")

    def __init__(self, owner: Unchanged, rec: _Rec, claim: int):
        self.owner, self.rec, self.claim = owner, rec, claim

    def __call__(self, results: list) -> None:
        """The leaf's results list: complete once its blocks are hashed. A plan made before
        the record's newest claim (another store's put, planned earlier and made later in
        its background) binds nothing: its bytes may be older than the newest walk."""
        with self.owner._lock:
            if self.claim == self.rec.claims:
                self.rec.results = results

    def staged(self, raw: np.ndarray) -> None:
        """Its bytes as staged (what is hashed): the shared edges kept from them."""
        head, tail = _edge_lengths(self.rec.start, self.rec.end)
        edges = (raw[:head].tobytes(), raw[raw.nbytes - tail:].tobytes())
        with self.owner._lock:
            if self.claim == self.rec.claims:
                self.rec.edges = edges


def _edge_lengths(start: int, end: int) -> tuple[int, int]:
    """The bytes of [start, end) on its first and last pages where those pages hold other
    memory too (0: the range starts or ends on a page boundary)."""
    head = (-start) % PAGE
    return head, end % PAGE


def _written(rec: _Rec, found: list, t: torch.Tensor) -> bool:
    """Whether the tensor changed, given the written page ranges over it: a page wholly its
    own written says so; its first or last page, shared with other memory, written says so
    only if its bytes there differ from the ones hashed (the neighbour's write otherwise)."""
    if not found:
        return False
    inner_a, inner_b = -(-rec.start // PAGE) * PAGE, rec.end - rec.end % PAGE
    if any(x < inner_b and inner_a < y for x, y in found):
        return True
    if rec.edges is None:
        return True
    head, tail = _edge_lengths(rec.start, rec.end)
    raw = live_bytes(t)
    return (raw[:head].tobytes(), raw[raw.nbytes - tail:].tobytes()) != rec.edges


def _eligible(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized
            and t.nbytes >= MIN_BYTES and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and not t.is_pinned() and not t.is_shared())


def _anonymous(start: int, end: int) -> bool:
    """Whether [start, end) lies in anonymous private mappings (no file, not shared)."""
    a, b = WriteWatch.pages(start, end)
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return False
    at = a
    for line in lines:
        parts = line.split(None, 5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if hi <= at or lo > at:
            continue
        perms, inode = parts[1], parts[4]
        name = parts[5].strip() if len(parts) > 5 else ""
        if perms[3] != "p" or inode != "0" or (name and name not in ("[heap]",) and not name.startswith("[anon")):
            return False
        at = hi
        if at >= b:
            return True
    return False


def live_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's own bytes, flat (a reused leaf's: written from them only when storage
    lost the block, and checked against its address then)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


os.register_at_fork(after_in_child=Unchanged._after_fork)
