"""Reopening a store in another process (AsyncCheckpointerType.PROCESS pickles the writer)."""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass

from ..store import Store

__all__ = ["StoreHandle"]


@dataclass(frozen=True)
class StoreHandle:
    """How to open the same store in another process (a store is opened once per
    process: in the process that pickled it, unpickling gives the same Store)."""
    url: str
    options: tuple

    @staticmethod
    def of(store: Store) -> "StoreHandle":
        from ..refs import LmdbRefTable
        url = store.url
        rt, st, codecs = store.core.refs, store.core.settings, store.core.assets.codecs
        if not url.startswith("file://") or not isinstance(rt, LmdbRefTable) or \
                os.path.abspath(rt.path) != os.path.join(url[len("file://"):], "refs.lmdb"):
            raise TypeError("a TsckWriter can be pickled only with a store on a local folder whose ref table "
                            "is beside it; use the default (thread) async checkpointer")
        # The options that reopen it alike.
        opts = (("block_size", st.block_size), ("inline_threshold", st.inline_threshold),
                ("verify", st.verify), ("compression", codecs))
        h = StoreHandle(url, opts)
        with _OPEN_LOCK:
            _REGISTERED.setdefault((os.getpid(), url), store)
        return h

    def open(self) -> Store:
        from ..opener import open_store
        key = (os.getpid(), self.url)  # a store inherited through fork is not usable: open a new one
        with _OPEN_LOCK:
            s = _REGISTERED.get(key) or _OPENED.get(key)
            if s is None or s.closed:
                s = _OPENED[key] = open_store(self.url[len("file://"):], create=False, **dict(self.options))
            return s


_REGISTERED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # stores of this process
_OPENED: dict = {}  # stores opened by unpickling (kept open for the next request)
_OPEN_LOCK = threading.Lock()


