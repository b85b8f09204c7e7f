"""(Re)generate a golden store: tests/data/golden/v1/ by default.

Writes with whatever tensorstore_ck is importable. The committed v1 was written
by the code before the November 2026 redesign (commit 34bdd15):

    PYTHONPATH=/path/to/checkout-of-34bdd15 python tests/data/make_golden.py

Never regenerate a committed golden store to make a failing test pass: the
store is the promise that old snapshots stay readable. A new format version
gets a new folder beside v1 (python tests/data/make_golden.py --out .../v2).

The states come from golden_states.py (deterministic, seeded by strings).
Not covered: a multi-rank (collective, "W") snapshot, which needs several
processes; pickled values ("P"), by design.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import golden_states as gs  # noqa: E402
import tensorstore_ck as tsck  # noqa: E402

BLOCK_SIZE = 4096  # chunker.MIN_BLOCK_SIZE: many blocks from small tensors
INLINE_THRESHOLD = 256


def _git_commit(path: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30)
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except OSError:
        return None


def _compact_lmdb(path: Path) -> None:
    """Replace refs.lmdb/ by a compact copy of its data (no lock file: LMDB makes one on open)."""
    import lmdb
    with tempfile.TemporaryDirectory() as tmp:
        env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=64, subdir=True)
        try:
            env.copy(tmp, compact=True)
        finally:
            env.close()
        shutil.rmtree(path)
        path.mkdir()
        shutil.copyfile(os.path.join(tmp, "data.mdb"), path / "data.mdb")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "golden" / "v1")
    args = ap.parse_args()
    out: Path = args.out
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)

    snapshots: list[dict] = []

    def record(info, builder: str, bargs: dict, kind: str = "tree"):
        snapshots.append({"ref": info.ref, "step": info.step, "root": info.root, "builder": builder,
                          "args": bargs, "kind": kind, "metrics": info.metrics, "meta": info.meta,
                          "blocks_total": info.blocks_total, "blocks_new": info.blocks_new})

    def put(store, builder: str, bargs: dict, ref: str, step, **kw):
        state = gs.build(builder, bargs, sharded_cls=tsck.Sharded, replicated_cls=tsck.Replicated)
        info = store.put_snapshot(state, ref=ref, step=step, **kw)
        record(info, builder, bargs)
        return info

    with tsck.open_store(out, block_size=BLOCK_SIZE, inline_threshold=INLINE_THRESHOLD) as s:
        # one job, several steps: dedup between steps (frozen layer, unchanged embedding rows, zeros)
        for step in (100, 200, 300):
            put(s, "train", {"step": step}, "jobA/main", step,
                metrics={"loss": 3.0 - step / 100, "acc": step // 100}, meta={"host": "golden", "n": [1, 2.5]})
        # every supported value type
        put(s, "zoo", {}, "jobZ/zoo", 1, metrics={"loss": 0.5}, meta={"what": "zoo"})
        # a snapshot without a step, of an empty state
        put(s, "empty", {}, "jobZ/nostep", None)
        s.tag("release-1", "jobA/main@200")
        s.tag("zoo-v1", "jobZ/zoo@1")
        s.pin("jobA/main@100")
        s.set_retention("jobA", tsck.Retention(keep_last=2, keep_best=1, metric="loss", mode="min",
                                               keep_every_steps=1000, max_age_days=3650.0))
        s.set_retention("jobB", tsck.Retention(keep_last=1))

    # another job sharing the frozen layer, written with the shuffle codec (codec 2)
    with tsck.open_store(out, create=False, shuffle=True) as s:
        for step in (10, 20):
            put(s, "finetune", {"step": step}, "jobB/ft", step, metrics={"loss": 1.0 / step})

    # a DCP snapshot (single process: no process group)
    import torch.distributed.checkpoint as dcp
    from tensorstore_ck.dcp import TsckWriter
    with tsck.open_store(out, create=False) as s:
        step = 5
        w = TsckWriter(s, ref="jobC/dcp", step=step, metrics={"loss": 0.25}, meta={"note": "dcp"})
        dcp.save(gs.dcp_state(step), storage_writer=w)
        record(w.info, "dcp_state", {"step": step}, kind="dcp")
        tags = {name: info.root for name, info in s.tags().items()}
        pins = sorted(bytes(r).hex() for r in s.reftable.pins())
        retention = {job: {k: v for k, v in vars(r).items()} for job, r in s.retention().items()}
        cfg = {"block_size": s.block_size, "inline_threshold": s.inline_threshold}

    _compact_lmdb(out / "refs.lmdb")
    tmp = out / "tmp"
    if tmp.is_dir() and not any(tmp.iterdir()):
        tmp.rmdir()

    pkg = Path(tsck.__file__).resolve().parent
    expected = {
        "written_by": {"tensorstore_ck": getattr(tsck, "__version__", None),
                       "commit": _git_commit(pkg.parent), "torch": torch.__version__,
                       "numpy": np.__version__, "python": sys.version.split()[0]},
        "store": cfg,
        "snapshots": snapshots,
        "tags": tags,
        "pins": pins,
        "retention": retention,
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    nfiles = sum(1 for f in out.rglob("*") if f.is_file())
    print(f"wrote {out}: {len(snapshots)} snapshots, {nfiles} files, {total} bytes (apparent)")


if __name__ == "__main__":
    main()
