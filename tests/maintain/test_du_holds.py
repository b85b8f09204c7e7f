"""`tsck du` says what each job holds and what it alone holds (what deleting it would
free), in text and --json, without --plot; and `tsck du --plot`'s left panel draws the
store's physical size over time with what gc reclaimed, from numbers checked here
against the files on disk and gc's own reports (the figure's data, not its pixels)."""
from __future__ import annotations

import json

import pytest

import tensorstore_ck as tsck
from tensorstore_ck import cli

from _util import DU_BS as BS, block_digests, block_sizes_on_disk, expected_numbers, fill, vec


def tsck_cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _row(out: str, job: str) -> str:
    """That job's line, its spaces squeezed."""
    return " ".join(next(ln for ln in out.splitlines() if ln.strip().startswith(f"job {job} ")).split())


def test_du_charges_each_job_what_it_alone_holds(tmp_path, capsys, monkeypatch):
    """A model imported by one job and fine-tuned by another: the second job wrote no new
    block of the base (the old `written` column said 0 B) yet holds it; once the first
    job's ref is gone, it alone holds it, and du says so without --plot."""
    monkeypatch.delenv("TSCK_STORE", raising=False)
    path = tmp_path / "s"
    base, head = vec(1, 6), vec(2, 1)
    with tsck.open_store(path, block_size=BS, inline_threshold=1024) as s:
        s.put_snapshot({"base": base}, ref="seed/main", step=0)
        s.put_snapshot({"base": base, "head": head}, ref="prod/main", step=1)
    sizes = block_sizes_on_disk(path)
    base_bytes = sum(sizes[d] for d in block_digests(base))
    head_bytes = sum(sizes[d] for d in block_digests(head))

    rc, out, err = tsck_cli(capsys, "du", path)
    assert rc == 0, err
    assert "written" not in out
    assert f"holds {base_bytes / 1000:.2f} kB" in _row(out, "seed") and "alone 0 B" in _row(out, "seed")
    assert f"holds {(base_bytes + head_bytes) / 1000:.2f} kB" in _row(out, "prod")
    assert f"alone {head_bytes / 1000:.2f} kB" in _row(out, "prod")
    rc, out, _ = tsck_cli(capsys, "du", path, "--json")
    jobs = json.loads(out)["jobs"]
    assert (jobs["seed"]["held_bytes"], jobs["seed"]["only_bytes"]) == (base_bytes, 0)
    assert (jobs["prod"]["held_bytes"], jobs["prod"]["only_bytes"]) == (base_bytes + head_bytes, head_bytes)

    assert tsck_cli(capsys, "delete-ref", path, "seed/main")[0] == 0
    rc, out, _ = tsck_cli(capsys, "du", path, "--json")
    jobs = json.loads(out)["jobs"]
    assert "seed" not in jobs
    assert jobs["prod"]["only_bytes"] == jobs["prod"]["held_bytes"] == base_bytes + head_bytes


def test_du_text_and_json_match_the_block_count(tmp_path, capsys, monkeypatch):
    """Three jobs sharing in several ways (test_plot.fill): du's held and alone bytes per
    job are the ones counted from the tensors' block digests and the files on disk."""
    monkeypatch.delenv("TSCK_STORE", raising=False)
    path = tmp_path / "s"
    want, _ = expected_numbers(path, fill(path))
    rc, out, err = tsck_cli(capsys, "du", path, "--json")
    assert rc == 0, err
    jobs = json.loads(out)["jobs"]
    for job, (held, only) in want.items():
        assert (jobs[job]["held_bytes"], jobs[job]["only_bytes"]) == (held, only), job
    rc, out, _ = tsck_cli(capsys, "du", path)
    order = [ln.split()[1] for ln in out.splitlines() if ln.strip().startswith("job ")]
    assert order == sorted(want, key=lambda j: -want[j][1])  # the most freed first


def test_plot_left_panel_is_the_store_size_with_reclaimed_space(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TSCK_STORE", raising=False)
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    path = tmp_path / "s"
    base = vec(1, 4)
    made = []  # every commit, the ones retention drops too
    with tsck.open_store(path, block_size=BS, inline_threshold=1024) as s:
        for step in range(3):
            made.append(s.put_snapshot({"base": base, "h": vec(10 + step, 2)}, ref="prod/main", step=step))
            made.append(s.put_snapshot({"base": base, "h": vec(20 + step, 1)}, ref="exp/main", step=step))
        s.set_retention("exp", tsck.Retention(keep_last=1))
    before = sum(block_sizes_on_disk(path).values())
    rc, out, err = tsck_cli(capsys, "gc", path, "--json")
    assert rc == 0, err
    gc = json.loads(out)
    after_gc = sum(block_sizes_on_disk(path).values())
    assert gc["deleted_block_bytes"] == before - after_gc > 0
    with tsck.open_store(path, create=False) as s:
        made.append(s.put_snapshot({"base": base, "h": vec(13, 2)}, ref="prod/main", step=3))
        kept = sorted((i for r in ("prod/main", "exp/main") for i in s.log(r)), key=lambda i: i.time)
    on_disk = sum(block_sizes_on_disk(path).values())

    figs = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figs.append(fig), close(fig)))
    png = tmp_path / "u.png"
    rc, out, err = tsck_cli(capsys, "du", path, "--plot", png, "--json")
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = json.loads(out)["plot"]["physical"]
    # ends at what storage holds now, begins at 0; each commit (kept or dropped by
    # retention since) added its stored_new at its time; the gc took its block bytes away
    # at its time; written = stored + reclaimed
    assert p["stored"][-1] == on_disk and p["gcs"] == 1 and p["start"] == 0
    assert p["reclaimed"][-1] == gc["deleted_block_bytes"]
    assert [w - s for w, s in zip(p["written"], p["stored"])] == p["reclaimed"]
    steps = [b - a for a, b in zip([p["start"]] + p["stored"], p["stored"])]
    assert sorted(d for d in steps if d > 0) == sorted(i.stored_new for i in made if i.stored_new)
    assert [d for d in steps if d < 0] == [-gc["deleted_block_bytes"]]
    assert p["logical"][-1] == sum(i.bytes_total for i in kept)
    assert p["times"] == sorted(p["times"]) and len(p["times"]) == len(made) + 1 and p["dropped"] == 2
    # the drawn lines are these numbers (the figure's data, in the axis' unit)
    (fig,) = [f for f in figs if f is not None]
    ax = fig.axes[0]
    lines = {ln.get_label().split(":")[0].split(" (")[0]: ln for ln in ax.get_lines()}
    scale = 1e6  # MB: the largest value is between 1 and 1000 MB
    assert max(p["written"] + p["logical"]) >= 1e6
    for label, key in (("physical", "stored"), ("written in all", "written"), ("logical", "logical")):
        ys = list(lines[label].get_ydata())
        assert ys == pytest.approx([v / scale for v in p[key]]), label
    legend = ax.get_legend()
    assert legend is not None and legend.get_bbox_to_anchor().y1 < ax.bbox.y0  # below the axes, off the data
    assert "reclaimed by gc (1 run on record)" in [t.get_text() for t in legend.get_texts()]


def _files(path, kinds=("blocks", "nodes", "commits")) -> dict:
    out = {}
    for kind in kinds:
        for f in (path / kind).glob("*/*"):
            out[(kind, f.name)] = f.stat().st_size
    return out


def test_du_reports_dedup_compression_and_orphans_apart(tmp_path, capsys, monkeypatch):
    """Dedup (logical bytes of the kept snapshots / the distinct content they use),
    compression (those distinct blocks' logical bytes / their stored bytes) and the
    orphans awaiting gc are three figures: a deleted ref's leftovers move none of the
    ratios, random floats compress 1.00x, and the orphans are exactly what gc then removes."""
    monkeypatch.delenv("TSCK_STORE", raising=False)
    path = tmp_path / "s"
    state = {"w": vec(1, 4), "b": vec(2, 1)[:100]}  # 4 blocks, and 400 bytes inlined in the node
    with tsck.open_store(path, block_size=BS, inline_threshold=1024) as s:
        for step in (1, 2):
            s.put_snapshot(state, ref="a/main", step=step)
        s.put_snapshot({**state, "x": vec(3, 3)}, ref="b/main", step=1)
        s.delete_ref("b/main")
    one = 4 * BS + 400
    blocks_of_a = {("blocks", d.hex()) for d in block_digests(state["w"])}
    files = _files(path)

    rc, out, err = tsck_cli(capsys, "du", path, "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["logical_bytes"] == 2 * one and d["distinct_bytes"] == one
    assert d["dedup_ratio"] == 2.0  # not 2 * one / every stored block, the deleted ref's included
    assert d["used_block_bytes"] == sum(files[k] for k in blocks_of_a)
    assert d["compression_ratio"] == 4 * BS / d["used_block_bytes"]
    assert 0.99 < d["compression_ratio"] <= 1.0  # random floats: stored as they are, a header each
    assert d["physical_bytes"] == sum(files.values())

    rc, text, _ = tsck_cli(capsys, "du", path)
    lines = {ln.split()[0]: " ".join(ln.split()) for ln in text.splitlines() if ln and not ln.startswith(" ")}
    assert lines["dedup"].startswith("dedup 2.00x (")
    assert lines["compression"].startswith("compression 1.00x (")
    assert lines["orphans"].startswith(f"orphans {d['orphans']['bytes'] / 1000:.2f} kB "
                                       f"({d['orphans']['objects']} stored objects")

    assert tsck_cli(capsys, "gc", path)[0] == 0
    gone = {k: v for k, v in files.items() if k not in _files(path)}
    # b's 3 blocks of its own, its top node and its commit
    assert d["orphans"] == {"objects": len(gone), "bytes": sum(gone.values()), "blocks": 3, "nodes": 1,
                            "commits": 1}
    rc, out, _ = tsck_cli(capsys, "du", path, "--json")
    after = json.loads(out)
    assert after["orphans"] == {"objects": 0, "bytes": 0, "blocks": 0, "nodes": 0, "commits": 0}
    assert (after["dedup_ratio"], after["compression_ratio"]) == (d["dedup_ratio"], d["compression_ratio"])


def test_plot_history_is_the_store_as_it_was(tmp_path, capsys, monkeypatch):
    """The left panel's stored line is the store's block bytes as they were after each
    commit and each gc (measured on disk here), from 0: the writes of commits that
    retention, delete-ref and forget dropped are drawn at their time, not piled up at the
    start, and the gcs that removed them take them away at theirs."""
    monkeypatch.delenv("TSCK_STORE", raising=False)
    path = tmp_path / "s"
    base = vec(1, 4)
    seen = []  # block bytes on disk after each commit and each gc, in order

    def on_disk():
        seen.append(sum(block_sizes_on_disk(path).values()))

    def gc():
        assert s.gc().deleted_block_bytes > 0
        on_disk()

    s = tsck.open_store(path, block_size=BS, inline_threshold=1024)
    with s:
        for step in range(3):
            s.put_snapshot({"base": base, "h": vec(10 + step, 2)}, ref="prod/main", step=step)
            on_disk()
            s.put_snapshot({"base": base, "h": vec(20 + step, 1)}, ref="exp/main", step=step)
            on_disk()
        s.set_retention("exp", tsck.Retention(keep_last=1))
        gc()                                                       # retention drops exp@0 and exp@1
        s.put_snapshot({"x": vec(30, 3)}, ref="tmp/main", step=0)
        on_disk()
        s.delete_ref("tmp/main")
        s.put_snapshot({"base": base, "h": vec(13, 2)}, ref="prod/main", step=3)
        on_disk()
        s.forget("prod/main@1")
        gc()                                                       # tmp's and prod@1's blocks
    assert len(seen) == 10 and seen[-1] == sum(block_sizes_on_disk(path).values())

    rc, out, err = tsck_cli(capsys, "du", path, "--plot", tmp_path / "u.png", "--json")
    assert rc == 0, err
    p = json.loads(out)["plot"]["physical"]
    assert p["start"] == 0 and p["gcs"] == 2 and p["dropped"] == 4
    assert p["stored"] == seen
    assert max(p["stored"]) == max(seen)  # never a store bigger than the one that was
    assert p["times"] == sorted(p["times"])
