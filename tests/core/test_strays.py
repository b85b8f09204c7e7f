"""Names in storage that are not object keys ("strays": a backup copy, an editor's
swap file, a half-finished migration) are reported, never parsed, never deleted.

Before keys moved into assets.py, gc and fsck parsed every listed name as hex:
a 64-character non-hex file under blocks/ ended both with
`ValueError: invalid literal for int() with base 16`.
"""
from __future__ import annotations

import sys

import torch

import tensorstore_ck as tsck

import _zygote as zygote

STRAYS = [
    "blocks/00/backup-of-" + "0" * 54,            # 64 characters, not hex
    "blocks/ab/" + "cd" * 32,                     # hex, but the fan-out folder does not match
    "nodes/zz/" + "f" * 64,                       # a folder that is not hex
    "commits/" + "0" * 64,                        # no fan-out folder
]


def _store_with_strays(path):
    s = tsck.open_store(path)
    s.put_snapshot({"w": torch.arange(50000.0)}, ref="a/b", step=1)
    s.put_snapshot({"w": torch.zeros(50000)}, ref="a/b", step=2)
    s.set_retention("a", tsck.Retention(keep_last=1))
    for key in STRAYS:
        s.storage.put_if_absent(key, [b"not an object"])
    s.storage.sync()
    return s


def test_gc_and_fsck_report_strays_and_keep_them(tmp_path):
    with _store_with_strays(tmp_path / "s") as s:
        rep = s.fsck()
        assert sorted(f.key for f in rep.findings if f.problem == "stray") == sorted(STRAYS)
        assert not [f for f in rep.findings if f.problem != "stray"]
        g = s.gc()
        assert sorted(g.strays) == sorted(STRAYS) and g.deleted_objects > 0  # step 1 expired and swept
        for key in STRAYS:
            assert s.storage.exists(key), key
        assert torch.equal(s.checkout("a/b")["w"], torch.zeros(50000))
        rec = s.recover()
        assert any("not an object key" in u for u in rec.unreadable)


def test_cli_gc_and_fsck_with_a_stray(tmp_path):
    _store_with_strays(tmp_path / "s").close()
    for args, want in ((["fsck"], 1), (["gc"], 0), (["gc", "--dry-run"], 0)):
        r = zygote.run([sys.executable, "-m", "tensorstore_ck", *args, str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=120)
        assert r.returncode == want, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and "ValueError" not in r.stderr
    r = zygote.run([sys.executable, "-m", "tensorstore_ck", "fsck", str(tmp_path / "s")],
                   capture_output=True, text=True, timeout=120)
    assert "stray" in r.stdout and "backup-of-" in r.stdout
