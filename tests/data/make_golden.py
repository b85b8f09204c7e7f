"""(Re)generate a golden store: tests/data/golden/v1/ by default, or with
--collective the multi-rank store tests/data/golden/v1-collective/.

Writes with whatever tensorstore_ck is importable. The committed v1 was written by commit 34bdd15:

    PYTHONPATH=/path/to/checkout-of-34bdd15 python tests/data/make_golden.py
    PYTHONPATH=/path/to/checkout-of-34bdd15 python tests/data/make_golden.py --collective

(an export will do: git archive 34bdd15 tensorstore_ck | tar -x -C DIR; then pass
--writer-commit 34bdd15... so that expected.json still names the writing commit).

Never regenerate a committed golden store to make a failing test pass: the
store is the promise that old snapshots stay readable. A new format version
gets a new folder beside v1 (python tests/data/make_golden.py --out .../v2).

The states come from golden_states.py (deterministic, seeded by strings).
--collective forks 2 ranks (gloo on 127.0.0.1, a few seconds) that make two
collective snapshots (a "W" top node: one tree per rank; sharded, replicated
and rank-local values). Not covered: pickled values ("P"), by design.
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


def _store_facts(s) -> dict:
    return {"tags": {name: info.root for name, info in s.tags().items()},
            "pins": sorted(bytes(r).hex() for r in s.reftable.pins()),
            "retention": {job: {k: v for k, v in vars(r).items()} for job, r in s.retention().items()},
            "store": {"block_size": s.block_size, "inline_threshold": s.inline_threshold}}


def _finish(out: Path, snapshots: list, facts: dict, writer_commit: str | None = None) -> None:
    """Compact the ref table, drop an empty tmp/, write expected.json."""
    _compact_lmdb(out / "refs.lmdb")
    tmp = out / "tmp"
    if tmp.is_dir() and not any(tmp.iterdir()):
        tmp.rmdir()
    pkg = Path(tsck.__file__).resolve().parent
    expected = {
        "written_by": {"tensorstore_ck": getattr(tsck, "__version__", None),
                       "commit": writer_commit or _git_commit(pkg.parent), "torch": torch.__version__,
                       "numpy": np.__version__, "python": sys.version.split()[0]},
        "snapshots": snapshots,
        **facts,
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    nfiles = sum(1 for f in out.rglob("*") if f.is_file())
    print(f"wrote {out}: {len(snapshots)} snapshots, {nfiles} files, {total} bytes (apparent)")


def _block_files(out: Path) -> list[Path]:
    return sorted(p for p in (out / "blocks").rglob("*") if p.is_file())


def _recode_shuffled(files: list[Path], itemsize: int = 4) -> None:
    """Rewrite these block files in codec 2 (byte shuffle of `itemsize`-byte elements,
    then lz4) where it shrinks them (docs/FORMAT.md, "Object frame")."""
    from tensorstore_ck.format import frame
    for p in files:
        old = p.read_bytes()
        hdr = frame.decode_header(old[:frame.HEADER_SIZE])
        raw = bytes(frame.decode_payload(hdr, memoryview(old)[frame.HEADER_SIZE:]))
        new = b"".join(bytes(b) for b in frame.encode_payload(raw, frame.KIND_BLOCK, shuffle_itemsize=itemsize))
        if new[5] == frame.CODEC_SHUFFLE_LZ4:
            tmp = p.with_name(p.name + ".recode")
            tmp.write_bytes(new)
            os.replace(tmp, p)


# ---------------------------------------------------------------- the collective store
DIST_WORLD = 2
DIST_REF = "jobD/dist"
DIST_STEPS = (1, 2)


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dist_rank(rank: int, world: int, port: int, out: str, results: str) -> None:
    """One forked rank: join the gloo group, make the collective snapshots, report rank 0's infos."""
    code = 1
    try:
        import datetime

        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        infos = []
        with tsck.open_store(out, create=False) as s:
            for step in DIST_STEPS:
                state = gs.build("dist_rank", {"rank": rank, "world": world, "step": step},
                                 sharded_cls=tsck.Sharded, replicated_cls=tsck.Replicated)
                info = s.put_snapshot(state, ref=DIST_REF, step=step, metrics={"loss": 1.0 / step},
                                      meta={"what": "collective"}, timeout=60)
                infos.append({"ref": info.ref, "step": info.step, "root": info.root, "metrics": info.metrics,
                              "meta": info.meta, "blocks_total": info.blocks_total,
                              "blocks_new": info.blocks_new, "bytes_total": info.bytes_total,
                              "bytes_new": info.bytes_new})
            dist.barrier()
        with open(f"{results}.{rank}", "w") as f:
            json.dump(infos, f)
        code = 0
    except BaseException:  # noqa: BLE001 - the parent reports the missing result
        import traceback
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no gloo teardown in a forked child


def make_collective(out: Path, writer_commit: str | None = None) -> None:
    import multiprocessing as mp
    with tsck.open_store(out, block_size=BLOCK_SIZE, inline_threshold=INLINE_THRESHOLD):
        pass  # created here, once: the ranks only open it
    results = str(out.parent / f".{out.name}.results")
    port = _free_port()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_dist_rank, args=(r, DIST_WORLD, port, str(out), results))
             for r in range(DIST_WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    if any(p.is_alive() or p.exitcode != 0 for p in procs):
        for p in procs:
            if p.is_alive():
                p.kill()
        raise SystemExit(f"collective snapshot failed: exit codes {[p.exitcode for p in procs]}")
    per_rank = []
    for r in range(DIST_WORLD):
        with open(f"{results}.{r}") as f:
            per_rank.append(json.load(f))
        os.unlink(f"{results}.{r}")
    assert all(pr == per_rank[0] for pr in per_rank), per_rank  # every rank got the same commits
    snapshots = []
    with tsck.open_store(out, create=False) as s:
        for info in per_rank[0]:
            assert info["bytes_new"] < info["bytes_total"] or info["step"] == DIST_STEPS[0], info
            snapshots.append({"ref": info["ref"], "step": info["step"], "root": info["root"],
                              "builder": "dist_view", "args": {"world": DIST_WORLD, "step": info["step"]},
                              "rank_builder": "dist_rank", "world": DIST_WORLD, "kind": "collective",
                              "metrics": info["metrics"], "meta": info["meta"],
                              "blocks_total": info["blocks_total"], "blocks_new": info["blocks_new"]})
            _check_top_is_w(out, info["root"], DIST_WORLD)
        s.tag("dist-1", f"{DIST_REF}@{DIST_STEPS[0]}")
        s.pin(f"{DIST_REF}@{DIST_STEPS[-1]}")
        s.set_retention("jobD", tsck.Retention(keep_last=5))
        facts = _store_facts(s)
    _finish(out, snapshots, facts, writer_commit)


def _check_top_is_w(store_dir: Path, root: str, world: int) -> None:
    """The snapshot really is a multi-rank one: its top node is {"W": {"world": world, ...}}
    (read with plain msgpack and lz4 from the files, per docs/FORMAT.md)."""
    import lz4.block
    import msgpack

    def load(kind: str, hexd: str):
        raw = (store_dir / kind / hexd[:2] / hexd).read_bytes()
        codec, n = raw[5], int.from_bytes(raw[8:16], "little")
        body = raw[16:] if codec == 0 else lz4.block.decompress(raw[16:], uncompressed_size=n)
        return msgpack.unpackb(body, raw=False, strict_map_key=False)

    commit = load("commits", root)
    top = load("nodes", bytes(commit["tree"]).hex())["x"]
    assert set(top) == {"W"} and top["W"]["world"] == world, top
    # version 1 lists the ranks' trees; version 2 points at its rank tree and chunk index
    assert top["W"].get("v") == 2 or len(top["W"]["ranks"]) == world, top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--collective", action="store_true",
                    help="write the multi-rank store (default --out: tests/data/golden/v1-collective)")
    ap.add_argument("--writer-commit", default=None,
                    help="the commit of the writing code, when it is not a git checkout")
    args = ap.parse_args()
    out: Path = args.out or HERE / "golden" / ("v1-collective" if args.collective else "v1")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.collective:
        make_collective(out, args.writer_commit)
        return

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

    # another job sharing the frozen layer, its new blocks in the byte-shuffle codec (codec 2:
    # read by every reader, written by none now, so recoded here; the addresses stay)
    before = set(_block_files(out))
    with tsck.open_store(out, create=False) as s:
        for step in (10, 20):
            put(s, "finetune", {"step": step}, "jobB/ft", step, metrics={"loss": 1.0 / step})
    _recode_shuffled([p for p in _block_files(out) if p not in before])

    # a DCP snapshot (single process: no process group)
    import torch.distributed.checkpoint as dcp
    from tensorstore_ck.dcp import TsckWriter
    with tsck.open_store(out, create=False) as s:
        step = 5
        w = TsckWriter(s, ref="jobC/dcp", step=step, metrics={"loss": 0.25}, meta={"note": "dcp"})
        dcp.save(gs.dcp_state(step), storage_writer=w)
        record(w.info, "dcp_state", {"step": step}, kind="dcp")
        facts = _store_facts(s)
    _finish(out, snapshots, facts, args.writer_commit)


if __name__ == "__main__":
    main()
