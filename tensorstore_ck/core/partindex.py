"""The index of parts of stored packs a Store may name again (packparts.py,
docs/design/scaling.md "Packs"): content hash -> where a pack holds those bytes, and
whether this process hashed them itself. Below the read and write paths: both ask it."""

from __future__ import annotations

import threading
from collections import OrderedDict

import blake3

__all__ = ["PartIndex", "part_matches", "MAX_PARTS"]

MAX_PARTS = 1 << 18  # parts an index keeps (~60 MB at most), the least recently used dropped


def part_matches(pack, off: int, n: int, h: bytes) -> bool:
    """Whether bytes [off, off + n) of a pack's verified bytes hash to `h` (LEAF `h`)."""
    return blake3.blake3(memoryview(pack)[off:off + n]).digest() == h


class PartIndex:
    """content hash -> (pack address, offset, the pack's length, the part's length, checked)
    of parts of packs this store held when last seen (a hint: a writer checks the pack is
    there before naming it). checked: this process hashed the part's bytes itself (it
    wrote the pack, or read it and compared: check_pack); a part only learned from a
    stored manifest is not, and is not named until it is (packparts.py). Thread-safe; bounded (least
    recently used dropped)."""

    def __init__(self, limit: int = MAX_PARTS):
        self.limit = limit
        self._lock = threading.Lock()
        self._parts: OrderedDict = OrderedDict()
        self._unchecked: dict = {}  # pack address -> {content hash} of its entries not checked
        self._learned: set = set()  # snapshots whose parts were added (learn())
        self._looked: set = set()  # refs a collective put's or a DCP save's rank learnt from (first_look)

    def __len__(self) -> int:
        return len(self._parts)

    def get(self, h: bytes):
        with self._lock:
            got = self._parts.get(h)
            if got is not None:
                self._parts.move_to_end(h)
            return got

    def add(self, h: bytes, pack: bytes, off: int, glen: int, n: int, checked: bool = True) -> None:
        """An unchecked part never replaces a known one (a lying manifest cannot displace
        a part this process hashed)."""
        with self._lock:
            if not checked and h in self._parts:
                return
            self._drop(h)
            self._parts[h] = (pack, off, glen, n, checked)
            if not checked:
                self._unchecked.setdefault(pack, set()).add(h)
            while len(self._parts) > self.limit:
                self._drop(next(iter(self._parts)))

    def _drop(self, h: bytes) -> None:
        v = self._parts.pop(h, None)
        if v is not None and not v[4]:
            hs = self._unchecked.get(v[0])
            hs.discard(h)
            if not hs:
                del self._unchecked[v[0]]

    def forget(self, packs) -> None:
        """Packs found gone: none of their parts is named again."""
        packs = set(packs)
        with self._lock:
            for h in [h for h, v in self._parts.items() if v[0] in packs]:
                self._drop(h)

    def check_pack(self, pack: bytes, data) -> None:
        """`data`, the pack's verified bytes, judges every unchecked part learned of it:
        one whose bytes hash to its content hash becomes checked, any other is dropped."""
        with self._lock:
            todo = [(h, self._parts[h]) for h in self._unchecked.get(pack, ())]
        judged = [(h, v, v[2] == len(data) and part_matches(data, v[1], v[3], h)) for h, v in todo]
        with self._lock:  # (hashed outside the lock; an entry changed meanwhile is left as it is)
            for h, v, ok in judged:
                if self._parts.get(h) == v:
                    self._drop(h)
                    if ok:
                        self._parts[h] = v[:4] + (True,)

    def wrote(self, root: bytes) -> None:
        """A snapshot this Store published: its parts are in already (learn_written)."""
        with self._lock:
            self._learned.add(root)

    def read_back(self, root: bytes, parts: list, whole: bool) -> None:
        """A checkout of snapshot `root` read `parts` ((h, pack, offset, pack length,
        length), each checked against h as it was read): they are known as this process's
        own; whole: every part of it was read, so its nodes need not be read to learn it."""
        for h, pack, off, glen, n in parts:
            self.add(h, pack, off, glen, n, checked=True)
        if whole:
            with self._lock:
                self._learned.add(root)

    def first_look(self, ref: str) -> bool:
        """Whether `ref` is new to this process's collective puts and DCP saves (marks it): a
        rank learns the parts of the ref's snapshot once, at its first put on it (a restarted job);
        after that it knows the packs it writes (learn_written), and its later puts ask the
        ref table nothing for them."""
        with self._lock:
            if ref in self._looked:
                return False
            self._looked.add(ref)
            return True

    def learning(self, root: bytes) -> bool:
        """Whether `root`'s parts are still to be added (packparts.learn); marks it as added."""
        with self._lock:
            if root in self._learned:
                return False
            self._learned.add(root)
            return True
