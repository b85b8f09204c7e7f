"""Write the golden store tests/data/golden/v1 with whatever tensorstore_ck is importable.

The committed copy was written by the code before the November 2026 redesign:

    git worktree add /tmp/old 34bdd15
    PYTHONPATH=/tmp/old .venv/bin/python tests/data/make_golden.py

Never regenerate it to make tests/test_golden.py pass: the point is that later
versions read what earlier ones wrote. A new format version adds a folder v2
beside v1.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
warnings.filterwarnings("ignore", category=UserWarning)

import lmdb  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import golden_states as gs  # noqa: E402
import tensorstore_ck as tsck  # noqa: E402
from tensorstore_ck.dcp import TsckWriter  # noqa: E402

OUT = os.path.join(HERE, "golden", "v1")


def main() -> None:
    work = tempfile.mkdtemp(prefix="tsck-golden-")
    path = os.path.join(work, "store")
    snaps = []
    with tsck.open_store(path, block_size=4096, inline_threshold=256) as s:
        def put(builder, arg, ref, step):
            info = s.put_snapshot(gs.build(builder, arg), ref=ref, step=step,
                                  metrics={"loss": 1.0 / (step + 1)}, meta={"golden": builder})
            snaps.append({"ref": ref, "step": step, "root": info.root, "builder": builder, "arg": arg})
            return info
        for step in (1, 2, 3):
            put("model", step, "jobA/main", step)
        put("model", 3, "jobB/fork", 3)                      # the same state on another job: full dedup
        put("every_kind", None, "kinds/all", 1)
        put("sharded", None, "kinds/sharded", 1)
        w = TsckWriter(s, ref="kinds/dcp", step=5)
        dcp.save(gs.dcp_state(), storage_writer=w)
        snaps.append({"ref": "kinds/dcp", "step": 5, "root": w.info.root, "builder": "dcp_state", "arg": None,
                      "dcp": True})
        s.tag("golden-2", "jobA/main@2")
        s.pin("jobB/fork")
        s.set_retention("jobA", tsck.Retention(keep_last=5))
        expected = {"written_by": tsck.__version__, "block_size": 4096, "inline_threshold": 256,
                    "snapshots": snaps, "tags": {"golden-2": s.resolve("golden-2")},
                    "pins": [s.resolve("jobB/fork")]}
    # A compact copy of the ref table (the live file is a sparse 64 MiB map).
    env = lmdb.open(os.path.join(path, "refs.lmdb"), subdir=True, max_dbs=16, readonly=True, lock=False)
    compact = os.path.join(work, "refs-compact")
    os.makedirs(compact)
    env.copy(compact, compact=True)
    env.close()
    shutil.rmtree(os.path.join(path, "refs.lmdb"))
    os.rename(compact, os.path.join(path, "refs.lmdb"))
    shutil.rmtree(os.path.join(path, "tmp"), ignore_errors=True)
    shutil.rmtree(OUT, ignore_errors=True)
    shutil.copytree(path, os.path.join(OUT, "store"))
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    shutil.rmtree(work)
    print(f"wrote {OUT}: {len(snaps)} snapshots")


if __name__ == "__main__":
    main()
