"""The command line's own words, through the real entry point."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.cli import build_parser

import _zygote as zygote

from _util import REPO, child_env, rand_tensor, run_cli



@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("msg") / "s"
    with tsck.open_store(path, block_size=64 * 1024) as s:
        s.put_snapshot({"w": rand_tensor(torch.float32, (1024, 1024), seed=1)}, ref="j/main", step=1)
        s.tag("first", "j/main")
        # A name older versions accepted: readable after `--`.
        info = s.put_snapshot({"x": torch.ones(3)}, ref="j/other", step=2)
        s.reftable.compare_and_swap("-rf", None, bytes.fromhex(info.root), message="made by an older version")
    return path


def _runs(*argvs):
    with ThreadPoolExecutor(4) as ex:  # each run imports torch: side by side
        return list(ex.map(lambda a: run_cli(*a), argvs))


def test_one_line_errors_that_say_what_to_do(store_path):
    scheme, short, clash, dash = _runs(("refs", "htps://bucket/x"), ("show", store_path, "84e2"),
                                       ("tag", store_path, "first", "j/main"), ("log", store_path, "-rf"))
    for r in (scheme, short, clash, dash):
        assert r.returncode == 2 and r.stderr.startswith("tsck: error:") and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "unknown URL scheme 'htps://'" in scheme.stderr and "ref table" not in scheme.stderr
    assert "root prefix needs at least 8 hex digits" in short.stderr
    assert "tag 'first' already exists (on " in clash.stderr and "immutable" in clash.stderr
    assert "<absent>" not in clash.stderr
    assert "-rf" in dash.stderr  # argparse's own complaint about the option-like name, on one line


def test_a_name_beginning_with_a_dash_is_refused_at_creation_and_read_after_double_dash(store_path, tmp_path):
    with tsck.open_store(tmp_path / "n") as s:
        for bad in ("-rf", "--x"):
            with pytest.raises(tsck.InvalidName, match="begins with '-'"):
                s.put_snapshot({"x": torch.ones(1)}, ref=bad)
            with pytest.raises(tsck.InvalidName, match="begins with '-'"):
                s.put_snapshot({"x": torch.ones(1)}, ref="a/b", job=bad)
        s.put_snapshot({"x": torch.ones(1)}, ref="a/-b")  # only the first character matters
        with pytest.raises(tsck.InvalidName, match="begins with '-'"):
            s.tag("-t", "a/-b")
        assert list(s.refs()) == ["a/-b"] and s.tags() == {}
    r = run_cli("log", store_path, "--", "-rf")
    assert r.returncode == 0 and "step        2" in r.stdout, r.stderr


def test_bare_tsck_help_and_version():
    bare, helped, version = _runs((), ("--help",), ("--version",))
    assert bare.returncode == 2 and "the following arguments are required" not in bare.stderr
    assert helped.returncode == 0 and version.returncode == 0
    assert version.stdout.strip() == f"tsck (tensorstore_ck) {tsck.__version__}"
    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    verbs = [c.dest for c in sub._choices_actions]
    assert len(verbs) >= 15 and {"delete-ref", "untag", "forget", "retention"} <= set(verbs)
    for text in (bare.stderr, helped.stdout):
        lines = text.splitlines()
        for verb, action in zip(verbs, sub._choices_actions):
            # every verb on one line with its one-line help
            assert any(line.split()[:1] == [verb] and action.help in line for line in lines), (verb, text)


def _on_a_terminal(*args, timeout=120) -> str:
    """Run tsck with stderr on a pseudo-terminal (stdout piped); what the terminal got."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a terminal has a size
    p = zygote.Popen([sys.executable, "-m", "tensorstore_ck", *map(str, args)], stdout=subprocess.PIPE,
                     stderr=slave, env=child_env(cli=True, COLUMNS="120"), cwd=str(REPO))
    os.close(slave)
    got = b""
    while True:
        r, _, _ = select.select([master], [], [], timeout)
        if not r:
            p.kill()
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed its side
            break
        if not chunk:
            break
        got += chunk
    p.wait(timeout)
    os.close(master)
    return got.decode(errors="replace")


def test_progress_counts_bytes_on_a_terminal_only(store_path):
    term = _on_a_terminal("fsck", store_path)
    assert re.search(r"fsck: +\d+%\|.*\| [\d.]+[kMG]?B/[\d.]+MB ", term), term  # bytes, of the whole
    piped = run_cli("fsck", store_path)
    assert piped.returncode == 0 and piped.stderr == ""  # no bar when stderr is no terminal
    # checkout to a file and import from one: bytes read, bytes hashed and written
    out = store_path.parent / "w.safetensors"
    term = _on_a_terminal("checkout", store_path, "j/main", out, "--force")
    assert re.search(r"checkout: +\d+%\|.*\| [\d.]+[kMG]?B/[\d.]+MB ", term), term
    term = _on_a_terminal("import", store_path, "imported/main", out)
    assert re.search(r"put: +\d+%\|.*\| [\d.]+[kMG]?B/[\d.]+MB ", term), term
    piped = run_cli("checkout", store_path, "j/main", out, "--force")
    assert piped.returncode == 0 and piped.stderr == ""


def test_sizes_are_decimal_si_everywhere(capsys):
    """One unit system for every size shown (tensorstore_ck/util/units.py): decimal SI, so the
    progress bar, the CLI's text and the committed log line say the same of one size."""
    from tensorstore_ck.cli import human
    from tensorstore_ck.util.progress import progress_bar
    bar = progress_bar(True, "fsck", total=1_500_000, unit="B")
    bar.update(750_000)
    shown = str(bar)
    bar.close()
    capsys.readouterr()
    assert "750kB/1.50MB" in shown, shown  # not 1.43 "MB" of 1024 x 1024 bytes
    assert [human(n) for n in (999, 1000, 1_500_000, 2_000_000_000)] == ["999 B", "1.00 kB", "1.50 MB", "2.00 GB"]
    from tensorstore_ck.util.units import human_bytes
    assert human_bytes(999_999) == "1.00 MB"
