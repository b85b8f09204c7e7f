"""What an operator watches: a log line per committed, skipped or failed snapshot; the
put's duration and stall in SnapshotInfo and `tsck log/show --json`; `tsck -v`,
`--log-level`, `--log-format json`; CheckpointManager(on_commit=); pins listed by
Store.pins() and `tsck refs`, marked by `log` and `show`; progress bars whose total is
the work done (fsck) and a restore that shows its progress when asked."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import struct
import subprocess
import sys
import termios
import threading

import pytest
import torch

import _zygote as zygote
from _util import child_env, cli_here

import tensorstore_ck as tsck
import tensorstore_ck.errors
from tensorstore_ck.train import CheckpointManager, CommitEvent, TrainState

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _records(caplog, event: str) -> list:
    return [r for r in caplog.records if getattr(r, "tsck", {}).get("event") == event]


# -- durations and the log line per committed snapshot ------------------------------
def test_each_committed_snapshot_logs_one_info_line_with_its_durations(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tensorstore_ck")
    with tsck.open_store(tmp_path / "s") as s:
        a = s.put_snapshot({"w": torch.randn(64, 1024)}, "run/main", step=10)
        b = s.put_snapshot({"w": torch.randn(64, 1024)}, "run/main", step=20, blocking=False).result()
    lines = _records(caplog, "committed")
    assert [r.tsck["step"] for r in lines] == [10, 20]
    for r, info in zip(lines, (a, b)):
        assert r.levelno == logging.INFO and r.name.startswith("tensorstore_ck.")
        msg = r.getMessage()
        assert "ref run/main step" in msg and f"root {info.root[:16]}" in msg and "new" in msg
        assert re.search(r" in \d+\.\d\ds \(stall \d+\.\d\ds\)", msg), msg
        assert r.tsck["bytes"] == info.bytes_total == 64 * 1024 * 4 and r.tsck["bytes_new"] == info.bytes_new
    # the durations are the put's: a blocking put stalls its caller all along, an
    # asynchronous one only while it is staged
    assert a.seconds is not None and a.stall == a.seconds
    assert b.seconds is not None and b.stall is not None and 0 <= b.stall <= b.seconds
    with tsck.open_store(tmp_path / "s") as s:  # read back later: they live in the commit and its catalog row
        got = {i.step: i for i in s.log("run/main")}
        assert (got[10].seconds, got[10].stall) == (a.seconds, a.stall)
        assert (got[20].seconds, got[20].stall) == (b.seconds, b.stall)


def test_log_and_show_json_carry_the_durations_and_old_commits_still_read(tmp_path, capsys):
    path = tmp_path / "s"
    with tsck.open_store(path) as s:
        new = s.put_snapshot({"w": torch.randn(32, 1024)}, "run/main", step=1)
        # A commit written before durations were recorded: its stats have no put_us/stall_us.
        tree = s.publisher.write_nodes({"x": 1})[0]
        old = s.commit_tree(tree, ref="old/main", job="old", step=5, metrics={}, meta={},
                            stats={"bytes_total": 0, "bytes_new": 0, "blocks_total": 0, "blocks_new": 0})
    rc, out, _ = cli_here(capsys, "log", path, "run/main", "--json")
    assert rc == 0
    (row,) = json.loads(out)
    assert row["seconds"] == pytest.approx(new.seconds) and row["stall"] == pytest.approx(new.stall)
    rc, out, _ = cli_here(capsys, "show", path, "run/main", "--json")
    assert rc == 0 and json.loads(out)["seconds"] == pytest.approx(new.seconds)
    rc, out, _ = cli_here(capsys, "show", path, "run/main")
    assert rc == 0 and re.search(r"^took +\d+\.\d{3}s \(the caller was blocked \d+\.\d{3}s\)$", out, re.M), out
    rc, out, _ = cli_here(capsys, "show", path, old.root, "--json")
    d = json.loads(out)
    assert rc == 0 and d["step"] == 5 and d["seconds"] is None and d["stall"] is None
    rc, out, _ = cli_here(capsys, "show", path, old.root)
    assert rc == 0 and "took" not in out


def test_a_skipped_and_a_failed_asynchronous_snapshot_each_log_why(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tensorstore_ck")
    with tsck.open_store(tmp_path / "s", max_inflight=1) as s:
        first = s.put_snapshot({"w": torch.randn(8, 1024)}, "run/main", step=1)
        gate = threading.Event()
        s.after_in_flight(lambda: gate.wait(60))  # the background publisher is busy until the gate opens
        f2 = s.put_snapshot({"w": torch.randn(8, 1024)}, "run/main", step=2, blocking=False)
        mgr = CheckpointManager(s, job="run", state=TrainState(model=torch.nn.Linear(4, 4)), every_steps=1,
                                when_busy="skip")
        assert mgr.step(3) is None  # the one slot is taken: skipped
        gate.set()
        f2.result(timeout=60)
        # conditional on the ref still pointing at `first`: it no longer does, so the
        # background commit fails
        bad = s.put_snapshot({"w": torch.randn(8, 1024)}, "run/main", step=4, blocking=False,
                             expected=first.root)
        with pytest.raises(tsck.errors.RefConflict):
            bad.result(timeout=60)
        with pytest.raises(tsck.errors.RefConflict):
            s.raise_pending_error()
        mgr.close()
    (skip,) = _records(caplog, "skipped")
    assert skip.tsck["step"] == 3 and skip.tsck["ref"] == "run/main" and "when_busy='skip'" in skip.getMessage()
    (fail,) = _records(caplog, "failed")
    assert fail.levelno == logging.WARNING and fail.tsck["step"] == 4 and "RefConflict" in fail.getMessage()
    assert [r.tsck["step"] for r in _records(caplog, "committed")] == [1, 2]


# -- the CheckpointManager's hook ----------------------------------------------------
@pytest.mark.parametrize("async_", [True, False], ids=["async", "blocking"])
def test_on_commit_gets_one_event_per_committed_snapshot(tmp_path, async_):
    events: list[CommitEvent] = []
    model = torch.nn.Linear(256, 256)
    with tsck.open_store(tmp_path / "s") as s:
        mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=2, async_=async_,
                                retention=tsck.Retention(keep_last=2), on_commit=events.append)
        for step in range(1, 9):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.step(step)
        mgr.close()
        log = {i.step: i for i in s.log("run/main")}
    assert [e.step for e in events] == [2, 4, 6, 8]
    first, *rest = events
    assert first.since_last is None  # the job's first snapshot
    for prev, e in zip(events, rest):
        assert e.since_last == pytest.approx(e.info.time - prev.info.time)
    for e in events:
        assert e.ref == "run/main" and e.root == e.info.root
        assert e.seconds is not None and e.seconds > 0 and e.stall is not None and 0 <= e.stall <= e.seconds
        assert e.bytes_new == e.info.bytes_new > 0 and e.bytes_total == e.info.bytes_total
        assert e.failures == 0 and e.skipped == 0 and e.prune_backlog >= 0
        assert e.store_size is None or e.store_size >= 0  # (measured off the training thread: test_store_size)
    assert log[8].root == events[-1].root  # what the hook was told is what the store holds


def test_on_commit_counts_failures_and_a_failing_hook_never_stops_training(tmp_path, caplog):
    seen: list[CommitEvent] = []

    def hook(e):
        seen.append(e)
        raise RuntimeError("the dashboard is down")

    with tsck.open_store(tmp_path / "s") as s:
        mgr = CheckpointManager(s, job="run", state=TrainState(model=torch.nn.Linear(4, 4)), every_steps=1,
                                async_=False, on_commit=hook)
        mgr.step(1)
        s.tag("taken", "run/main")
        mgr.ref = "taken"  # a ref name a tag holds: the put is refused (RefConflict), counted, raised
        with pytest.raises(tsck.errors.RefConflict):
            mgr.step(2)
        mgr.ref = "run/main"
        mgr.step(3)
        mgr.close()
    assert [e.step for e in seen] == [1, 3] and [e.failures for e in seen] == [0, 1]
    assert sum("on_commit hook failed" in r.getMessage() for r in caplog.records) == 2
    with pytest.raises(tsck.errors.InvalidArgument, match="on_commit"):
        CheckpointManager(None, job="x", on_commit="not callable")


# -- tsck -v / --log-level / --log-format json ----------------------------------------
def test_cli_log_options(tmp_path, capsys):
    path = tmp_path / "s"
    src = tmp_path / "w.pt"
    torch.save({"w": torch.randn(16, 1024)}, src)
    with tsck.open_store(path):
        pass
    lg = logging.getLogger("tensorstore_ck")
    before = (list(lg.handlers), lg.level, lg.propagate)
    # Without a log option nothing is logged (as before).
    rc, _, err = cli_here(capsys, "import", path, "imp/main", src, "--step", "1")
    assert rc == 0 and err == ""
    # -v before the command: INFO lines as text, the snapshot's among them
    rc, _, err = cli_here(capsys, "-v", "import", path, "imp/main", src, "--step", "2")
    assert rc == 0 and re.search(r"INFO tensorstore_ck\.write\.publish: snapshot committed: ref imp/main step 2", err), err
    # after the command, in JSON: one object a line, with the snapshot's fields
    rc, _, err = cli_here(capsys, "import", path, "imp/main", src, "--step", "3", "--log-format", "json", "-v")
    assert rc == 0
    objs = [json.loads(x) for x in err.splitlines()]
    (c,) = [o for o in objs if o.get("event") == "committed"]
    assert c["level"] == "INFO" and c["logger"] == "tensorstore_ck.write.publish" and c["step"] == 3
    assert c["ref"] == "imp/main" and c["bytes"] == 16 * 1024 * 4 and c["seconds"] > 0 and "time" in c
    rc, _, err = cli_here(capsys, "--log-level", "debug", "gc", path)
    assert rc == 0 and (" DEBUG " in err or " INFO " in err)
    rc, _, err = cli_here(capsys, "--log-level", "warning", "gc", path)
    assert rc == 0 and err == ""
    rc, _, err = cli_here(capsys, "--log-level", "loud", "refs", path)
    assert rc == 2 and err.startswith("tsck: error: argument --log-level: must be one of debug")
    rc, _, err = cli_here(capsys, "refs", path, "--log-format", "xml")
    assert rc == 2 and "must be text or json" in err
    # main() leaves logging as it found it
    assert (list(lg.handlers), lg.level, lg.propagate) == before


# -- pins -------------------------------------------------------------------------------
def test_pins_are_listed_and_marked(tmp_path, capsys):
    path = tmp_path / "s"
    with tsck.open_store(path) as s:
        one = s.put_snapshot({"w": torch.randn(8, 1024)}, "run/main", step=1)
        two = s.put_snapshot({"w": torch.randn(8, 1024)}, "run/main", step=2)
        assert s.pins() == {}
        s.pin("run/main@1")
        assert list(s.pins()) == [one.root] and s.pins()[one.root].step == 1
    rc, out, _ = cli_here(capsys, "refs", path)
    assert rc == 0 and re.search(rf"^pin run/main@1 +{one.root[:16]}  step +1 ", out, re.M), out
    rc, out, _ = cli_here(capsys, "refs", path, "--json")
    d = json.loads(out)
    assert rc == 0 and list(d["pins"]) == [one.root] and d["pins"][one.root]["step"] == 1
    rc, out, _ = cli_here(capsys, "log", path, "run/main")
    marks = {ln.split()[0]: ln.endswith("[pinned]") for ln in out.splitlines()}
    assert rc == 0 and marks == {one.root[:16]: True, two.root[:16]: False}
    rc, out, _ = cli_here(capsys, "log", path, "run/main", "--json")
    assert rc == 0 and {r["root"]: r["pinned"] for r in json.loads(out)} == {one.root: True, two.root: False}
    rc, out, _ = cli_here(capsys, "show", path, "run/main@1")
    assert rc == 0 and re.search(r"^pinned +yes", out, re.M)
    rc, out, _ = cli_here(capsys, "show", path, "run/main", "--json")
    assert rc == 0 and json.loads(out)["pinned"] is False
    rc, out, _ = cli_here(capsys, "unpin", path, "run/main@1")
    rc, out, _ = cli_here(capsys, "refs", path, "--json")
    assert json.loads(out)["pins"] == {}


# -- progress -----------------------------------------------------------------------
def _run_on_a_terminal(argv: list) -> tuple[int, str, str]:
    """The CLI with stderr on a pseudo-terminal (it draws bars only on a terminal), every
    bar update drawn (TQDM_MININTERVAL=0) -> (rc, stdout, what the terminal showed)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    env = child_env(cli=True, TQDM_MININTERVAL="0", TQDM_MINITERS="1")
    p = zygote.Popen([sys.executable, "-m", "tensorstore_ck", *map(str, argv)], stdin=subprocess.DEVNULL,
                     stdout=subprocess.PIPE, stderr=slave, env=env, cwd=REPO)
    os.close(slave)
    shown = bytearray()
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        out = p.communicate(timeout=300)[0]
    finally:
        os.close(master)
    return p.returncode, out.decode(), shown.decode(errors="replace")


def test_the_fsck_bar_counts_the_bytes_it_checks_and_ends_at_100_percent(tmp_path):
    """Snapshots that share sub-trees (optimizer moments alike, a frozen tower) name
    each block once in the walk but count it in every place in bytes_total: a bar
    over those bytes stopped at about a quarter here."""
    t = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    with tsck.open_store(tmp_path / "s", block_size=16 * 1024) as s:
        for step in range(3):
            s.put_snapshot({"adam": {k: t.clone() for k in "abcd"}, "own": torch.randn(128, 128) + step},
                           "run/main", step=step)
    rc, out, shown = _run_on_a_terminal(["fsck", tmp_path / "s"])
    assert rc == 0 and out.startswith("ok: 3 snapshots"), (out, shown)
    percents = [int(x) for x in re.findall(r"fsck: +(\d+)%\|", shown)]
    assert percents and max(percents) == 100, shown[-2000:]
    done, total = re.findall(r"\| *([\d.]+[kMG]?B)/([\d.]+[kMG]?B) ", shown)[-1]
    assert done == total, shown[-1000:]


def test_restore_latest_shows_progress_when_asked(tmp_path, capfd):
    model = torch.nn.Linear(256, 256)
    with tsck.open_store(tmp_path / "s") as s:
        mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=1, async_=False)
        mgr.step(5)
        mgr.close()
        capfd.readouterr()
        fresh = torch.nn.Linear(256, 256)
        mgr = CheckpointManager(s, job="run", state=TrainState(model=fresh))
        assert mgr.restore_latest(progress=True) == 5
        err = capfd.readouterr().err
        assert "checkout" in err and "B/" in err, err
        assert mgr.restore_latest() == 5 and capfd.readouterr().err == ""  # not asked: nothing drawn
        mgr.close()
    assert torch.equal(fresh.weight, model.weight)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_on_commit_under_ddp_hears_every_collective_snapshot_on_every_rank(tmp_path, mode):
    """The README's manager on two gloo ranks (tests/helpers/ddp_manager.py, scenario
    loop): each rank's hook hears each snapshot step() took, once, with its root and
    the durations rank 0's call recorded."""
    from _util import rank_results, run_worker_scenario
    out = run_worker_scenario(os.path.join(REPO, "tests", "helpers", "ddp_manager.py"), tmp_path, "loop", mode,
                              limit=300.0)
    for d in rank_results(out, "loop", 2):
        taken = {int(s): root for s, root in d["steps"].items() if root is not None}
        assert {step: root for step, root, _ in d["commits"]} == taken and len(d["commits"]) == len(taken)
        assert all(seconds is not None and seconds > 0 for _, _, seconds in d["commits"])
