"""`tsck recover` (the CLI itself) whose storage stops before the second commit it reads.

    python recover_gated.py STORE GATE_DIR [tsck options...]

The CLI's open_store is given a storage wrapper (the same `wrap_storage` hook the
harness's fault injector uses). recover reads every commit once to decode it, then
each again as it walks it to adopt it: when a second commit object is read the
second time, the first one has been adopted (its catalog row written); the wrapper
then creates GATE_DIR/reached and waits until GATE_DIR/open exists. A test kills -9 the
process there (a recover stopped after adopting one commit), or runs a gc beside it
and then opens the gate. Nothing of recover itself is replaced.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import tensorstore_ck.cli as cli

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _util
from _util import Watched  # noqa: E402


class Gate(Watched):
    def __init__(self, inner, gate_dir: str):
        super().__init__(inner)
        self.gate_dir = gate_dir
        self.reads: dict = {}  # commit key -> times read
        self.walked = 0  # commits read a second time

    def on_read(self, key: str) -> None:
        if not key.startswith("commits/"):
            return
        self.reads[key] = self.reads.get(key, 0) + 1
        if self.reads[key] != 2:
            return
        self.walked += 1
        if self.walked == 2:
            open(os.path.join(self.gate_dir, "reached"), "w").close()
            while not os.path.exists(os.path.join(self.gate_dir, "open")):
                time.sleep(0.02)


def main() -> int:
    store, gate_dir, *opts = sys.argv[1:]
    cli.open_store = functools.partial(cli.open_store, wrap_storage=lambda inner: Gate(inner, gate_dir))
    return cli.main([*opts, "recover", store])


if __name__ == "__main__":
    sys.exit(main())
